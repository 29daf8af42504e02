"""ApiKeyStore over the in-memory store: hashing, pepper, cache and revocation delay, metadata."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from services.common.redis_store import MemoryStore
from services.router.api_keys import (
    KEYS_HASH,
    ApiKeyConfig,
    ApiKeyStore,
    MirroredKeyAuthenticator,
    key_from_metadata,
)
from services.router.rate_limit import RateLimits
from tests.fake_clock import FakeClock


def test_add_verify_revoke_with_cache_delay() -> None:
    clock = FakeClock()
    store = MemoryStore()
    admin = ApiKeyStore(store, ApiKeyConfig(api_key_pepper="p" * 32))
    router = ApiKeyStore(
        store, ApiKeyConfig(api_key_pepper="p" * 32, api_key_cache_ttl_s=5), clock=clock
    )

    async def scenario() -> None:
        raw, record = await admin.add("team", RateLimits(10, 0))
        stored = await store.hash_get_all(KEYS_HASH)
        assert len(stored) == 1
        ((digest, value),) = stored.items()
        assert raw not in digest and raw.encode() not in value and len(digest) == 64
        assert (await router.verify(raw)).limits == RateLimits(10, 0)
        await admin.revoke(record.key_id)
        assert (await router.verify(raw)).key_id == record.key_id  # cached for 5 s
        clock.now += 5.1
        with pytest.raises(UnauthenticatedError):
            await router.verify(raw)
        with pytest.raises(NotFoundError):
            await admin.revoke(record.key_id)
        with pytest.raises(UnauthenticatedError):
            await router.verify("not-a-sluice-key")
        with pytest.raises(InvalidArgumentError):
            await admin.add("  ")

    asyncio.run(scenario())


def test_pepper_changes_the_digest_and_is_generated_once() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        first, second = ApiKeyStore(store), ApiKeyStore(store)
        raw, _ = await first.add("a")
        assert (await second.verify(raw)).name == "a"  # both found the same stored pepper
        other = ApiKeyStore(store, ApiKeyConfig(api_key_pepper="q" * 32))
        assert await other.digest(raw) != await first.digest(raw)
        with pytest.raises(UnauthenticatedError):
            await other.verify(raw)

    asyncio.run(scenario())
    with pytest.raises(InvalidArgumentError):
        ApiKeyConfig(api_key_pepper="short")


def test_key_from_metadata() -> None:
    assert key_from_metadata([("authorization", "Bearer sk-1")]) == "sk-1"
    assert key_from_metadata([("Authorization", b"bearer sk-2")]) == "sk-2"
    assert key_from_metadata([("x-api-key", " sk-3 ")]) == "sk-3"
    assert key_from_metadata([("authorization", "Basic abc")]) is None
    assert key_from_metadata([]) is None


def test_mirrored_authenticator_follows_adds_and_revokes() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        admin = ApiKeyStore(store)
        mirror = MirroredKeyAuthenticator(ApiKeyStore(store), refresh_s=0.02)
        with pytest.raises(UnavailableError):
            mirror.check([("x-api-key", "sk-sluice-x")])  # nothing loaded yet
        await mirror.start()
        raw, record = await admin.add("svc", RateLimits(3, 0))
        with pytest.raises(UnauthenticatedError):
            mirror.check([])
        await asyncio.sleep(0.1)
        assert mirror.check([("authorization", f"Bearer {raw}")]).key_id == record.key_id
        with pytest.raises(UnauthenticatedError):
            mirror.check([("authorization", f"Bearer {raw}x")])
        await admin.revoke(record.key_id)
        await asyncio.sleep(0.1)
        with pytest.raises(UnauthenticatedError):
            mirror.check([("x-api-key", raw)])
        await mirror.stop()

    asyncio.run(scenario())
