"""Chat templates: the model's own template renders; a malicious one is refused, never run."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.tokenizer.chat_template import ChatTemplate

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_model_template_renders_like_transformers(smollm) -> None:
    ours = smollm.render_chat(MESSAGES, add_generation_prompt=True)
    theirs = smollm.hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    without = smollm.render_chat(MESSAGES, add_generation_prompt=False)
    assert not without.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
        "{{ raise_exception.__globals__ }}",
        "{{ self._TemplateReference__context }}",
    ],
)
def test_templates_reaching_python_internals_are_refused(source: str, tmp_path) -> None:
    template = ChatTemplate(source)
    with pytest.raises(InvalidArgumentError) as info:
        template.render(MESSAGES)
    assert "pwned" not in info.value.message


def test_raise_exception_is_an_invalid_argument() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('Conversation must start with a system turn') }}{% endif %}"
    )
    with pytest.raises(InvalidArgumentError, match="must start with a system turn"):
        template.render(MESSAGES)


def test_helpers_and_loop_controls_work() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}{% if loop.index == 3 %}{% break %}{% endif %}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}|{{ bos_token }}"
    )
    text = template.render(
        [
            {"role": "user", "content": "é"},
            {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "never"},
        ],
    )
    assert text.startswith('{"role": "user", "content": "é"}{"role": "assistant"')
    assert "never" not in text
    assert text.endswith("|4|")
    with_bos = ChatTemplate(
        "{{ bos_token }}{{ messages[0].content }}", special_tokens={"bos_token": "<s>"}
    )
    assert with_bos.render(MESSAGES) == "<s>What is the capital of France?"


def test_message_content_is_data_not_code() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    content = "{{ ''.__class__ }}{% for x in range(3) %}x{% endfor %}"
    assert template.render([{"role": "user", "content": content}]) == content


def test_runaway_output_and_bad_templates_are_invalid_arguments() -> None:
    looping = ChatTemplate(
        "{% for i in range(90000) %}{{ 'x' * 100 }}{% endfor %}", max_chars=10_000
    )
    with pytest.raises(InvalidArgumentError, match="longer than 10000"):
        looping.render(MESSAGES)
    with pytest.raises(InvalidArgumentError):
        ChatTemplate("{% for m in messages %}").render(MESSAGES)
    with pytest.raises(InvalidArgumentError):
        ChatTemplate("{{ messages[5].content }}").render(MESSAGES)
    with pytest.raises(InvalidArgumentError, match="at least one message"):
        ChatTemplate("{{ messages }}").render([])
    with pytest.raises(InvalidArgumentError):
        ChatTemplate("{% for i in range(10**9) %}{% endfor %}").render(MESSAGES)
