"""The engine servicer over the real LLMEngine (dummy:tiny weights) on an in-process gRPC server.

Checks submits and streamed steps, per-request validation errors that leave the session usable,
aborts, a dropped session freeing its blocks, per-session id namespaces, and Info.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.errors import UnavailableError
from services.common.grpc_server import start_server
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.server import SERVICE_NAME, EngineServicer

ENGINE_CONFIG = EngineConfig(model="dummy:tiny", kv_cache_bytes=2 * 1024 * 1024, max_num_seqs=32)
TIMEOUT_S = 60.0


@contextlib.asynccontextmanager
async def engine_server() -> AsyncIterator[tuple[engine_pb2_grpc.EngineStub, EngineServicer]]:
    servicer = EngineServicer(load_report_interval_s=0.2)
    running = await start_server(
        "127.0.0.1:0",
        lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    engine = await asyncio.to_thread(LLMEngine, ENGINE_CONFIG)
    engine_loop = servicer.attach(engine, asyncio.get_running_loop())
    await running.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield engine_pb2_grpc.EngineStub(channel), servicer
    finally:
        await channel.close()
        await running.stop(0)
        await asyncio.to_thread(engine_loop.stop)


def submit(request_id: str, prompt: list[int], **params: object) -> engine_pb2.SubmitRequest:
    return engine_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(**params),
    )


class Session:
    """A client side of EngineSession: send requests, gather updates per request id."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self.outbox: asyncio.Queue[engine_pb2.EngineRequest | None] = asyncio.Queue()
        self.call = stub.EngineSession(self._requests())
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, engine_pb2.SequenceUpdate] = {}
        self.steps: list[engine_pb2.EngineStep] = []

    async def _requests(self) -> AsyncIterator[engine_pb2.EngineRequest]:
        while True:
            request = await self.outbox.get()
            if request is None:
                return
            yield request

    def send(self, **fields: object) -> None:
        self.outbox.put_nowait(engine_pb2.EngineRequest(**fields))

    async def until(self, predicate, timeout_s: float = TIMEOUT_S) -> None:  # noqa: ANN001
        async def pump() -> None:
            while not predicate():
                step = await self.call.read()
                assert step is not grpc.aio.EOF, "session ended early"
                self.steps.append(step)
                for update in step.updates:
                    self.tokens.setdefault(update.request_id, []).extend(update.token_ids)
                    if update.finish_reason:
                        self.finished[update.request_id] = update

        await asyncio.wait_for(pump(), timeout_s)


async def free_blocks(stub: engine_pb2_grpc.EngineStub) -> tuple[int, int]:
    info = await stub.Info(engine_pb2.EngineInfoRequest())
    return info.load.free_blocks, info.num_blocks


async def wait_all_blocks_free(stub: engine_pb2_grpc.EngineStub) -> None:
    for _ in range(200):
        free, total = await free_blocks(stub)
        if free == total:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks not freed: {free} of {total}")


def offline_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(ENGINE_CONFIG)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return [outputs[str(index)] for index in range(len(prompts))]


