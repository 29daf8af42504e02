"""Metric arithmetic on synthetic timelines with known TTFT, TPOT, ITL and E2E."""

from __future__ import annotations

import pytest

from loadtest.metrics import SUMMARY_KEYS, details, meets_slo, parse_slo, summarize
from loadtest.records import RequestRecord
from services.common.errors import InvalidArgumentError


def timeline(
    index: int,
    *,
    scheduled: float,
    sent: float,
    ttft: float,
    gaps: list[float],
    tokens: list[int] | None = None,
    status: str = "OK",
) -> RequestRecord:
    """A record whose first chunk arrives `ttft` after sending and the others `gaps` apart."""
    record = RequestRecord(index=index, scheduled_s=scheduled)
    record.dispatched_s = sent
    record.sent_s = sent
    tokens = tokens or [1] * (len(gaps) + 1)
    at = sent + ttft
    record.add_chunk(at, tokens[0])
    for gap, count in zip(gaps, tokens[1:], strict=True):
        at += gap
        record.add_chunk(at, count)
    record.finished_s = at
    record.status = status
    return record


def test_single_request_known_values() -> None:
    record = timeline(0, scheduled=1.0, sent=1.002, ttft=0.1, gaps=[0.02, 0.04, 0.03])
    assert record.ttft_s == pytest.approx(0.1)
    assert record.e2e_s == pytest.approx(0.19)
    assert record.output_tokens == 4
    assert record.tpot_s == pytest.approx(0.09 / 3)
    assert record.inter_token_latencies_s() == pytest.approx([0.02, 0.04, 0.03])
    assert record.send_lag_s == pytest.approx(0.002)


def test_multi_token_chunks_split_their_interval_evenly() -> None:
    # First chunk 2 tokens, then 3 tokens after 0.06 s, then 1 token after 0.01 s.
    record = timeline(0, scheduled=0, sent=0, ttft=0.5, gaps=[0.06, 0.01], tokens=[2, 3, 1])
    assert record.output_tokens == 6
    gaps = record.inter_token_latencies_s()
    assert sorted(gaps) == pytest.approx(sorted([0.0, 0.02, 0.02, 0.02, 0.01]))
    # One ITL sample per token after the first, and their mean equals TPOT.
    assert len(gaps) == record.output_tokens - 1
    assert sum(gaps) / len(gaps) == pytest.approx(record.tpot_s)


def test_single_token_request_has_no_tpot() -> None:
    record = timeline(0, scheduled=0, sent=0, ttft=0.2, gaps=[])
    assert record.tpot_s is None
    assert record.inter_token_latencies_s() == []


def test_summary_over_known_timelines() -> None:
    records = [
        timeline(0, scheduled=0.0, sent=0.001, ttft=0.1, gaps=[0.01] * 9),  # ends 0.191
        timeline(1, scheduled=0.5, sent=0.503, ttft=0.3, gaps=[0.03] * 4),  # ends 0.923
        timeline(2, scheduled=1.0, sent=1.0, ttft=0.2, gaps=[0.05] * 19),  # ends 2.15
        timeline(3, scheduled=1.5, sent=1.5, ttft=0.05, gaps=[], status="RESOURCE_EXHAUSTED"),
    ]
    records[3].chunk_times_s.clear()
    records[3].chunk_tokens.clear()
    records[3].output_tokens = 0
    records[3].finished_s = 1.51
    summary = summarize(records, parse_slo("ttft=250,tpot=40"))
    assert set(summary) == set(SUMMARY_KEYS)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx((10 + 30 + 50) / 3)
    itl = [10.0] * 9 + [30.0] * 4 + [50.0] * 19
    assert summary["itl_ms"]["mean"] == pytest.approx(sum(itl) / len(itl))
    assert summary["e2e_ms"]["p50"] == pytest.approx(420.0)
    duration = 2.15
    assert summary["request_throughput"] == pytest.approx(3 / duration)
    assert summary["output_token_throughput"] == pytest.approx((10 + 5 + 20) / duration)
    # Only request 0 meets ttft <= 250 and tpot <= 40 (1 has ttft 300, 2 has tpot 50).
    assert summary["goodput"] == pytest.approx(1 / duration)
    assert summary["max_send_lag_ms"] == pytest.approx(3.0)
    records[1].expected_output_tokens = 8  # it streamed only 5
    info = details(records)
    assert info["ok_short_of_output_length"] == 1
    assert info["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert info["completed"] == 3


def test_goodput_without_slo_is_request_throughput() -> None:
    records = [timeline(i, scheduled=i, sent=i, ttft=0.1, gaps=[0.1]) for i in range(3)]
    summary = summarize(records)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])


def test_failed_request_never_meets_slo() -> None:
    record = timeline(0, scheduled=0, sent=0, ttft=0.01, gaps=[0.01], status="CANCELLED")
    assert not meets_slo(record, {})


def test_empty_run_has_null_latencies() -> None:
    summary = summarize([])
    assert summary["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summary["request_throughput"] == 0.0


@pytest.mark.parametrize("text", ["ttft", "ttft=abc", "foo=3", "tpot=-1"])
def test_bad_slo_is_invalid(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_slo(text)


def test_slo_parsing() -> None:
    assert parse_slo("ttft=200, tpot_ms=50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo(None) == {}
