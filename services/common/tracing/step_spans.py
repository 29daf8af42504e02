"""The engine loop's step hook when tracing is on: one span per forward step.

The engine loop (services/engine/engine_loop.py) calls its `step_hook`, if it has one, after
each turn that ran a forward step, with the turn's start (before it applied the submits that
arrived since the last step) and end, the step's index, the requests it took in and the tokens
it computed. The span `engine step` covers that interval, so it shows both how long a submit
waited on the engine thread (the step in flight when it arrived) and the step that prefilled
it. Request ids are the engine's own (`<session>/<router's id>`).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.tracing.runtime import Runtime

STEP_SPAN = "engine step"


class StepSpans:
    """Records each step the engine loop reports as a span of the hop tracer."""

    def __init__(self, runtime: Runtime) -> None:
        if runtime.hops is None:
            raise ValueError("step spans need the hop tracer (a trace directory)")
        self._tracer = runtime.hops

    def __call__(
        self,
        started_ns: int,
        ended_ns: int,
        step_index: int,
        request_ids: Sequence[str],
        num_batched_tokens: int,
    ) -> None:
        span = self._tracer.start_span(
            STEP_SPAN,
            start_time=started_ns,
            attributes={
                "sluice.step_index": step_index,
                "sluice.request_ids": list(request_ids),
                "sluice.batched_tokens": num_batched_tokens,
            },
        )
        span.end(end_time=ended_ns)