def test_info_and_greedy_generation_match_the_offline_engine() -> None:
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16, 17]]
    expected = offline_greedy(prompts, max_tokens=6)

    from prometheus_client import REGISTRY

    generated_before = REGISTRY.get_sample_value("sluice_engine_generated_tokens_total") or 0.0

    async def scenario() -> None:
        async with engine_server() as (stub, servicer):
            info = await stub.Info(engine_pb2.EngineInfoRequest())
            assert info.model == "dummy:tiny" and info.vocab_size == 49152
            assert info.load.free_blocks == info.num_blocks > 0
            assert info.engine_id == servicer.engine_id
            session = Session(stub)
            session.send(
                submits=[
                    submit(f"r{i}", p, max_tokens=6, temperature=0.0, ignore_eos=True)
                    for i, p in enumerate(prompts)
                ]
            )
            await session.until(lambda: len(session.finished) == len(prompts))
            for index in range(len(prompts)):
                update = session.finished[f"r{index}"]
                assert update.finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert update.usage.completion_tokens == 6
                assert update.usage.prompt_tokens == len(prompts[index])
                assert session.tokens[f"r{index}"] == expected[index]
            assert all(step.HasField("load") for step in session.steps)
            # the load says when the running sequences reach max_tokens (admission by time)
            profiles = [tuple(step.load.finish_steps) for step in session.steps]
            assert any(
                step.load.finish_steps_of == len(prompts) and max(step.load.finish_steps) <= 5
                for step in session.steps
            ), profiles
            assert session.steps[-1].load.finish_steps_of == 0
            session.send()  # an empty batch is harmless
            session.outbox.put_nowait(None)
            await wait_all_blocks_free(stub)

    asyncio.run(scenario())
    generated = REGISTRY.get_sample_value("sluice_engine_generated_tokens_total")
    assert generated - generated_before == 6 * len(prompts)
    assert REGISTRY.get_sample_value("sluice_engine_kv_blocks_used") == 0


def test_bad_requests_fail_alone_and_the_session_keeps_serving() -> None:
    async def scenario() -> None:
        async with engine_server() as (stub, _):
            session = Session(stub)
            session.send(
                submits=[
                    submit("bad-temperature", [1, 2], temperature=-1.0),
                    submit("bad-token", [1, 10**9], max_tokens=2),
                    submit("empty", [], max_tokens=2),
                    submit("good", [1, 2, 3], max_tokens=3, temperature=0.0, ignore_eos=True),
                ]
            )
            await session.until(lambda: len(session.finished) == 4)
            for request_id in ("bad-temperature", "bad-token", "empty"):
                update = session.finished[request_id]
                assert update.finish_reason == common_pb2.FINISH_REASON_ERROR
                assert update.error.code == "INVALID_ARGUMENT", update.error
                assert update.error.message
            assert "temperature" in session.finished["bad-temperature"].error.message
            assert session.finished["good"].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert len(session.tokens["good"]) == 3
            # Still usable, and a finished id may be reused.
            session.send(submits=[submit("good", [4, 5], max_tokens=2, ignore_eos=True)])
            session.finished.clear()
            await session.until(lambda: "good" in session.finished)
            assert session.finished["good"].finish_reason == common_pb2.FINISH_REASON_LENGTH
            await wait_all_blocks_free(stub)

    asyncio.run(scenario())


def test_each_step_says_how_many_of_the_sessions_submits_its_load_counts() -> None:
    """Refused here, refused by the engine or queued: every submit counts, in sending order,
    once a turn has taken it in; the count never goes back."""

    async def scenario() -> None:
        async with engine_server() as (stub, _):
            session = Session(stub)
            refused_here = submit("bad-top-p", [1], top_p=2.0)
            past_context = submit("past-context", [1] * 100_000, max_tokens=2)
            session.send(submits=[refused_here, past_context, submit("ok", [1, 2, 3])])
            await session.until(lambda: any(s.submits_taken == 3 for s in session.steps))
            session.send(submits=[submit(f"more{i}", [4, 5], max_tokens=2) for i in range(2)])
            await session.until(lambda: any(s.submits_taken == 5 for s in session.steps))
            counts = [step.submits_taken for step in session.steps]
            assert counts == sorted(counts) and counts[-1] == 5
            await session.until(lambda: len(session.finished) == 5)
            await wait_all_blocks_free(stub)

    asyncio.run(scenario())


