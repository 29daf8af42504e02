"""Admission queue: bounds by count and tokens, retry-after, priority order, deadline expiry."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.errors import ResourceExhaustedError
from services.router.admission import AdmissionQueue


@dataclass(eq=False)
class Item:
    num_prompt_tokens: int
    priority: int = 0
    deadline: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and now is not None and now >= self.deadline


def test_rejects_past_request_bound_and_keeps_queue_unchanged() -> None:
    queue = AdmissionQueue(max_requests=2, max_tokens=1000, min_retry_after_s=0.5)
    queue.admit(Item(10))
    queue.admit(Item(20))
    with pytest.raises(ResourceExhaustedError) as info:
        queue.admit(Item(5))
    assert info.value.retry_after_s is not None and info.value.retry_after_s >= 0.5
    assert len(queue) == 2
    assert queue.queued_tokens == 30


def test_rejects_past_token_bound() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=100)
    queue.admit(Item(60))
    with pytest.raises(ResourceExhaustedError, match="prompt tokens"):
        queue.admit(Item(41))
    queue.admit(Item(40))
    assert queue.queued_tokens == 100
    with pytest.raises(ResourceExhaustedError, match="at most 100"):
        AdmissionQueue(max_requests=10, max_tokens=100).admit(Item(101))


def test_pop_order_is_priority_then_arrival() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    a, b, c, d = Item(1, priority=1), Item(1, priority=0), Item(1, priority=1), Item(1, priority=0)
    for item in (a, b, c, d):
        queue.admit(item)
    assert list(queue.ordered()) == [b, d, a, c]
    assert [queue.pop() for _ in range(4)] == [b, d, a, c]
    assert queue.peek() is None and queue.queued_tokens == 0


def test_remove_frees_room_and_skips_in_order() -> None:
    queue = AdmissionQueue(max_requests=2, max_tokens=1000)
    first, second = Item(5), Item(7)
    queue.admit(first)
    queue.admit(second)
    assert queue.remove(first) is True
    assert queue.remove(first) is False
    assert first not in queue and second in queue
    queue.admit(Item(3))
    assert queue.pop() is second
    assert queue.queued_tokens == 3


def test_drop_expired_removes_only_expired() -> None:
    queue = AdmissionQueue(max_requests=10, max_tokens=1000)
    old, fresh, forever = Item(1, deadline=10.0), Item(2, deadline=30.0), Item(3)
    for item in (old, fresh, forever):
        queue.admit(item)
    assert queue.drop_expired(now=20.0) == [old]
    assert len(queue) == 2 and queue.queued_tokens == 5
    assert queue.drop_expired(now=40.0) == [fresh]
    assert queue.pop() is forever


def test_retry_after_grows_with_backlog_at_slow_dispatch() -> None:
    queue = AdmissionQueue(max_requests=1000, max_tokens=10**6, min_retry_after_s=0.1)
    assert queue.retry_after_s() == pytest.approx(0.1)
    queue._dispatch_rate = 10.0  # 10 requests/s drained
    for _ in range(50):
        queue.admit(Item(1))
    assert queue.retry_after_s() == pytest.approx(5.0)
