"""Loading a model's tokenizer and encoding prompts: raw text or chat turns.

`TokenizerModel.load(model)` resolves the model's files (services.common.model_files) and loads
its Hugging Face tokenizer once; chat turns are rendered with the model's own template in the
sandbox of chat_template.py and then encoded without extra special tokens (the template writes
them, as Hugging Face's apply_chat_template does). `encode_item` never truncates: a prompt longer
than the caller's limit is an InvalidArgumentError that says how long it is. Decoding goes straight
to the Rust `tokenizers` backend, which is what keeps the detokenizer cheap per token.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.tokenizer.chat_template import ChatTemplate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodeItem:
    """One prompt to encode: exactly one of `text` or `chat` (list of role/content dicts)."""

    text: str | None = None
    chat: Sequence[Mapping[str, str]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    max_prompt_tokens: int = 0  # reject a longer prompt (never truncate); 0: no limit


class TokenizerModel:
    """A loaded tokenizer with its chat template, vocabulary size and end-of-sequence ids."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        name: str,
        eos_token_ids: Sequence[int] = (),
        max_text_chars: int = 4_000_000,
    ) -> None:
        self.name = name
        self.hf_tokenizer = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        # Never truncate or pad silently (a tokenizer.json may enable either); configured once
        # here, so the encoding threads only ever read the backend.
        if self.backend.truncation is not None:
            self.backend.no_truncation()
        if self.backend.padding is not None:
            self.backend.no_padding()
        self.vocab_size = len(hf_tokenizer)
        self.max_text_chars = max_text_chars
        eos = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.chat_template: ChatTemplate | None = None
        self._chat_template_error = f"model {name} has no chat template; send text"
        try:
            self.chat_template = _chat_template_of(hf_tokenizer, max_text_chars)
        except InvalidArgumentError as exc:
            log.warning("%s; chat requests will fail", exc.message)
            self._chat_template_error = exc.message

    @classmethod
    def load(cls, model: str | None, *, max_text_chars: int = 4_000_000) -> TokenizerModel:
        """Resolve `model` like the engine does and load its tokenizer."""
        from services.common.model_files import resolve_model

        files = resolve_model(model)
        try:
            hf_tokenizer = _load_hf_tokenizer(Path(files.tokenizer_dir))
        except (OSError, ValueError) as exc:
            raise FailedPreconditionError(
                f"cannot load the tokenizer of {files.name} from {files.tokenizer_dir}: {exc}"
            ) from exc
        if not hasattr(hf_tokenizer, "backend_tokenizer"):
            raise FailedPreconditionError(f"the tokenizer of {files.name} has no fast backend")
        return cls(
            hf_tokenizer,
            name=files.name,
            eos_token_ids=_generation_eos_ids(Path(files.tokenizer_dir)),
            max_text_chars=max_text_chars,
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """Plain decode of ids known to be inside the vocabulary."""
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        if len(text) > self.max_text_chars:
            raise InvalidArgumentError(
                f"text is {len(text)} characters, longer than the limit of {self.max_text_chars}"
            )
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of chat turns, rendered by the model's own template."""
        if self.chat_template is None:
            raise InvalidArgumentError(self._chat_template_error)
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_item(self, item: EncodeItem) -> list[int]:
        """Token ids of one prompt; raises InvalidArgumentError (never truncates)."""
        if item.max_prompt_tokens < 0:
            raise InvalidArgumentError(
                f"max_prompt_tokens must be >= 0, got {item.max_prompt_tokens}"
            )
        if item.chat is not None:
            for index, message in enumerate(item.chat):
                if not message.get("role"):
                    raise InvalidArgumentError(f"chat message {index} has an empty role")
            text = self.render_chat(item.chat, item.add_generation_prompt)
            ids = self.encode_text(text, add_special_tokens=False)
        elif item.text is not None:
            if not item.text:
                raise InvalidArgumentError("text is empty")
            ids = self.encode_text(item.text, add_special_tokens=item.add_special_tokens)
        else:
            raise InvalidArgumentError("an item needs text or chat")
        if not ids:
            raise InvalidArgumentError("the prompt encodes to no tokens")
        if item.max_prompt_tokens and len(ids) > item.max_prompt_tokens:
            raise InvalidArgumentError(
                f"prompt is {len(ids)} tokens, longer than the limit of {item.max_prompt_tokens} "
                "(prompts are never truncated)"
            )
        return ids


# Generic fast-tokenizer classes: loaded without AutoTokenizer, which would read the model's
# config class and import torch (seconds of start-up and hundreds of MB for this service).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_hf_tokenizer(directory: Path) -> Any:
    tokenizer_class = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        tokenizer_class = json.loads((directory / "tokenizer_config.json").read_text()).get(
            "tokenizer_class"
        )
    if (directory / "tokenizer.json").is_file() and tokenizer_class in _GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _chat_template_of(hf_tokenizer: Any, max_chars: int) -> ChatTemplate | None:
    source = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("default") or next(iter(source.values()), None)
    if not source:
        return None
    special_tokens = {
        "bos_token": hf_tokenizer.bos_token,
        "eos_token": hf_tokenizer.eos_token,
        "unk_token": hf_tokenizer.unk_token,
        "pad_token": hf_tokenizer.pad_token,
    }
    return ChatTemplate(source, special_tokens=special_tokens, max_chars=max_chars)


def _generation_eos_ids(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []
