"""Which steps LLMEngine plans ahead (services/engine/overlap.py) and why the others are not:
the reasons it counts, the flag on each step's output, a plan that only resumes paused
sequences planned once more instead of left to the plain path, and the scans of waiting and
paused sequences skipped while every live request samples plain argmax."""

from __future__ import annotations

from services.common.protocol.sampling_params import SamplingParams
from services.engine import overlap
from tests.unit.engine.fake_runner import reference_generate
from tests.unit.engine.test_llm_engine_overlap import VOCAB, drain, make_engine, step
from tests.unit.engine.test_scheduler_pauses import _Slots

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = {"a": [30, 31, 32], "b": [40, 41, 42]}


def _two_adapters(*, launching: bool) -> tuple:
    """An engine whose scheduler hands out two slots (test_scheduler_pauses.py's
    stand-in), with request "a" on adapter "a" and "b" on "b", 20 tokens each."""
    engine, runner = make_engine(launching=launching, mixed=True, num_blocks=100, block_size=4)
    slots = _Slots(free=2)
    engine.scheduler.adapter_slots = slots
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=20))
        engine._requests[rid].adapter = rid
    return engine, runner, slots


def test_every_step_is_planned_ahead_or_counted_with_a_reason() -> None:
    engine, _ = make_engine(mixed=True, num_blocks=100, block_size=4)
    engine.add_request("a", [30, 31, 32], GREEDY)
    ahead = plain = 0
    while engine.has_unfinished():
        output = engine.step()
        if output.num_batched_tokens:
            ahead += output.planned_ahead
            plain += not output.planned_ahead
    # The first step has nothing in flight to plan beside; the last one launched ahead holds
    # only a sequence that stops on length, so nothing is planned beside it either.
    assert engine.plain_step_reasons == {overlap.IDLE: 1}
    assert plain == 1 and ahead == engine.num_overlapped_steps == 11


def test_an_aborted_sampling_request_stops_forcing_the_scans() -> None:
    engine, _ = make_engine(mixed=True, num_blocks=100, block_size=4)
    engine.add_request("s", [40, 41], SamplingParams(temperature=0.8, max_tokens=3, seed=1))
    engine.add_request("m", [40, 41], SamplingParams(temperature=0, max_tokens=3, min_tokens=2))
    engine.add_request("g", [30, 31], GREEDY)
    assert len(engine._maybe_sampling) == 2  # "m" masks EOS before its second token
    engine.abort("s")
    engine.abort("m")
    assert not engine._maybe_sampling


def test_a_plan_ahead_that_only_resumes_is_planned_again_not_left_to_the_plain_path() -> None:
    """The plan that pauses the only running sequence and resumes another would be empty (a
    resumed sequence runs from the next plan on): planned once more, the resumed one runs in
    it, still ahead of the step in flight, and every token is kept."""
    engine, runner, slots = _two_adapters(launching=True)
    outputs, reasons = {}, {}
    for _ in range(3):
        step(engine, outputs, reasons)
    slot_a, slot_b = slots.slot_of["a"], slots.slot_of["b"]
    slots.yielding = [slot_b]  # "b" pauses, "a" goes on
    for _ in range(2):
        step(engine, outputs, reasons)
    assert [seq.request_id for seq in engine.scheduler.paused] == ["b"]
    slots.yielding = [slot_a]  # "a" pauses and "b" resumes in one plan
    launches = runner.launches
    for _ in range(2):
        step(engine, outputs, reasons)
    assert [seq.request_id for seq in engine.scheduler.paused] == ["a"]
    assert runner.launches == launches + 2  # no step without a launch
    slots.yielding = []
    drain(engine, outputs, reasons)
    assert overlap.EMPTY_PLAN not in engine.plain_step_reasons
    assert set(engine.plain_step_reasons) == {overlap.IDLE}
    for rid, prompt in PROMPTS.items():
        assert outputs[rid] == reference_generate(prompt, 20, VOCAB)
    assert engine.scheduler.num_pauses == 2 and engine.scheduler.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == 100


