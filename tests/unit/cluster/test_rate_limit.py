"""RateLimiter over local buckets (no Redis): limits, refill, retry hints, token charges."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.redis_store import MemoryStore
from services.router.rate_limit import LocalBuckets, RateLimiter, RateLimits
from tests.fake_clock import FakeClock


def _limiter(limits: RateLimits) -> tuple[RateLimiter, FakeClock]:
    clock = FakeClock(1000.0)
    return RateLimiter(MemoryStore(clock), default_limits=limits, clock=clock), clock


def test_requests_per_minute_burst_then_refill() -> None:
    limiter, clock = _limiter(RateLimits(requests_per_minute=6))

    async def scenario() -> None:
        for _ in range(6):
            await limiter.acquire("k")
        with pytest.raises(ResourceExhaustedError) as refused:
            await limiter.acquire("k")
        assert refused.value.retry_after_s == pytest.approx(10.0, abs=0.01)
        await limiter.acquire("other")  # keys are independent
        clock.now += 9.9
        with pytest.raises(ResourceExhaustedError):
            await limiter.acquire("k")
        clock.now += 0.2
        await limiter.acquire("k")

    asyncio.run(scenario())


def test_tokens_per_minute_and_charges() -> None:
    limiter, clock = _limiter(RateLimits(requests_per_minute=0, tokens_per_minute=600))

    async def scenario() -> None:
        await limiter.acquire("k", tokens=500)
        with pytest.raises(ResourceExhaustedError) as refused:
            await limiter.acquire("k", tokens=200)
        assert refused.value.retry_after_s == pytest.approx(10.0, abs=0.01)  # 100 missing
        await limiter.charge_tokens("k", 300)  # more than left: a debt of 200
        clock.now += 20  # +200 tokens: back to 0
        with pytest.raises(ResourceExhaustedError):
            await limiter.acquire("k", tokens=1)
        clock.now += 60
        await limiter.acquire("k", tokens=600)
        with pytest.raises(ResourceExhaustedError, match="more than this key's limit"):
            await limiter.acquire("k", tokens=601)
        with pytest.raises(InvalidArgumentError):
            await limiter.acquire("k", tokens=-1)

    asyncio.run(scenario())


def test_unlimited_and_validation() -> None:
    limiter, _ = _limiter(RateLimits())

    async def scenario() -> None:
        for _ in range(1000):
            await limiter.acquire("k", tokens=10**6)

    asyncio.run(scenario())
    with pytest.raises(InvalidArgumentError):
        RateLimits(requests_per_minute=-1)
    with pytest.raises(InvalidArgumentError):
        RateLimits(tokens_per_minute=1.5)  # type: ignore[arg-type]


def test_idle_local_buckets_are_pruned() -> None:
    clock = FakeClock(1000.0)
    buckets = LocalBuckets(clock)
    buckets.MAX_BUCKETS = 3
    limits = RateLimits(requests_per_minute=1)
    for key in ("a", "b", "c"):
        assert buckets.take(key, limits, 1, 0) == 0.0
    assert buckets.take("a", limits, 1, 0) > 0  # still limited
    clock.now += 121
    assert buckets.take("d", limits, 1, 0) == 0.0
    assert set(buckets._buckets) == {"d"}
