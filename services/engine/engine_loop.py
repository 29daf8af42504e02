"""The engine worker's forward loop: one thread owns the LLMEngine and steps it.

LLMEngine is not thread-safe, so only this thread touches it. The gRPC side (an asyncio loop)
never waits on a step: it hands submits and aborts to `EngineLoop.submit` / `abort` (a lock-
protected list plus a condition), and gets every step's results through the `on_output`
callback, called on this thread (the server forwards it with `loop.call_soon_threadsafe`).

- When there is nothing to do, the thread sleeps on the condition (no busy polling) and wakes
  every `load_report_interval_s` to emit a load-only output, so routers keep seeing capacity.
- A refused submit (bad parameters, unknown adapter, can never fit) becomes a `Rejection` for
  that request only. A submit may carry its adapter's registration (`adapter_spec`).
- Requests that wait only for LoRA adapter loads do not keep the thread stepping: the engine says
  so (`waiting_for_adapters`) and wakes the loop through `on_adapter_load_done`.
- `thread_policy="idle"` makes the thread SCHED_IDLE (Linux) before its first step. On CPU the
  step is CPU work that shares the cores with every gRPC thread on the machine (this engine's
  stream, the router, the tokenizer); as an idle thread it takes only what they leave, and a
  thread that wakes for a message preempts it at once instead of waiting out its time slice.
- `step_hook`, when given (tracing, services/common/tracing/step_spans.py), is called after each
  turn that ran a step, with the turn's start and end (`time.time_ns()`), the step's index, the
  requests the turn took in and the tokens computed; without one a turn pays nothing for it.
- An exception inside `step()` fails the requests that were live (ERROR with the message), aborts
  them in the engine so their blocks are freed, and the loop keeps serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import SluiceError
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import FORWARD_THREAD_POLICIES
from services.engine.outputs import EngineLoad, FinishReason, SequenceDelta, StepOutput

log = logging.getLogger(__name__)


class StepHook(Protocol):
    """Told about each forward step (see the module docstring)."""

    def __call__(
        self,
        started_ns: int,
        ended_ns: int,
        step_index: int,
        request_ids: Sequence[str],
        num_batched_tokens: int,
    ) -> None: ...


class SteppableEngine(Protocol):
    """The part of LLMEngine the loop uses (a fake in tests, the real engine in the worker)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        adapter: str | None = None,
        priority: int = 0,
    ) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> StepOutput: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> EngineLoad: ...


@dataclass(frozen=True)
class Submit:
    """A request to add, already converted from protobuf."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    priority: int = 0
    adapter_spec: AdapterRecord | None = None  # registers `adapter` first when set


@dataclass(frozen=True)
class Rejection:
    """A submit the engine refused; `code` is a gRPC status name."""

    request_id: str
    code: str
    message: str


@dataclass
class LoopOutput:
    """What one turn of the loop produced: a step's deltas (maybe none) and the load after it."""

    deltas: list[SequenceDelta]
    rejections: list[Rejection]
    load: EngineLoad
    step_index: int
    step_time_s: float = 0.0
    num_batched_tokens: int = 0
    # The request ids of the submits this turn took in (queued or refused) before its load.
    taken: tuple[str, ...] = ()

    @property
    def is_load_only(self) -> bool:
        return not self.deltas and not self.rejections


@dataclass(frozen=True)
class Abort:
    """A request to abort (a no-op when it already finished)."""

    request_id: str


@dataclass
class _Inbox:
    """Submits and aborts in arrival order (an abort right after its submit must win)."""

    commands: list[Submit | Abort] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.commands)