def test_queued_greedy_skips_the_scan_of_waiting_and_paused_sequences() -> None:
    engine, _ = make_engine(mixed=True, num_blocks=100, block_size=4, max_num_seqs=1)
    engine.add_request("a", [30, 31, 32], GREEDY)
    engine.add_request("b", [40, 41, 42], GREEDY)  # waits: one sequence at a time
    engine.step()
    launched = engine._launched
    asked: list[str] = []

    def plain_greedy(seq) -> bool:
        asked.append(seq.request_id)
        return True

    for queued_greedy, expected in ((False, ["a", "b"]), (True, ["a"])):
        asked.clear()
        hold = overlap.hold_back_ahead(
            launched,
            engine.scheduler,
            engine.block_manager,
            max_model_len=engine.info.max_model_len,
            plain_greedy=plain_greedy,
            queued_greedy=queued_greedy,
        )
        assert hold == set() and asked == expected


def test_a_plain_plan_that_only_resumes_is_planned_again_not_an_empty_step() -> None:
    engine, _, slots = _two_adapters(launching=False)
    for _ in range(3):
        engine.step()
    slots.yielding = [slots.slot_of["b"]]
    engine.step()
    slots.yielding = [slots.slot_of["a"]]  # "a" pauses and "b" resumes in one plan
    output = engine.step()
    assert [seq.request_id for seq in engine.scheduler.paused] == ["a"]
    assert output.num_batched_tokens == 1  # "b" ran in it
    assert [delta.request_id for delta in output.deltas] == ["b"]


def test_first_tokens_are_read_before_a_step_with_prompt_rows_is_planned() -> None:
    """A request arriving while another decodes has its prefill planned beside the decode in
    flight; a step that ends a prompt is read before a plan that would launch another prompt's
    rows (on a GPU that launch would hold the first token back for its whole length)."""
    engine, _ = make_engine(mixed=True, num_blocks=100, block_size=4, max_num_seqs=4)
    outputs: dict = {}
    reasons: dict = {}
    prompts = {**PROMPTS, "c": [50, 51, 52]}
    engine.add_request("a", prompts["a"], GREEDY)
    for _ in range(3):
        step(engine, outputs, reasons)
    engine.add_request("b", prompts["b"], GREEDY)
    ahead = engine.num_overlapped_steps
    step(engine, outputs, reasons)  # b's prefill planned ahead beside a's decode in flight
    assert engine.num_overlapped_steps == ahead + 1 and "b" not in outputs
    engine.add_request("c", prompts["c"], GREEDY)
    step(engine, outputs, reasons)
    assert len(outputs["b"]) == 1  # b's first token, read before c's prefill was planned
    assert engine._launched is None and engine._not_ahead == overlap.FIRST_TOKENS
    step(engine, outputs, reasons)  # c's prefill with a's and b's decodes, the plain way
    assert engine.plain_step_reasons[overlap.FIRST_TOKENS] == 1
    drain(engine, outputs, reasons)
    for rid, prompt in prompts.items():
        assert outputs[rid] == reference_generate(prompt, 12, VOCAB)
    assert engine.block_manager.num_free_blocks == 100


def test_under_load_a_prefill_is_planned_ahead_even_while_first_tokens_are_due(
    monkeypatch,
) -> None:
    """Above FIRST_TOKENS_MAX_SEQUENCES sequences the next step is planned ahead anyway: its
    plan costs the host more than a first token gains by waiting for it."""
    monkeypatch.setattr(overlap, "FIRST_TOKENS_MAX_SEQUENCES", 1)
    engine, _ = make_engine(mixed=True, num_blocks=100, block_size=4, max_num_seqs=4)
    outputs: dict = {}
    reasons: dict = {}
    engine.add_request("a", PROMPTS["a"], GREEDY)
    for _ in range(3):
        step(engine, outputs, reasons)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    step(engine, outputs, reasons)  # b's prefill beside a's decode, ahead
    engine.add_request("c", [50, 51, 52], GREEDY)
    ahead = engine.num_overlapped_steps
    step(engine, outputs, reasons)  # b's first token due, c waiting: two running, over the cap
    assert engine.num_overlapped_steps == ahead + 1 and engine._launched is not None
    drain(engine, outputs, reasons)
    assert overlap.FIRST_TOKENS not in engine.plain_step_reasons
    for rid, prompt in {**PROMPTS, "c": [50, 51, 52]}.items():
        assert outputs[rid] == reference_generate(prompt, 12, VOCAB)
