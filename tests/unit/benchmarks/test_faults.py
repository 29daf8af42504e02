"""The fault benchmark's measures of one phase, from request records."""

from __future__ import annotations

from benchmarks.faults import recovered_after_s, served_again_after_s
from loadtest.records import RequestRecord


def record(
    index: int, sent_s: float, status: str, first_token_s: float | None = None
) -> RequestRecord:
    made = RequestRecord(index=index, scheduled_s=sent_s, sent_s=sent_s, status=status)
    if first_token_s is not None:
        made.add_chunk(first_token_s, 1)
    return made


def test_recovery_is_the_send_time_after_the_last_failure() -> None:
    records = [
        record(0, 1.0, "OK", 1.1),  # before the fault at 2.0
        record(1, 2.1, "UNAVAILABLE"),
        record(2, 2.5, "UNAVAILABLE"),
        record(3, 3.0, "OK", 6.0),  # held until the peer was back
        record(4, 3.5, "OK", 6.1),
    ]
    assert recovered_after_s(records, 2.0) == 1.0
    assert served_again_after_s(records, 2.0) == 4.0


def test_no_failure_after_the_fault_is_zero_and_endless_failure_is_none() -> None:
    assert recovered_after_s([record(0, 3.0, "OK", 3.1)], 2.0) == 0.0
    assert (
        recovered_after_s([record(0, 3.0, "OK", 3.1), record(1, 4.0, "UNAVAILABLE")], 2.0) is None
    )
    assert served_again_after_s([record(0, 3.0, "UNAVAILABLE")], 2.0) is None