def make_current_thread_idle() -> bool:
    """Give the calling thread Linux's SCHED_IDLE policy; False (logged) where that fails.

    Threads it creates afterwards (e.g. the OpenMP team of its parallel regions) inherit it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError) as exc:  # not Linux, or forbidden (seccomp)
        log.warning("forward thread stays a normal thread: SCHED_IDLE failed (%s)", exc)
        return False
    log.info("forward thread runs as SCHED_IDLE (it yields the CPU to the gRPC threads)")
    return True


class EngineLoop:
    """Drives an engine on a dedicated thread; thread-safe `submit`/`abort`/`stop`."""

    def __init__(
        self,
        engine: SteppableEngine,
        on_output: Callable[[LoopOutput], None],
        *,
        load_report_interval_s: float = 1.0,
        name: str = "engine-loop",
        thread_policy: str = "normal",
        step_hook: StepHook | None = None,
    ) -> None:
        if thread_policy not in FORWARD_THREAD_POLICIES:
            raise ValueError(
                f"thread_policy must be one of {FORWARD_THREAD_POLICIES}, got {thread_policy!r}"
            )
        self._engine = engine
        self._thread_policy = thread_policy
        self._on_output = on_output
        self._step_hook = step_hook
        self._load_report_interval_s = load_report_interval_s
        self._condition = threading.Condition()
        self._inbox = _Inbox()
        self._woken = False  # an adapter load ended: step even if the engine looks idle
        self._running = False
        self._live: set[str] = set()  # touched only by the loop thread
        self._step_index = 0
        self.accepted_requests = 0  # requests the engine took (a generation each); for tests/ops
        self._failed_steps = 0  # consecutive; backs off a broken engine instead of spinning
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.initial_load = engine.load()
        if hasattr(engine, "on_adapter_load_done"):
            engine.on_adapter_load_done = self.wake

    # ---- called from any thread -----------------------------------------------------------
    def start(self) -> None:
        with self._condition:
            self._running = True
        self._thread.start()

    def submit(self, submits: Iterable[Submit]) -> None:
        with self._condition:
            self._inbox.commands.extend(submits)
            self._condition.notify()

    def abort(self, request_ids: Iterable[str]) -> None:
        with self._condition:
            self._inbox.commands.extend(Abort(request_id) for request_id in request_ids)
            self._condition.notify()

    def wake(self) -> None:
        """Run a turn now (an adapter load ended; called from a loader thread)."""
        with self._condition:
            self._woken = True
            self._condition.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._condition:
            self._running = False
            self._condition.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        if self._thread_policy == "idle":
            make_current_thread_idle()
        last_output = time.monotonic()
        while True:
            with self._condition:
                while (
                    self._running
                    and not self._inbox
                    and not self._woken
                    and not self._engine_busy(stepping=True)
                ):
                    remaining = self._load_report_interval_s - (time.monotonic() - last_output)
                    if remaining <= 0:
                        break
                    self._condition.wait(remaining)
                if not self._running:
                    return
                self._woken = False
                inbox, self._inbox = self._inbox, _Inbox()
            output = self._turn(inbox)
            if output is None:
                continue
            last_output = time.monotonic()
            try:
                self._on_output(output)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                log.exception("engine loop output callback failed")

    def _engine_busy(self, stepping: bool = False) -> bool:
        """Whether the engine has work; `stepping`: work a step can advance now (not only
        requests waiting for adapter loads, which wake the loop when they end)."""
        try:
            if not self._engine.has_unfinished():
                return False
            waiting = getattr(self._engine, "waiting_for_adapters", None)
            return not (stepping and waiting is not None and waiting())
        except Exception:  # noqa: BLE001
            log.exception("engine.has_unfinished failed")
            return False

    def _turn(self, inbox: _Inbox) -> LoopOutput | None:
        turn_started_ns = time.time_ns() if self._step_hook is not None else 0
        rejections = self._apply(inbox)
        deltas: list[SequenceDelta] = []
        step_time_s = 0.0
        num_batched_tokens = 0
        load: EngineLoad | None = None
        if self._engine_busy():
            started = time.perf_counter()
            try:
                step = self._engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the live requests, keep serving
                log.exception("engine step failed")
                deltas = self._fail_live(f"engine step failed: {exc}")
                self._failed_steps += 1
                time.sleep(min(0.001 * 2**self._failed_steps, 1.0))
            else:
                step_time_s = step.step_time_s or (time.perf_counter() - started)
                num_batched_tokens = step.num_batched_tokens
                self._failed_steps = 0
                load = step.load
                deltas = self._track(step.deltas)
            self._step_index += 1
            if self._step_hook is not None:
                self._report_step(inbox, turn_started_ns, num_batched_tokens)
        if load is None:
            load = self._safe_load()
        taken = tuple(c.request_id for c in inbox.commands if isinstance(c, Submit))
        return LoopOutput(
            deltas, rejections, load, self._step_index, step_time_s, num_batched_tokens, taken
        )

    def _report_step(self, inbox: _Inbox, started_ns: int, num_batched_tokens: int) -> None:
        submitted = [c.request_id for c in inbox.commands if isinstance(c, Submit)]
        try:
            self._step_hook(
                started_ns, time.time_ns(), self._step_index, submitted, num_batched_tokens
            )
        except Exception:  # noqa: BLE001 - diagnostics must never stop the engine
            log.exception("engine step hook failed")

    def _apply(self, inbox: _Inbox) -> list[Rejection]:
        rejections: list[Rejection] = []
        for submit in inbox.commands:
            if isinstance(submit, Abort):
                try:
                    self._engine.abort(submit.request_id)
                except Exception:  # noqa: BLE001
                    log.exception("abort of %s failed", submit.request_id)
                continue
            extra = {"adapter_spec": submit.adapter_spec} if submit.adapter_spec else {}
            try:
                self._engine.add_request(
                    submit.request_id,
                    submit.prompt_token_ids,
                    submit.params,
                    adapter=submit.adapter,
                    priority=submit.priority,
                    **extra,
                )
            except SluiceError as exc:
                rejections.append(Rejection(submit.request_id, exc.code, exc.message))
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                log.exception("add_request %s failed", submit.request_id)
                rejections.append(Rejection(submit.request_id, "INTERNAL", str(exc)))
            else:
                self._live.add(submit.request_id)
                self.accepted_requests += 1
        return rejections

    def _track(self, deltas: list[SequenceDelta]) -> list[SequenceDelta]:
        """Keep deltas of live requests; forget finished ones."""
        kept = []
        for delta in deltas:
            if delta.request_id not in self._live:
                continue  # e.g. the ABORT echo of a request already failed
            kept.append(delta)
            if delta.finished:
                self._live.discard(delta.request_id)
        return kept

    def _fail_live(self, message: str) -> list[SequenceDelta]:
        failed = [
            SequenceDelta(
                request_id,
                [],
                finished=True,
                finish_reason=FinishReason.ERROR,
                error=message,
            )
            for request_id in sorted(self._live)
        ]
        for delta in failed:
            try:
                self._engine.abort(delta.request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of failed request %s failed", delta.request_id)
        self._live.clear()
        return failed

    def _safe_load(self) -> EngineLoad:
        try:
            return self._engine.load()
        except Exception:  # noqa: BLE001
            log.exception("engine.load failed")
            return self.initial_load
