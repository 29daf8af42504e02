"""Warm an engine before it reports SERVING: every step shape it can take has run once.

A fresh GPU engine pays on its first steps for what nothing has done yet: Triton compiling a
kernel variant (a variant per specialisation: token counts of 1, multiples of 16 and others
compile apart), cuBLAS choosing and loading a kernel per matrix shape, the allocator growing its
pool, the sampler's first top-k/top-p/penalty/logprob kernels. Those seconds land on the first
requests' time to first token. So the worker runs `warm_up` between loading the model and
saying SERVING: it drives the engine itself through `plan_warmup`'s steps, in order

- prefills of token counts covering the step budget (odd and multiple-of-16 counts, one chunked
  prompt longer than the budget, prefixes shared so a cached-prefix prefill runs too);
- pure decode batches of every CUDA-graph bucket size (each graph replayed once, through the
  engine's overlapped path) and a mixed step (decodes plus a prefill chunk);
- each sampler path: greedy argmax, temperature with top-k/top-p/min-p, penalties, logprobs,
  seeded sampling.

On the CPU the plan is one small step of each kind (start-up stays cheap: no graphs, no JIT).
Planning is plain Python (unit-tested without torch); `warm_up` needs only LLMEngine's public
API, and its requests are gone (blocks freed) when it returns. Tuned kernel choices persist
apart from this (services/engine/tuning_cache.py).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_ID_PREFIX = "warmup-"
MAX_WARMUP_OUTPUT = 4  # the most tokens a warm-up request generates
# The sampler paths a step can take, each with the parameters that select it.
SAMPLER_PATHS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top_k_top_p": {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
    "penalties": {
        "temperature": 0.7,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
    "logprobs": {"temperature": 0.0, "logprobs": 2},
}


@dataclass(frozen=True)
class WarmupRound:
    """Requests added together and stepped until all finish: one step shape (or a few)."""

    name: str
    prompt_lengths: tuple[int, ...]
    max_tokens: int
    sampler_path: str = "greedy"


@dataclass(frozen=True)
class WarmupPlan:
    """The rounds a warm-up runs, in order, and what they cover (for the start-up log)."""

    rounds: tuple[WarmupRound, ...]
    prefill_token_counts: tuple[int, ...] = ()
    decode_batches: tuple[int, ...] = ()
    sampler_paths: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        return (
            f"{len(self.rounds)} rounds: prefill token counts {list(self.prefill_token_counts)}, "
            f"decode batches {list(self.decode_batches)}, sampler paths "
            f"{list(self.sampler_paths)}"
        )


def prefill_token_counts(max_num_batched_tokens: int, max_prompt_len: int) -> tuple[int, ...]:
    """Prompt lengths whose prefills cover the step budget: 1, small odd counts, then powers of
    two up to the budget, each also one token past it (a multiple of 16 and not)."""
    limit = max(1, min(max_num_batched_tokens, max_prompt_len))
    counts = {1, min(7, limit), min(33, limit)}
    size = 16
    while size <= limit:
        counts.add(size)
        counts.add(min(size + 1, limit))
        size *= 2
    counts.add(limit)
    return tuple(sorted(counts))


def plan_warmup(
    *,
    device_type: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    decode_batches: Sequence[int] = (),
) -> WarmupPlan:
    """What to run before SERVING on this engine. `decode_batches`: the runner's CUDA-graph
    buckets (empty: none). Rounds are kept within the KV cache and the engine's limits."""
    max_prompt = max(1, max_model_len - MAX_WARMUP_OUTPUT)  # prompt + output fit the context
    if device_type != "cuda":
        rounds = (
            WarmupRound("prefill+decode", (min(8, max_prompt),), 2),
            WarmupRound("sampler", (min(4, max_prompt),), 2, "top_k_top_p"),
        )
        return WarmupPlan(
            rounds, (min(8, max_prompt),), (1,), ("greedy", "top_k_top_p"), ("cpu: one small step",)
        )
    rounds: list[WarmupRound] = []
    capacity_tokens = num_blocks * block_size
    counts = [c for c in prefill_token_counts(max_num_batched_tokens, max_prompt)]
    counts = [c for c in counts if c + 2 <= capacity_tokens]
    for count in counts:
        rounds.append(WarmupRound(f"prefill {count}", (count,), 1))
    chunked = min(max_num_batched_tokens + max_num_batched_tokens // 2 + 3, max_prompt)
    if chunked > max_num_batched_tokens and chunked + 2 <= capacity_tokens:
        rounds.append(WarmupRound(f"chunked prefill {chunked}", (chunked,), 1))
    batches = []
    for batch in sorted(set(decode_batches)):
        batch = min(batch, max_num_seqs)
        # Each sequence holds a short prompt plus 3 tokens: 1 block, 2 at a block boundary.
        if batch in batches or batch * 2 > num_blocks:
            continue
        batches.append(batch)
        rounds.append(WarmupRound(f"decode batch {batch}", (4,) * batch, 3))
    mixed = min(max_num_seqs - 1, 8)
    long_prompt = min(max_num_batched_tokens, max_prompt)
    if mixed >= 1 and mixed * 4 + long_prompt + 8 <= capacity_tokens:
        # The short prompts fill the first step's budget before the long one, which is chunked:
        # its last chunk runs in one step with the short ones' decodes (a mixed step).
        rounds.append(WarmupRound("mixed", (4,) * mixed + (long_prompt,), 4))
    paths = tuple(SAMPLER_PATHS)
    for path in paths[1:]:
        rounds.append(WarmupRound(f"sampler {path}", (min(12, max_prompt),) * 2, 3, path))
    return WarmupPlan(
        tuple(rounds), tuple(counts), tuple(batches), paths, (f"KV capacity {capacity_tokens}",)
    )


@dataclass
class WarmupReport:
    """What a warm-up ran and how long it took."""

    plan: WarmupPlan
    seconds: float = 0.0
    steps: int = 0
    round_seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        slowest = sorted(self.round_seconds.items(), key=lambda item: -item[1])[:3]
        shown = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in slowest)
        return (
            f"warmed in {self.seconds:.2f}s ({self.steps} steps): {self.plan.describe()}; "
            f"slowest: {shown}"
        )