def test_abort_and_dropped_session_free_blocks() -> None:
    async def scenario() -> None:
        async with engine_server() as (stub, _):
            _, total = await free_blocks(stub)
            session = Session(stub)
            long_prompt = list(range(1, 40))
            session.send(
                submits=[
                    submit(f"a{i}", long_prompt, max_tokens=1000, ignore_eos=True) for i in range(4)
                ]
            )
            await session.until(
                lambda: all(len(session.tokens.get(f"a{i}", [])) >= 2 for i in range(4))
            )
            free, _ = await free_blocks(stub)
            assert free < total
            session.send(aborts=["a0", "a1", "unknown"])
            await session.until(lambda: {"a0", "a1"} <= set(session.finished))
            assert session.finished["a0"].finish_reason == common_pb2.FINISH_REASON_ABORT
            assert "a2" not in session.finished
            session.call.cancel()  # the router goes away with a2, a3 still running
            await wait_all_blocks_free(stub)

    asyncio.run(scenario())


def test_two_sessions_may_use_the_same_request_ids() -> None:
    async def scenario() -> None:
        async with engine_server() as (stub, _):
            first, second = Session(stub), Session(stub)
            first.send(submits=[submit("same", [1, 2, 3], max_tokens=4, ignore_eos=True)])
            second.send(submits=[submit("same", [7, 8], max_tokens=2, ignore_eos=True)])
            await first.until(lambda: "same" in first.finished)
            await second.until(lambda: "same" in second.finished)
            assert len(first.tokens["same"]) == 4
            assert len(second.tokens["same"]) == 2
            assert first.finished["same"].usage.prompt_tokens == 3
            assert second.finished["same"].usage.prompt_tokens == 2
            # A duplicate live id in one session is refused for that request only.
            first.send(
                submits=[
                    submit("dup", [1, 2], max_tokens=50, ignore_eos=True),
                    submit("dup", [1, 2], max_tokens=50, ignore_eos=True),
                ]
            )
            await first.until(lambda: "dup" in first.finished)
            assert first.finished["dup"].error.code == "ALREADY_EXISTS"
            first.send(aborts=["dup"])
            first.finished.clear()
            await first.until(lambda: "dup" in first.finished)
            assert first.finished["dup"].finish_reason == common_pb2.FINISH_REASON_ABORT
            await wait_all_blocks_free(stub)

    asyncio.run(scenario())


def test_idle_engine_sends_load_only_steps() -> None:
    async def scenario() -> None:
        async with engine_server() as (stub, _):
            session = Session(stub)
            await session.until(lambda: len(session.steps) >= 3, timeout_s=10.0)
            assert all(not step.updates for step in session.steps)
            assert all(step.load.total_blocks > 0 for step in session.steps)

    asyncio.run(scenario())


@pytest.mark.parametrize("interval", [0.0, -1.0])
def test_worker_config_rejects_bad_interval(interval: float) -> None:
    from services.common.errors import InvalidArgumentError
    from services.engine.worker_config import WorkerConfig

    with pytest.raises(InvalidArgumentError):
        WorkerConfig.from_argv(["--load-report-interval-s", str(interval)])


def test_a_failing_step_fails_live_requests_and_the_loop_keeps_serving() -> None:
    import queue

    from services.engine.engine_loop import EngineLoop, LoopOutput, Submit

    engine = LLMEngine(ENGINE_CONFIG)
    real_step = engine.step
    failures = {"left": 1}

    def flaky_step():  # noqa: ANN202
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("simulated device error")
        return real_step()

    engine.step = flaky_step  # type: ignore[method-assign]
    outputs: queue.Queue[LoopOutput] = queue.Queue()
    loop = EngineLoop(engine, outputs.put, load_report_interval_s=0.1)
    loop.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        loop.submit([Submit("a", [1, 2, 3], params), Submit("b", [4, 5], params)])
        finished: dict[str, object] = {}
        while len(finished) < 2:
            for delta in outputs.get(timeout=TIMEOUT_S).deltas:
                if delta.finished:
                    finished[delta.request_id] = delta
        assert {d.finish_reason.value for d in finished.values()} == {"error"}
        assert all("simulated device error" in d.error for d in finished.values())
        loop.submit([Submit("c", [1, 2, 3], params)])
        tokens: list[int] = []
        while True:
            output = outputs.get(timeout=TIMEOUT_S)
            assert not any(d.request_id in ("a", "b") for d in output.deltas)
            done = [d for d in output.deltas if d.request_id == "c"]
            for delta in done:
                tokens += delta.new_token_ids
            if any(d.finished for d in done):
                break
        assert len(tokens) == 3
        load = engine.load()
        assert load.free_blocks == load.total_blocks
    finally:
        loop.stop()


