"""IdempotencyCache over the in-memory store: claim kinds, replay, conflicts, lost owners."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import AlreadyExistsError, InvalidArgumentError, UnavailableError
from services.common.redis_store import MemoryStore
from services.router.idempotency import ClaimKind, IdempotencyCache, payload_hash


def test_claim_replay_conflict_and_abandon() -> None:
    async def scenario() -> None:
        cache = IdempotencyCache(MemoryStore(), result_ttl_s=60, lease_s=5)
        digest = payload_hash(b"a")
        assert (await cache.claim("r", digest)).kind is ClaimKind.NEW
        assert (await cache.claim("r", digest)).kind is ClaimKind.IN_FLIGHT
        with pytest.raises(AlreadyExistsError):
            await cache.claim("r", payload_hash(b"b"))
        for index in range(3):
            await cache.append("r", f"m{index}".encode())
        await cache.complete("r")
        assert (await cache.claim("r", digest)).kind is ClaimKind.DONE
        assert [m async for m in cache.replay("r")] == [b"m0", b"m1", b"m2"]
        assert (await cache.claim("s", digest)).kind is ClaimKind.NEW
        await cache.append("s", b"partial")
        await cache.abandon("s")
        claim = await cache.claim("s", digest)
        assert claim.kind is ClaimKind.NEW and claim.recorded
        with pytest.raises(UnavailableError, match="still running"):
            _ = [m async for m in cache.replay("s", timeout_s=0.05)]

    asyncio.run(scenario())


def test_follow_in_flight_and_lost_owner() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        owner = IdempotencyCache(store, lease_s=0.3, poll_interval_s=0.01)
        follower = IdempotencyCache(store, lease_s=0.3, poll_interval_s=0.01)
        digest = payload_hash(b"p")
        await owner.claim("r", digest)
        await owner.append("r", b"0")

        async def follow() -> list[bytes]:
            return [m async for m in follower.replay("r", timeout_s=5)]

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        await owner.append("r", b"1")
        await owner.complete("r")
        assert await task == [b"0", b"1"]
        # An owner that stops appending (crashed): followers get UNAVAILABLE, not a hang.
        await owner.claim("lost", digest)
        await owner.append("lost", b"x")
        with pytest.raises(UnavailableError):
            _ = [m async for m in follower.replay("lost", timeout_s=5)]
        with pytest.raises(InvalidArgumentError):
            await owner.claim("", digest)

    asyncio.run(scenario())
