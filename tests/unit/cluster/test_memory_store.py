"""MemoryStore: the no-Redis stand-in keeps Redis semantics (TTL, NX, hashes, lists, prefixes)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgumentError
from services.common.redis_store import MemoryStore, StoreConfig, open_store, redact_url
from tests.fake_clock import FakeClock


def test_ttl_nx_prefix_hash_list() -> None:
    clock = FakeClock(100.0)
    store = MemoryStore(clock)

    async def scenario() -> None:
        assert await store.set("a:1", "x", ttl_s=2)
        assert not await store.set("a:1", "y", only_if_absent=True)
        assert await store.set("a:2", b"z")
        assert await store.set("b:1", "w")
        assert sorted(await store.keys_with_prefix("a:")) == ["a:1", "a:2"]
        assert await store.get_many(["a:1", "missing", "a:2"]) == [b"x", None, b"z"]
        clock.now += 2.5
        assert await store.get("a:1") is None
        assert await store.set("a:1", "y", only_if_absent=True)  # expired: free again
        assert sorted(await store.keys_with_prefix("a:")) == ["a:1", "a:2"]
        await store.hash_set("h", "f", "1")
        assert await store.hash_get("h", "f") == b"1"
        assert await store.hash_get_all("h") == {"f": b"1"}
        assert await store.hash_delete("h", "f") == 1 and await store.hash_delete("h", "f") == 0
        assert await store.list_append("l", "1", ttl_s=1) == 1
        assert await store.list_append("l", "2", ttl_s=1) == 2
        assert await store.list_range("l", 1) == [b"2"]
        clock.now += 1.5
        assert await store.list_range("l", 0) == []
        assert await store.delete("a:1", "a:2", "nope") == 2
        assert not await store.expire("a:1", 5)
        assert not store.degraded and not store.shared and await store.ping()

    asyncio.run(scenario())


def test_prefix_is_literal_not_a_glob() -> None:
    store = MemoryStore()

    async def scenario() -> list[str]:
        await store.set("k[1]*x", "1")
        await store.set("k1x", "1")
        return await store.keys_with_prefix("k[1]*")

    assert asyncio.run(scenario()) == ["k[1]*x"]


def test_config_validation_and_factory() -> None:
    with pytest.raises(InvalidArgumentError):
        StoreConfig(redis_url="http://localhost:6379")
    with pytest.raises(InvalidArgumentError):
        StoreConfig(redis_url="redis://localhost", redis_timeout_s=0)
    assert isinstance(open_store(StoreConfig()), MemoryStore)
    tls = open_store(StoreConfig(redis_url="rediss://:secret@example.invalid:6380/0"))
    assert tls.kind == "redis" and "secret" not in tls.url  # type: ignore[attr-defined]
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
