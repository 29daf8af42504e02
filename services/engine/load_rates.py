"""The engine's measured service rates, reported with its load for time-based admission.

A router refuses a request that could not start within its queue-delay bound
(services/router/queue_delay.py); for that it needs how fast this engine actually works through
prompts and finishes requests on this GPU, model and mix, not a count. `StepRates` watches every
step: its wall time, how many prompt tokens it prefilled, how many tokens it generated and how
many requests it finished. It sums them over windows of busy time (`window_s`; idle time between
steps is not counted) and keeps an exponential average of each window's rates:

- prefill tokens/s over the busy time of steps that held prefill work (a mixed step counts whole:
  decodes slow the prefill down, and that is the rate a queued prompt sees);
- decode tokens/s and finished requests/s over all busy time;
- the stop hazard: requests that ended before their token limit (a stop token, an abort) per
  token generated, i.e. the chance a running sequence frees its slot early at each step.

The same steps fit the cost model that a step-time target (`target_step_ms`,
services/engine/step_budget.py) sizes chunked prefill with: the wall time of a step that holds
prefill work is modelled as

    step_ms = fixed_ms + per_decode_row_ms * decode rows + per_prefill_token_ms * prefill tokens

by exponentially weighted least squares (`StepCostFit`: each step counts `decay` times less than
the next, so the fit follows a growing context and the mix; the three sums are kept, a solve
happens only when the model is asked for). Coefficients are kept >= 0 (the best fit over every
subset of the three terms; where steps that all filled the token budget cannot tell the terms
apart, one that charges prefill), a step more than `outlier_factor` times slower than predicted
counts as that bound (a stall, not the GPU's rate), and no model is given before `min_steps`
steps held prefill (the warm-up's steps are forgotten: `reset`). Decode-only steps are left
out: they are never capped, and with CUDA graphs they run at another rate. Attention's growth
with context is not a term of its own; the forgetting follows it.

Plain Python; each `record` is a few additions, and the fit is solved (tens of microseconds)
only when asked for after new steps: once per step that holds prefill with a target, never
without one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Window:
    busy_s: float = 0.0
    prefill_busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0
    stopped_early: int = 0


@dataclass(frozen=True)
class StepCost:
    """The predicted wall time of a step that holds prefill work."""

    fixed_ms: float
    per_decode_row_ms: float
    per_prefill_token_ms: float

    def predict_ms(self, decode_rows: int, prefill_tokens: int) -> float:
        return (
            self.fixed_ms
            + self.per_decode_row_ms * decode_rows
            + self.per_prefill_token_ms * prefill_tokens
        )


class StepCostFit:
    """Exponentially weighted least squares of step time on (1, decode rows, prefill tokens)."""

    def __init__(
        self, *, decay: float = 0.98, min_steps: int = 8, outlier_factor: float = 3.0
    ) -> None:
        if not 0.0 < decay <= 1.0 or min_steps < 1 or outlier_factor <= 1.0:
            raise ValueError("decay must be in (0, 1], min_steps >= 1, outlier_factor > 1")
        self.decay = decay
        self.min_steps = min_steps
        self.outlier_factor = outlier_factor
        self.reset()

    def reset(self) -> None:
        self.num_steps = 0
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x x^T, x = (1, rows, tokens)
        self._xy = [0.0] * 3
        self._yy = 0.0
        self._cost: StepCost | None = None
        self._stale = False

    def record(self, elapsed_ms: float, *, decode_rows: int, prefill_tokens: int) -> None:
        """One step that held `prefill_tokens` (> 0) prompt tokens beside `decode_rows` decodes."""
        if elapsed_ms <= 0.0 or prefill_tokens <= 0:
            return
        cost = self._cost  # the model as last solved (solving is left to whoever asks)
        if cost is not None:
            elapsed_ms = min(
                elapsed_ms, self.outlier_factor * cost.predict_ms(decode_rows, prefill_tokens)
            )
        x = (1.0, float(decode_rows), float(prefill_tokens))
        decay, xx, xy = self.decay, self._xx, self._xy
        for i in range(3):
            row = xx[i]
            for j in range(3):
                row[j] = decay * row[j] + x[i] * x[j]
            xy[i] = decay * xy[i] + x[i] * elapsed_ms
        self._yy = decay * self._yy + elapsed_ms * elapsed_ms
        self.num_steps += 1
        self._stale = True

    def cost(self) -> StepCost | None:
        """The fitted model; None until `min_steps` steps held prefill."""
        if self.num_steps < self.min_steps:
            return None
        if self._stale:
            self._cost = self._solve()
            self._stale = False
        return self._cost

    def _solve(self) -> StepCost | None:
        """Non-negative least squares over three terms: the best fit among the subsets of terms
        whose own least-squares coefficients are all >= 0 (that is the constrained optimum).

        Where the steps cannot tell the terms apart (every step filled the token budget, so
        rows + tokens was constant), fits as good as the best tie; then one with a prefill cost
        is taken: the cap it sets makes the next steps differ, where a zero prefill cost would
        never cap and the steps would stay alike."""
        fits: list[tuple[float, list[float]]] = []
        for subset in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            theta = _solve_normal(self._xx, self._xy, subset)
            if theta is None or min(theta) < 0.0:
                continue
            full = [0.0, 0.0, 0.0]
            for index, value in zip(subset, theta, strict=True):
                full[index] = value
            error = self._yy - 2.0 * sum(full[i] * self._xy[i] for i in range(3))
            error += sum(full[i] * self._xx[i][j] * full[j] for i in range(3) for j in range(3))
            fits.append((error, full))
        if not fits:
            return None
        best_error = min(error for error, _ in fits)
        ties = [fit for fit in fits if fit[0] <= best_error + 1e-7 * self._yy]
        chosen = min(ties, key=lambda fit: (fit[1][2] <= 0.0, fit[0]))[1]
        return StepCost(*chosen)


def _solve_normal(
    xx: list[list[float]], xy: list[float], subset: tuple[int, ...]
) -> list[float] | None:
    """The normal equations restricted to `subset`, by Gaussian elimination with partial
    pivoting; None where they are (nearly) singular."""
    size = len(subset)
    matrix = [[xx[i][j] for j in subset] + [xy[i]] for i in subset]
    scale = max(abs(matrix[k][k]) for k in range(size))
    if scale <= 0.0:
        return None
    for column in range(size):
        pivot = max(range(column, size), key=lambda row: abs(matrix[row][column]))
        if abs(matrix[pivot][column]) <= 1e-9 * scale:
            return None
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        for row in range(column + 1, size):
            factor = matrix[row][column] / matrix[column][column]
            for k in range(column, size + 1):
                matrix[row][k] -= factor * matrix[column][k]
    theta = [0.0] * size
    for row in reversed(range(size)):
        rest = sum(matrix[row][k] * theta[k] for k in range(row + 1, size))
        theta[row] = (matrix[row][size] - rest) / matrix[row][row]
    return theta


class StepRates:
    """Exponentially averaged prefill, decode and finish rates over busy windows, and the
    fitted cost of a step that holds prefill (`step_cost`)."""

    def __init__(self, *, window_s: float = 0.5, weight: float = 0.3) -> None:
        if window_s <= 0 or not 0.0 < weight <= 1.0:
            raise ValueError("window_s must be > 0 and weight in (0, 1]")
        self.window_s = window_s
        self.weight = weight
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        self.finished_per_s = 0.0
        self.stop_hazard = 0.0
        self._window = _Window()
        self.costs = StepCostFit()

    def step_cost(self) -> StepCost | None:
        """The fitted step-time model (None before enough steps held prefill)."""
        return self.costs.cost()

    def record(
        self,
        elapsed_s: float,
        *,
        prefill_tokens: int,
        decode_tokens: int,
        finished: int,
        stopped_early: int = 0,
    ) -> None:
        """One step's wall time and work (`decode_tokens`: tokens sampled, one per row;
        `stopped_early`: of the `finished`, those that ended before their token limit)."""
        if elapsed_s <= 0.0 or (prefill_tokens == 0 and decode_tokens == 0 and finished == 0):
            return
        if prefill_tokens:
            self.costs.record(
                elapsed_s * 1e3, decode_rows=decode_tokens, prefill_tokens=prefill_tokens
            )
        window = self._window
        window.busy_s += elapsed_s
        window.prefill_tokens += prefill_tokens
        if prefill_tokens:
            window.prefill_busy_s += elapsed_s
        window.decode_tokens += decode_tokens
        window.finished += finished
        window.stopped_early += stopped_early
        if window.busy_s >= self.window_s:
            self._fold(window)
            self._window = _Window()

    def _fold(self, window: _Window) -> None:
        def blend(old: float, new: float) -> float:
            return new if old == 0.0 else old + self.weight * (new - old)

        if window.prefill_busy_s > 0.0:
            rate = window.prefill_tokens / window.prefill_busy_s
            self.prefill_tokens_per_s = blend(self.prefill_tokens_per_s, rate)
        self.decode_tokens_per_s = blend(
            self.decode_tokens_per_s, window.decode_tokens / window.busy_s
        )
        if window.finished or self.finished_per_s:
            self.finished_per_s = blend(self.finished_per_s, window.finished / window.busy_s)
        if window.decode_tokens and (window.stopped_early or self.stop_hazard):
            self.stop_hazard = blend(self.stop_hazard, window.stopped_early / window.decode_tokens)

    def reset(self) -> None:
        """Forget everything (after a warm-up, whose steps say nothing about serving)."""
        self.prefill_tokens_per_s = self.decode_tokens_per_s = self.finished_per_s = 0.0
        self.stop_hazard = 0.0
        self._window = _Window()
        self.costs.reset()
