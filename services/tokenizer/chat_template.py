"""Chat templates rendered in a sandbox.

A model's chat template is Jinja code shipped with its files, so it is untrusted: it is compiled
in `jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute access to Python internals, no
mutation of inputs, `range` capped), with only the helpers Hugging Face templates use:
`raise_exception`, `strftime_now`, `tojson`, and loop controls (`break`/`continue`). A template
that reaches for internals, raises, or fails to render is the caller's (or the model's) problem,
reported as InvalidArgumentError (gRPC INVALID_ARGUMENT) and never executed. The rendered text is
capped so a looping template cannot exhaust memory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from services.common.errors import InvalidArgumentError


class TemplateRaisedError(Exception):
    """A template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaisedError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but touching an unsafe attribute fails at once (plain Jinja
    would render it as an empty undefined value and carry on)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


def _environment() -> ImmutableSandboxedEnvironment:
    environment = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        autoescape=False,
        undefined=jinja2.Undefined,
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """One compiled chat template; `render` turns chat turns into the prompt text."""

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        max_chars: int = 4_000_000,
    ) -> None:
        if not isinstance(source, str) or not source.strip():
            raise InvalidArgumentError("the chat template is empty")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(
                f"the model's chat template does not compile: {exc}"
            ) from exc
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._max_chars = max_chars

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (dicts with role and content)."""
        if not messages:
            raise InvalidArgumentError("a chat needs at least one message")
        variables: dict[str, Any] = {
            **self._special_tokens,
            **(extra or {}),
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        pieces: list[str] = []
        length = 0
        try:
            for piece in self._template.generate(**variables):
                pieces.append(piece)
                length += len(piece)
                if length > self._max_chars:
                    raise InvalidArgumentError(
                        f"the rendered chat is longer than {self._max_chars} characters"
                    )
        except SecurityError as exc:
            raise InvalidArgumentError(
                f"the chat template was refused by the sandbox: {exc}"
            ) from exc
        except TemplateRaisedError as exc:
            raise InvalidArgumentError(f"the chat template rejected the messages: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise InvalidArgumentError(f"the chat template failed to render: {exc}") from exc
        except (
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            OverflowError,
            RecursionError,
        ) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"the chat template failed to render: {exc}") from exc
        return "".join(pieces)
