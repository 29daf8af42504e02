"""One request's state inside the engine: its tokens, progress, KV blocks and status.

Plain Python (no tensors), shared by the scheduler, block manager and engine. A sequence is
computed in the vLLM-v1 way: `num_computed_tokens` of its tokens are in the KV cache, and each
step computes some of the rest (a prefill chunk, or the one token sampled last step). Preemption
by recompute just resets `num_computed_tokens` and frees the blocks; the output so far is kept and
recomputed as part of the prompt, so a resumed sequence continues exactly where it stopped.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from services.common.protocol.sampling_params import SamplingParams
from services.engine.outputs import FinishReason, TokenLogprob

_arrivals = itertools.count()

# Placeholder for a token sampled on the device whose value the host has not read yet (the
# overlapped engine path): the runner feeds it from the previous step's sampled ids.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being generated. Identity equality: each object is one live request."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    priority: int = 0
    adapter_slot: int = -1
    # What the prefix cache keys blocks by: the adapter's name and file checksum (the engine
    # sets it), so re-registering a name with new files never reuses the old files' KV.
    adapter_id: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrivals))
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)  # prompt + output, kept in step for speed
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table already registered in the cache
    last_block_hash: int | None = None  # chain hash of block num_hashed_blocks - 1
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] | None = None
    generator: Any = None  # torch.Generator for a seeded request, created by the sampler
    num_pending_tokens: int = 0  # trailing PENDING_TOKEN placeholders (overlapped steps only)
    # Where its KV blocks wait in host memory while it is paused and swapped out: (first host
    # block, block count); None while they are on the device (services/engine/kv_swap.py).
    host_extent: tuple[int, int] | None = None
    argmax_from: float = field(init=False)  # params.argmax_from, read once (checked each step)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = self.prompt_token_ids + list(self.output_token_ids)
        if self.adapter_id is None:
            self.adapter_id = self.adapter
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        self.argmax_from = self.params.argmax_from

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may hold at most: its prompt plus max_tokens."""
        return self.num_prompt_tokens + self.params.max_tokens

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)

    def append_pending_token(self) -> None:
        """Append a placeholder for a token sampled on the device but not read yet."""
        self.output_token_ids.append(PENDING_TOKEN)
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int) -> None:
        """The oldest placeholder's value has arrived."""
        index = len(self.token_ids) - self.num_pending_tokens
        self.token_ids[index] = token_id
        self.output_token_ids[index - self.num_prompt_tokens] = token_id
        self.num_pending_tokens -= 1

    def drop_pending_tokens(self) -> None:
        """Forget every placeholder (the sequence finished before they were read)."""
        count = self.num_pending_tokens
        if count:
            del self.token_ids[-count:]
            del self.output_token_ids[-count:]
            self.num_pending_tokens = 0
            self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))

    def reset_for_recompute(self) -> None:
        """Forget the KV cache (preemption by recompute); tokens generated so far are kept."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.last_block_hash = None
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