def test_idle_loop_sleeps_and_reports_load_at_the_interval() -> None:
    import queue
    import time

    from services.engine.engine_loop import EngineLoop, LoopOutput

    engine = LLMEngine(ENGINE_CONFIG)
    outputs: queue.Queue[LoopOutput] = queue.Queue()
    loop = EngineLoop(engine, outputs.put, load_report_interval_s=0.25)
    cpu_before = time.process_time()
    loop.start()
    try:
        time.sleep(1.2)
    finally:
        loop.stop()
    cpu_used = time.process_time() - cpu_before
    reports = [outputs.get_nowait() for _ in range(outputs.qsize())]
    assert 3 <= len(reports) <= 6
    assert all(report.is_load_only for report in reports)
    assert all(report.load.free_blocks == report.load.total_blocks for report in reports)
    assert cpu_used < 0.3, f"an idle loop must sleep, used {cpu_used:.2f} s of CPU"


def test_standalone_worker_imports_neither_ray_nor_redis() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import services.engine.server, services.engine.llm_engine, services.engine.model_runner\n"
        "print(sorted(m for m in ('ray', 'redis') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_session_whose_stream_cannot_be_read_ends_unavailable_and_frees_its_requests() -> None:
    async def scenario() -> None:
        async with engine_server() as (stub, servicer):
            gate = asyncio.Event()

            async def garbled() -> AsyncIterator[engine_pb2.EngineRequest]:
                yield engine_pb2.EngineRequest(
                    submits=[submit("long", [1, 2, 3], max_tokens=200, ignore_eos=True)]
                )
                await gate.wait()
                raise RuntimeError("a stream the server cannot read")

            steps: list[engine_pb2.EngineStep] = []
            with pytest.raises(UnavailableError):  # the router sees UNAVAILABLE and reconnects
                async for step in servicer.EngineSession(garbled(), None):
                    steps.append(step)
                    if any(u.request_id == "long" and u.token_ids for u in step.updates):
                        gate.set()
            assert gate.is_set()  # it was generating when the stream broke
            await wait_all_blocks_free(stub)  # and was aborted, not left running
            other = Session(stub)  # the engine serves other sessions as before
            other.send(submits=[submit("ok", [1, 2], max_tokens=2, ignore_eos=True)])
            await other.until(lambda: "ok" in other.finished)
            other.outbox.put_nowait(None)

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["normal", "idle"])
def test_forward_thread_runs_under_the_configured_scheduling_policy(policy: str) -> None:
    """`--forward-thread-policy idle` makes the forward thread (only it) SCHED_IDLE."""
    import os
    import queue
    import threading

    from services.engine.engine_loop import EngineLoop, LoopOutput

    engine = LLMEngine(replace(ENGINE_CONFIG, forward_thread_policy=policy))
    seen: queue.Queue[int] = queue.Queue()

    def on_output(output: LoopOutput) -> None:  # runs on the forward thread
        seen.put(os.sched_getscheduler(threading.get_native_id()))

    loop = EngineLoop(
        engine,
        on_output,
        load_report_interval_s=0.05,
        thread_policy=engine.config.forward_thread_policy,
    )
    loop.start()
    try:
        policy_seen = seen.get(timeout=TIMEOUT_S)
    finally:
        loop.stop()
    expected = os.SCHED_IDLE if policy == "idle" else os.SCHED_OTHER
    assert policy_seen == expected
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is untouched


