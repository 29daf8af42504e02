"""Encoding prompts: text and chat, special tokens, and truncation that is never silent."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.tokenizer.tokenize import EncodeItem

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_text_matches_the_hf_tokenizer(smollm) -> None:
    text = "Hello 😀 世界, how are you?"
    assert smollm.encode_item(EncodeItem(text=text)) == smollm.hf_tokenizer.encode(text)
    assert smollm.encode_item(
        EncodeItem(text=text, add_special_tokens=False)
    ) == smollm.hf_tokenizer.encode(text, add_special_tokens=False)


def test_chat_matches_apply_chat_template(smollm) -> None:
    expected = smollm.hf_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True
    )
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert smollm.encode_item(EncodeItem(chat=CHAT)) == list(expected)
    no_prompt = smollm.encode_item(EncodeItem(chat=CHAT, add_generation_prompt=False))
    assert len(no_prompt) < len(expected)


def test_over_long_prompt_is_an_error_saying_how_long(smollm) -> None:
    text = "one two three four five six seven eight nine ten"
    length = len(smollm.encode_item(EncodeItem(text=text)))
    assert smollm.encode_item(EncodeItem(text=text, max_prompt_tokens=length))
    with pytest.raises(InvalidArgumentError, match=f"prompt is {length} tokens.*limit of 5"):
        smollm.encode_item(EncodeItem(text=text, max_prompt_tokens=5))
    chat_length = len(smollm.encode_item(EncodeItem(chat=CHAT)))
    with pytest.raises(InvalidArgumentError, match=f"prompt is {chat_length} tokens"):
        smollm.encode_item(EncodeItem(chat=CHAT, max_prompt_tokens=3))


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        (EncodeItem(text=""), "text is empty"),
        (EncodeItem(), "needs text or chat"),
        (EncodeItem(chat=[]), "at least one message"),
        (EncodeItem(chat=[{"role": "", "content": "x"}]), "empty role"),
        (EncodeItem(text="x", max_prompt_tokens=-1), "max_prompt_tokens"),
    ],
)
def test_bad_items_are_invalid_arguments(smollm, item, fragment) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        smollm.encode_item(item)


def test_info_facts(smollm) -> None:
    assert smollm.vocab_size == len(smollm.hf_tokenizer)
    assert smollm.hf_tokenizer.eos_token_id in smollm.eos_token_ids
    assert smollm.chat_template is not None


def _model_dir_with_template(smollm, tmp_path, template: str | None):
    import json
    import shutil

    from services.common.model_files import resolve_model
    from services.tokenizer.tokenize import TokenizerModel

    source = resolve_model(None).tokenizer_dir
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(source / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_bytes(b"")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
        (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return TokenizerModel.load(str(tmp_path))


def test_a_model_shipping_a_malicious_template_cannot_run_it(smollm, tmp_path) -> None:
    evil = "{{ cycler.__init__.__globals__.os.system('touch " + str(tmp_path / "pwned") + "') }}"
    model = _model_dir_with_template(smollm, tmp_path, evil)
    with pytest.raises(InvalidArgumentError, match="unsafe|sandbox"):
        model.encode_item(EncodeItem(chat=CHAT))
    assert not (tmp_path / "pwned").exists()
    assert model.encode_item(EncodeItem(text="text still works"))


def test_a_model_without_template_refuses_chat(smollm, tmp_path) -> None:
    model = _model_dir_with_template(smollm, tmp_path, None)
    assert model.chat_template is None
    with pytest.raises(InvalidArgumentError, match="no chat template"):
        model.encode_item(EncodeItem(chat=CHAT))


def test_truncation_in_tokenizer_json_is_switched_off(byte_fallback) -> None:
    from transformers import PreTrainedTokenizerFast

    from services.tokenizer.tokenize import TokenizerModel

    byte_fallback.enable_truncation(max_length=3)
    try:
        wrapped = PreTrainedTokenizerFast(tokenizer_object=byte_fallback)
        model = TokenizerModel(wrapped, name="truncating")
        ids = model.encode_item(EncodeItem(text="the world in the world"))
        assert len(ids) > 3
        with pytest.raises(InvalidArgumentError, match=f"prompt is {len(ids)} tokens"):
            model.encode_item(EncodeItem(text="the world in the world", max_prompt_tokens=3))
    finally:
        byte_fallback.no_truncation()
