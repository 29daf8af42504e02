"""Sampling parameters of one request, validated once with messages meant for the caller.

Shared by the offline `LLM`, the engine worker and the router (which validates before queueing),
so the same rule gives the same message everywhere. Plain Python: no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.common.errors import InvalidArgumentError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Defaults match vLLM's."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; None = off

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the object is hashable/frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_from(self) -> float:
        """From which output token on a plain argmax picks every token (temperature 0, no
        logprobs, no penalties: min_tokens, before which EOS is masked); inf if never."""
        if (
            self.temperature != 0.0
            or self.logprobs is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        ):
            return math.inf
        return self.min_tokens

    def validate(self) -> None:
        """Raise InvalidArgumentError naming the first bad field."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, high=10.0, low_open=True
        )
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidArgumentError("stop strings must be non-empty strings")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise InvalidArgumentError(
                    f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters"
                )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)

    def validate_for_model(self, prompt_len: int, max_model_len: int, vocab_size: int) -> None:
        """Checks that need the model: context length and vocabulary."""
        if prompt_len < 1:
            raise InvalidArgumentError("the prompt is empty")
        if prompt_len >= max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {prompt_len} tokens; this model's context is {max_model_len} "
                f"tokens and at least one must be left to generate"
            )
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidArgumentError(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) = "
                f"{prompt_len + self.max_tokens} exceeds the model's context of "
                f"{max_model_len} tokens"
            )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidArgumentError(
                    f"stop token id {token_id} is outside the vocabulary (size {vocab_size})"
                )


def validate_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Every id must be an int in [0, vocab_size)."""
    if not token_ids:
        raise InvalidArgumentError("the prompt is empty")
    for position, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise InvalidArgumentError(f"prompt token at position {position} is not an integer")
        if not 0 <= token_id < vocab_size:
            raise InvalidArgumentError(
                f"prompt token id {token_id} at position {position} is outside the vocabulary "
                f"(size {vocab_size})"
            )


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise InvalidArgumentError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidArgumentError(f"{name} must be <= {high}, got {value}")


def _check_float(
    name: str, value: object, *, low: float, high: float, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {value}")
    if value < low or (low_open and value == low):
        sign = ">" if low_open else ">="
        raise InvalidArgumentError(f"{name} must be {sign} {low}, got {value}")
    if value > high:
        raise InvalidArgumentError(f"{name} must be <= {high}, got {value}")
