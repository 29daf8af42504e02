"""Tokens of several steps gathered into one update, as the router's pacing asks."""

from __future__ import annotations

from services.engine.coalesce import TokenCoalescer
from services.engine.outputs import FinishReason, SequenceDelta, TokenLogprob


def step(token: int, count: int, **extra) -> SequenceDelta:
    """Request r's delta of one step: its `count`-th output token."""
    return SequenceDelta("r", [token], num_prompt_tokens=5, num_output_tokens=count, **extra)


def run(coalescer: TokenCoalescer, deltas: list[SequenceDelta], start: float = 0.0) -> list:
    """The updates sent, one step every 10 ms: (step index, delta)."""
    sent = []
    for index, delta in enumerate(deltas):
        out = coalescer.take("r", delta, start + index * 0.01)
        if out is not None:
            sent.append((index, out))
    return sent


def test_tokens_gather_by_the_interval_first_tokens_and_the_end_at_once() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(4, 1000)
    coalescer.allow("r")
    deltas = [step(100 + i, i + 1) for i in range(9)]
    deltas.append(step(109, 10, finished=True, finish_reason=FinishReason.LENGTH))
    sent = run(coalescer, deltas)
    assert [index for index, _ in sent] == [0, 4, 8, 9]
    assert [d.new_token_ids for _, d in sent] == [
        [100],
        [101, 102, 103, 104],
        [105, 106, 107, 108],
        [109],
    ]
    last = sent[-1][1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH
    assert last.num_output_tokens == 10 and last.num_prompt_tokens == 5
    assert coalescer.holding == 0


def test_the_end_takes_the_held_tokens_with_it() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(8, 1000)
    coalescer.allow("r")
    sent = run(coalescer, [step(1, 1), step(2, 2), step(3, 3, finished=True)])
    assert [d.new_token_ids for _, d in sent] == [[1], [2, 3]]
    assert sent[-1][1].finished


def test_an_error_goes_at_once_with_what_was_held() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(8, 1000)
    coalescer.allow("r")
    sent = run(coalescer, [step(1, 1), step(2, 2), SequenceDelta("r", [], error="lost")])
    assert [d.new_token_ids for _, d in sent] == [[1], [2]]
    assert sent[-1][1].error == "lost" and coalescer.holding == 0


def test_requests_not_allowed_and_interval_one_go_every_step() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(4, 1000)
    assert len(run(coalescer, [step(i, i + 1) for i in range(5)])) == 5  # never allowed
    coalescer.allow("r")
    coalescer.set_pacing(0, 0)  # 0 counts as 1; a 0 hold keeps the previous limit
    assert coalescer.interval == 1 and coalescer.max_hold_s == 1.0
    assert len(run(coalescer, [step(i, i + 6) for i in range(3)])) == 3


def test_tokens_held_past_the_limit_are_overdue() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(8, 50)
    coalescer.allow("r")
    run(coalescer, [step(1, 1), step(2, 2), step(3, 3)])  # the 2nd comes at 10 ms
    assert coalescer.overdue(0.05) == []
    late = coalescer.overdue(0.061)
    assert [(rid, d.new_token_ids) for rid, d in late] == [("r", [2, 3])]
    assert coalescer.holding == 0


def test_logprobs_are_merged_in_order_and_abort_forgets() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(3, 1000)
    coalescer.allow("r")
    deltas = [
        step(i, i + 1, logprobs=[TokenLogprob(token_id=i, logprob=-float(i), top=[])])
        for i in range(4)
    ]
    sent = run(coalescer, deltas)
    assert [[lp.token_id for lp in d.logprobs] for _, d in sent] == [[0], [1, 2, 3]]
    run(coalescer, [step(9, 5)])
    assert coalescer.holding == 1
    coalescer.forget("r")
    assert coalescer.holding == 0 and coalescer.overdue(100.0) == []


def test_the_engines_deltas_are_never_changed_by_holding_and_merging() -> None:
    coalescer = TokenCoalescer()
    coalescer.set_pacing(3, 1000)
    coalescer.allow("r")
    deltas = [step(1, 1), step(2, 2), step(3, 3), step(4, 4, finished=True)]
    sent = run(coalescer, deltas)
    assert [d.new_token_ids for _, d in sent] == [[1], [2, 3, 4]]
    assert [d.new_token_ids for d in deltas] == [[1], [2], [3], [4]]
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3, 4] and not deltas[2].finished
    merged = sent[-1][1]
    assert merged is not deltas[1] and merged.finished and merged.num_output_tokens == 4