def test_the_servicer_runs_its_forward_thread_under_the_engine_config_policy() -> None:
    async def check() -> None:
        servicer = EngineServicer(load_report_interval_s=0.05)
        engine = LLMEngine(replace(ENGINE_CONFIG, forward_thread_policy="idle"))
        engine_loop = servicer.attach(engine, asyncio.get_running_loop())
        try:
            assert engine_loop._thread_policy == "idle"
        finally:
            await asyncio.to_thread(engine_loop.stop)

    asyncio.run(check())


def test_forward_thread_policy_is_validated_and_a_refused_idle_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os

    from services.common.errors import InvalidArgumentError
    from services.engine import engine_loop

    with pytest.raises(InvalidArgumentError, match="forward_thread_policy"):
        EngineConfig(forward_thread_policy="realtime")

    def refuse(*args: object) -> None:
        raise PermissionError("operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level("WARNING"):
        assert engine_loop.make_current_thread_idle() is False
    assert "SCHED_IDLE failed" in caplog.text


def test_tracing_records_each_submit_the_step_that_takes_it_and_its_message(monkeypatch) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.common import tracing
    from services.common.tracing.runtime import Runtime

    hops = InMemorySpanExporter()
    runtime = Runtime(
        tracing.TracingConfig(trace_dir="unused"), "sluice-engine", hop_exporters=(hops,)
    )
    monkeypatch.setattr(tracing, "_runtime", runtime)  # as configure() leaves it

    async def scenario() -> None:
        async with engine_server() as (stub, _):
            session = Session(stub)
            session.send(submits=[submit("r0", [1, 2, 3], max_tokens=3, ignore_eos=True)])
            await session.until(lambda: "r0" in session.finished)
            session.outbox.put_nowait(None)

    try:
        asyncio.run(scenario())
        runtime.force_flush()
    finally:
        runtime.shutdown()
    spans: dict[str, list] = {}
    for span in hops.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    (received,) = spans["EngineRequest received"]
    assert list(received.attributes["sluice.request_ids"]) == ["r0"]
    # One step span per forward step; the one whose turn took r0 in names it (as s<n>/r0).
    steps = spans["engine step"]
    assert len(steps) >= 3  # a prefill and two decodes at least
    (took,) = [
        s for s in steps if any(i.endswith("/r0") for i in s.attributes["sluice.request_ids"])
    ]
    assert took.attributes["sluice.batched_tokens"] >= 3
    # Only the step message with r0's first update is a hop (the later ones carry no first token).
    (sent,) = spans["EngineStep sent"]
    assert list(sent.attributes["sluice.request_ids"]) == ["r0"]
    assert sent.attributes["sluice.step_index"] == took.attributes["sluice.step_index"]
    assert received.start_time <= took.start_time <= took.end_time <= sent.start_time


def test_held_requests_get_their_tokens_in_updates_of_the_sessions_pacing() -> None:
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    expected = offline_greedy(prompts, max_tokens=13)

    async def scenario() -> None:
        async with engine_server() as (stub, _):
            session = Session(stub)
            held = submit("held", prompts[0], max_tokens=13, temperature=0.0, ignore_eos=True)
            held.hold_tokens = True
            plain = submit("plain", prompts[1], max_tokens=13, temperature=0.0, ignore_eos=True)
            session.send(
                submits=[held, plain],
                pacing=engine_pb2.StreamPacing(tokens_per_update=4, max_hold_ms=60_000),
            )
            await session.until(lambda: len(session.finished) == 2)
            sizes = {"held": [], "plain": []}
            for step in session.steps:
                for update in step.updates:
                    sizes[update.request_id].append(len(update.token_ids))
            assert sizes["held"] == [1, 4, 4, 4]  # the first at once, then by four; the end
            assert sizes["plain"] == [1] * 13  # no hold_tokens: every step
            assert session.tokens["held"] == expected[0]
            assert session.tokens["plain"] == expected[1]
            assert session.finished["held"].usage.completion_tokens == 13
            session.outbox.put_nowait(None)

    asyncio.run(scenario())
