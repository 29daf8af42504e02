"""A time budget for each engine step: how many prompt tokens a step may prefill.

Every running sequence gets one token per step, so a decoding request's time per output token is
the engine's mean step time; one step that carries a full token budget of prefill (8,192 tokens
on an 80 GB card: ~200 ms for an 8B model) stalls every decode behind it. With a step-time
target (`target_step_ms` > 0, as in Sarathi-Serve's stall-free batching), the scheduler asks
`StepTimeBudget.prefill_tokens(decode_rows)` before it gives any prompt tokens to a step: the
most prefill tokens for which the step's predicted time stays within the target,

    fixed_ms + per_decode_row_ms * decode_rows + per_prefill_token_ms * tokens <= target_step_ms

with the costs the engine fits from its own steps (load_rates.StepCostFit, fed by the same
`StepRates.record` that measures the rates reported with its load). The answer is never below
`min_chunk_tokens` (prompts keep moving when the decodes alone take the whole target) and never
above `max_num_batched_tokens`, which it is while no costs are fitted yet (the first steps after
warm-up, which itself runs without the target) and when no decode runs (a prefill-only step
delays no output token). Target 0: no budget object, the scheduler works exactly as without
one. Plain Python, no tensors.
"""

from __future__ import annotations

from collections.abc import Callable

from services.engine.config import EngineConfig
from services.engine.load_rates import StepCost

MIN_CHUNK_TOKENS = 64


class StepTimeBudget:
    """The prefill tokens a step may take under a step-time target, from fitted step costs."""

    def __init__(
        self,
        target_step_ms: float,
        max_num_batched_tokens: int,
        step_cost: Callable[[], StepCost | None],
        *,
        min_chunk_tokens: int = MIN_CHUNK_TOKENS,
    ) -> None:
        if not target_step_ms > 0 or max_num_batched_tokens < 1 or min_chunk_tokens < 1:
            raise ValueError("target_step_ms must be > 0, the token counts >= 1")
        self.target_step_ms = float(target_step_ms)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_chunk_tokens = min(min_chunk_tokens, max_num_batched_tokens)
        self._step_cost = step_cost

    def prefill_tokens(self, decode_rows: int) -> int:
        """Most prompt tokens for a step beside `decode_rows` decodes."""
        if decode_rows <= 0:
            return self.max_num_batched_tokens
        cost = self._step_cost()
        if cost is None or cost.per_prefill_token_ms <= 0.0:
            return self.max_num_batched_tokens
        spare_ms = self.target_step_ms - cost.fixed_ms - cost.per_decode_row_ms * decode_rows
        tokens = int(spare_ms / cost.per_prefill_token_ms) if spare_ms > 0 else 0
        return max(self.min_chunk_tokens, min(tokens, self.max_num_batched_tokens))


def build_step_budget(
    config: EngineConfig, step_cost: Callable[[], StepCost | None]
) -> StepTimeBudget | None:
    """The budget of an engine whose step limits are resolved; None when the target is 0."""
    if not config.target_step_ms:
        return None
    return StepTimeBudget(config.target_step_ms, config.max_num_batched_tokens, step_cost)
