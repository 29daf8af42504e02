"""What the engine hands back: per-step deltas (for the worker) and whole outputs (offline API).

Plain Python, no tensors: these cross threads and are converted to protobuf by the worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a sequence ended. STOP_STRING is decided by the detokenizer, not the engine."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's context
    STOP_STRING = "stop_string"
    ABORT = "abort"  # cancelled by the caller or the router
    ERROR = "error"  # the engine failed this request (message in SequenceDelta.error)


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top-n alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SequenceDelta:
    """One request's news from one engine step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str = "INTERNAL"  # gRPC status name of `error`
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including new_token_ids
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class EngineLoad:
    """What a router needs for placement, sent with every step."""

    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    resident_adapters: tuple[str, ...] = ()
    loading_adapters: tuple[str, ...] = ()
    lora_slots: int = 0  # device slots for adapters (0: LoRA off)
    # The most distinct adapters served in flight at once: the slots, or the host cache when
    # the slots are time-sliced among its adapters (0: LoRA off).
    lora_adapter_capacity: int = 0
    # For the router's queueing-delay estimate (services/engine/load_rates.py): prompt tokens
    # not yet prefilled, and the rates measured over the engine's recent busy time.
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    finished_per_s: float = 0.0
    # When the running batch's slots free up (services/common/protocol/finish_profile.py):
    # steps until each running sequence reaches its token limit, sampled, and how many
    # sequences that describes; ended early per token generated (stop tokens, aborts).
    finish_steps: tuple[int, ...] = ()
    finish_steps_of: int = 0
    stop_hazard: float = 0.0


@dataclass
class StepOutput:
    """Everything one `LLMEngine.step()` produced: every sequence's news plus the engine's load."""

    deltas: list[SequenceDelta]
    load: EngineLoad
    step_time_s: float = 0.0
    num_batched_tokens: int = 0
    planned_ahead: bool = False  # planned before the step ahead of it was read (overlap.py)


@dataclass
class CompletionOutput:
    """One prompt's finished result from the offline `LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_prompt_tokens: int = 0
    error: str | None = None  # why it ended with finish_reason ERROR
    adapter: str | None = None  # the LoRA adapter it ran with (None: the base model)
