"""LLMEngine's overlapped greedy steps (services/engine/overlap.py) over a fake runner that
launches without waiting: same tokens, stop reasons and KV bookkeeping as the plain path, with
steps scheduled ahead on pending tokens, stops discarding the step already launched, aborts,
preemption, prefix caching and failures."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.protocol.sampling_params import SamplingParams
from services.engine import overlap
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch
from services.engine.llm_engine import LLMEngine
from services.engine.model_runner import RunnerCapabilities
from services.engine.outputs import FinishReason
from services.engine.sequence import PENDING_TOKEN
from tests.unit.engine.fake_runner import FakeModelRunner, reference_generate

VOCAB = 101
EOS = (3, 7, 11, 13, 17)


class LaunchingFakeRunner(FakeModelRunner):
    """FakeModelRunner plus launch_greedy: a pending token is taken from the ids the previous
    launch sampled for the same sequence, as the CUDA runner does on the device."""

    capabilities = RunnerCapabilities(greedy_ids=True, overlap_max_batch=64)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.previous: dict[int, int] = {}
        self.pending_batches = 0
        self.fail_on_launch: int | None = None
        self.launches = 0

    def execute_greedy(self, batch: ScheduledBatch):
        return self.execute(batch).argmax(dim=-1)

    def launch_greedy(self, batch: ScheduledBatch) -> SimpleNamespace:
        self.launches += 1
        if self.launches == self.fail_on_launch:
            raise RuntimeError("launch boom")
        resolved, pending = [], False
        for seq in batch.sequences:
            tokens = list(seq.token_ids)
            if PENDING_TOKEN in tokens:
                assert tokens == [PENDING_TOKEN], "only a decode token can be pending"
                tokens = [self.previous[seq.seq_id]]
                pending = True
            resolved.append(dataclasses.replace(seq, token_ids=tokens))
        self.pending_batches += pending
        ids = self.execute(ScheduledBatch(resolved)).argmax(dim=-1).tolist()
        rows = [seq.seq_id for seq in batch.sequences if seq.needs_logits]
        self.previous = dict(zip(rows, ids, strict=True))
        return SimpleNamespace(result=lambda: list(ids))


class MixedLaunchingFakeRunner(LaunchingFakeRunner):
    """LaunchingFakeRunner that also takes pending tokens beside prompt rows (overlap_mixed),
    so the engine plans admissions and chunked prefills ahead too; it records the steps that
    did."""

    capabilities = RunnerCapabilities(greedy_ids=True, overlap_max_batch=64, overlap_mixed=True)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mixed_pending_batches = 0

    def launch_greedy(self, batch: ScheduledBatch) -> SimpleNamespace:
        pending = any(seq.token_ids == [PENDING_TOKEN] for seq in batch.sequences)
        prompt_rows = any(len(seq.token_ids) > 1 for seq in batch.sequences)
        self.mixed_pending_batches += pending and prompt_rows
        return super().launch_greedy(batch)


def make_engine(
    launching: bool = True, mixed: bool = False, **overrides
) -> tuple[LLMEngine, FakeModelRunner]:
    runner_args = {
        key: overrides.pop(key)
        for key in ("num_blocks", "block_size", "max_model_len", "eos_token_ids")
        if key in overrides
    }
    runner_class = LaunchingFakeRunner if launching else FakeModelRunner
    if launching and mixed:
        runner_class = MixedLaunchingFakeRunner
    runner = runner_class(vocab_size=VOCAB, **runner_args)
    config = EngineConfig(model="fake", device="cpu", **overrides)
    return LLMEngine(config, model_runner=runner), runner


def drain(engine: LLMEngine, outputs: dict, reasons: dict, counts: dict | None = None) -> None:
    for _ in range(10_000):
        if not engine.has_unfinished():
            return
        step(engine, outputs, reasons, counts)
    raise AssertionError("engine did not finish")


def step(engine: LLMEngine, outputs: dict, reasons: dict, counts: dict | None = None) -> None:
    for delta in engine.step().deltas:
        outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        if counts is not None:
            counts[delta.request_id] = delta.num_output_tokens
        if delta.finished:
            assert delta.request_id not in reasons, "a request finished twice"
            reasons[delta.request_id] = delta.finish_reason


def expected_reason(tokens: list[int], max_tokens: int) -> FinishReason:
    return FinishReason.STOP if tokens and tokens[-1] in EOS else FinishReason.LENGTH


def check_references(
    engine: LLMEngine, prompts: dict, max_tokens: int, outputs: dict, reasons: dict, counts: dict
) -> None:
    """Each request got its reference tokens, counts and stop reason; nothing is left."""
    for rid, prompt in prompts.items():
        expected = reference_generate(prompt, max_tokens, VOCAB, EOS)
        assert outputs[rid] == expected
        assert counts[rid] == len(expected)
        assert reasons[rid] is expected_reason(expected, max_tokens)
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("mixed", [False, True])
def test_steady_decode_overlaps_and_matches_reference(mixed: bool) -> None:
    rng = random.Random(5)
    engine, runner = make_engine(mixed=mixed, num_blocks=200, block_size=4, eos_token_ids=EOS)
    prompts = {f"r{i}": [rng.randrange(20, VOCAB) for _ in range(rng.randrange(1, 12))]
               for i in range(6)}  # fmt: skip
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=25))
    outputs, reasons, counts = {}, {}, {}
    drain(engine, outputs, reasons, counts)
    check_references(engine, prompts, 25, outputs, reasons, counts)
    assert runner.pending_batches > 5 and engine.num_overlapped_steps > 5
    assert engine.block_manager.num_free_blocks == 200


def test_mixed_steps_plan_admissions_ahead_and_match_reference() -> None:
    """Requests arriving while others decode are admitted by a step planned ahead (prompt
    rows beside pending tokens); requests stopping on length are left out of it."""
    rng = random.Random(11)
    engine, runner = make_engine(
        mixed=True, num_blocks=300, block_size=4, eos_token_ids=EOS, max_num_batched_tokens=9
    )
    prompts = {f"r{i}": [rng.randrange(20, VOCAB) for _ in range(rng.randrange(2, 15))]
               for i in range(10)}  # fmt: skip
    outputs, reasons, counts = {}, {}, {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=9))
        for _ in range(2):
            step(engine, outputs, reasons, counts)
    drain(engine, outputs, reasons, counts)
    check_references(engine, prompts, 9, outputs, reasons, counts)
    assert runner.mixed_pending_batches > 3
    assert engine.block_manager.num_free_blocks == 300


def test_a_launched_step_reports_the_device_time_of_its_handle() -> None:
    """Where the runner times its launches on the device, a launched step's time is that,
    not the host time of the call that read it (which also planned and launched the next)."""
    engine, runner = make_engine(mixed=True, num_blocks=100, block_size=4)
    launch = runner.launch_greedy

    def timed_launch(batch: ScheduledBatch) -> SimpleNamespace:
        handle = launch(batch)
        handle.device_time_s = lambda: 0.0125 * len(batch.sequences)
        return handle

    runner.launch_greedy = timed_launch
    engine._launch_greedy = timed_launch
    for index in range(3):
        engine.add_request(f"r{index}", [20 + index, 21, 22], SamplingParams(temperature=0))
    times = []
    while engine.has_unfinished():
        output = engine.step()
        if output.num_batched_tokens:
            times.append(output.step_time_s)
    assert engine.num_overlapped_steps > 3
    sizes = {round(time / 0.0125, 6) for time in times}  # 12.5 ms per sequence of the step
    assert times and sizes <= {1.0, 2.0, 3.0}


def test_a_sampling_request_waiting_stops_planning_ahead() -> None:
    """A waiting request that samples other than argmax is admitted by the plain path: the
    engine does not keep planning greedy steps ahead past it."""
    engine, runner = make_engine(mixed=True, num_blocks=100, block_size=4, max_num_seqs=4)
    engine.add_request("g", [30, 31, 32], SamplingParams(temperature=0, max_tokens=40))
    outputs, reasons = {}, {}
    for _ in range(4):
        step(engine, outputs, reasons)
    engine.add_request("s", [40, 41], SamplingParams(temperature=0.8, max_tokens=3, seed=1))
    for _ in range(4):
        step(engine, outputs, reasons)
    assert len(outputs.get("s", [])) >= 1  # admitted while "g" still decodes
    drain(engine, outputs, reasons)
    assert outputs["g"] == reference_generate([30, 31, 32], 40, VOCAB)
    counted = engine.plain_step_reasons  # why the steps went the plain path, counted
    assert counted[overlap.SAMPLING_QUEUED] == 1  # then "s" runs beside "g" on the plain path
    assert counted[overlap.SAMPLING_RUNNING] >= 1
    assert not engine._maybe_sampling  # "s" ended: the scans are skipped again
    assert len(outputs["s"]) == 3
    assert engine.block_manager.num_free_blocks == 100


def test_sampling_request_takes_the_plain_path_alongside() -> None:
    engine, runner = make_engine(num_blocks=100, block_size=4)
    engine.add_request("g", [30, 31, 32], SamplingParams(temperature=0, max_tokens=12))
    outputs, reasons = {}, {}
    for _ in range(4):
        step(engine, outputs, reasons)
    engine.add_request("s", [40, 41], SamplingParams(temperature=0.8, max_tokens=5, seed=1))
    drain(engine, outputs, reasons)
    assert outputs["g"] == reference_generate([30, 31, 32], 12, VOCAB)
    assert len(outputs["s"]) == 5
    assert runner.pending_batches > 0
    assert engine.block_manager.num_free_blocks == 100


def test_failed_launch_fails_only_those_requests() -> None:
    engine, runner = make_engine(num_blocks=64, block_size=4)
    runner.fail_on_launch = 3  # a step scheduled ahead (pending tokens) fails to launch
    engine.add_request("a", [21, 22, 23], SamplingParams(temperature=0, max_tokens=8))
    outputs, reasons = {}, {}
    drain(engine, outputs, reasons)
    assert reasons["a"] is FinishReason.ERROR
    assert outputs["a"] == reference_generate([21, 22, 23], 8, VOCAB)[: len(outputs["a"])]
    assert engine.block_manager.num_free_blocks == 64
    engine.add_request("b", [21, 22, 23], SamplingParams(temperature=0, max_tokens=8))
    outputs, reasons = {}, {}
    drain(engine, outputs, reasons)
    assert outputs["b"] == reference_generate([21, 22, 23], 8, VOCAB)
    assert engine.block_manager.num_free_blocks == 64


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 12),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    mixed=st.booleans(),
    requests=st.lists(
        st.tuples(
            st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20),
            st.integers(1, 8),  # max_tokens
            st.integers(0, 2),  # priority
            st.integers(0, 3),  # steps before the next arrival
            st.booleans(),  # aborted after those steps
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_overlapped_engine_matches_plain_engine(
    block_size, spare_blocks, budget, max_num_seqs, prefix_caching, mixed, requests
) -> None:
    longest = max(len(prompt) + max_tokens for prompt, max_tokens, *_ in requests)
    num_blocks = -(-longest // block_size) + spare_blocks
    results: list[dict] = []
    for launching in (True, False):
        engine, _ = make_engine(
            launching,
            mixed,
            num_blocks=num_blocks,
            block_size=block_size,
            eos_token_ids=EOS,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=prefix_caching,
        )
        outputs, reasons, counts, aborted = {}, {}, {}, set()
        for index, (prompt, max_tokens, priority, wait, abort) in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            engine.add_request(str(index), prompt, params, priority=priority)
            for _ in range(wait):
                step(engine, outputs, reasons, counts)
            if abort and engine.abort(str(index)):
                aborted.add(str(index))
        drain(engine, outputs, reasons, counts)
        for index, (prompt, max_tokens, *_) in enumerate(requests):
            rid = str(index)
            expected = reference_generate(prompt, max_tokens, VOCAB, EOS)
            got = outputs.get(rid, [])
            if rid in aborted:
                assert got == expected[: len(got)]
                assert reasons[rid] is FinishReason.ABORT
            else:
                assert got == expected
                assert reasons[rid] is expected_reason(expected, max_tokens)
            assert counts.get(rid, 0) == len(got)
        assert engine.block_manager.num_free_blocks == num_blocks
        assert not engine.has_unfinished() and not engine.scheduler.has_unfinished()
        results.append(outputs)
    # Without aborts both paths produce every request's full reference output. (With them, a
    # request added between steps starts one step later on the overlapped path, as that step
    # was launched already, so an abort can cut it at a different token.)
    if not any(abort for *_, abort in requests):
        assert results[0] == results[1]