def warm_up(engine: Any, plan: WarmupPlan, *, seed: int = 0) -> WarmupReport:
    """Run `plan` through `engine` (an LLMEngine that holds no requests of its own yet); every
    warm-up request is finished and its blocks freed on return."""
    report = WarmupReport(plan)
    vocab = int(engine.info.vocab_size)
    rng = random.Random(seed)
    started = time.perf_counter()
    for index, warm_round in enumerate(plan.rounds):
        round_started = time.perf_counter()
        base = {"max_tokens": warm_round.max_tokens, "ignore_eos": True}
        params = SamplingParams(**base, **SAMPLER_PATHS[warm_round.sampler_path])
        # Ordinary ids, away from the special tokens at either end; any id of a tiny vocabulary.
        low = min(100, vocab // 2)
        high = max(low + 1, vocab - 100)
        shared = [rng.randrange(low, high) for _ in range(max(warm_round.prompt_lengths))]
        for row, length in enumerate(warm_round.prompt_lengths):
            # Rows past the first reuse the first row's prefix: prefix-cache hits run too.
            prompt = (
                shared[:length] if row % 2 else [rng.randrange(low, high) for _ in range(length)]
            )
            engine.add_request(f"{WARMUP_ID_PREFIX}{index}-{row}", prompt, params)
        while engine.has_unfinished():
            engine.step()
            report.steps += 1
        report.round_seconds[warm_round.name] = time.perf_counter() - round_started
    report.seconds = time.perf_counter() - started
    return report
