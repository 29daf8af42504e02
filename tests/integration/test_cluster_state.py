"""API keys, `sluice keys` and idempotency against a real redis-server (two routers' stores)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services import keys_cli
from services.common.errors import (
    AlreadyExistsError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from services.common.redis_server import LocalRedisServer, find_redis_server
from services.common.redis_store import RedisStore, StoreConfig, open_store
from services.router.api_keys import ApiKeyConfig, ApiKeyStore
from services.router.idempotency import ClaimKind, IdempotencyCache, payload_hash
from services.router.rate_limit import RateLimits

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def _store(server: LocalRedisServer) -> RedisStore:
    store = open_store(
        StoreConfig(redis_url=server.url, redis_timeout_s=0.3, redis_probe_interval_s=0.2)
    )
    assert isinstance(store, RedisStore)
    return store


async def _everything_in_redis(store: RedisStore) -> bytes:
    dump = b""
    async for key in store.client.scan_iter(match="*"):
        dump += key
        kind = (await store.client.type(key)).decode()
        if kind == "string":
            dump += await store.client.get(key)
        elif kind == "hash":
            for field_name, value in (await store.client.hgetall(key)).items():
                dump += field_name + value
    return dump


def test_api_keys_hashed_at_rest_revoked_and_cached_through_outage(
    redis_server: LocalRedisServer,
) -> None:
    async def scenario() -> None:
        admin_store, router_store = _store(redis_server), _store(redis_server)
        admin = ApiKeyStore(admin_store)
        router = ApiKeyStore(router_store, ApiKeyConfig(api_key_cache_ttl_s=0.0))
        raw_alice, alice = await admin.add("alice", RateLimits(60, 1000))
        raw_bob, bob = await admin.add("bob")
        assert raw_alice != raw_bob and raw_alice.startswith("sk-sluice-")
        dump = await _everything_in_redis(admin_store)
        assert raw_alice.encode() not in dump and raw_bob.encode() not in dump
        assert raw_alice[10:].encode() not in dump  # not even the random part
        assert (await router.verify(raw_alice)).limits == RateLimits(60, 1000)
        assert (await router.verify(raw_bob)).key_id == bob.key_id
        with pytest.raises(UnauthenticatedError):
            await router.verify(raw_alice[:-1] + ("A" if raw_alice[-1] != "A" else "B"))
        with pytest.raises(UnauthenticatedError):
            await router.verify(None)
        assert [record.name for record in await admin.list_keys()] == ["alice", "bob"]
        # Redis down: known keys keep working; an unknown one can't be checked.
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            assert (await router.verify(raw_alice)).key_id == alice.key_id
            with pytest.raises(UnavailableError):
                await router.verify("sk-sluice-" + "x" * 43)
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        await admin.revoke(alice.key_id)
        with pytest.raises(UnauthenticatedError):
            await router.verify(raw_alice)
        with pytest.raises(NotFoundError):
            await admin.revoke(alice.key_id)
        assert (await router.verify(raw_bob)).name == "bob"
        await admin.revoke(raw_bob)  # revoking by the key itself works too
        with pytest.raises(UnauthenticatedError):
            await router.verify(raw_bob)
        await admin_store.close()
        await router_store.close()

    asyncio.run(scenario())


def test_keys_cli_add_list_revoke(
    redis_server: LocalRedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--redis-url", redis_server.url]
    assert keys_cli.main(["add", "--name", "ci-bot", "--requests-per-minute", "5", *url]) == 0
    created = capsys.readouterr().out.splitlines()
    raw_key = created[-1].strip()
    key_id = created[0].split()[1]
    assert raw_key.startswith("sk-sluice-") and key_id.startswith("key_")
    assert keys_cli.main(["list", *url]) == 0
    listing = capsys.readouterr().out
    assert key_id in listing and "ci-bot" in listing and raw_key not in listing

    async def check(expect_valid: bool) -> None:
        store = _store(redis_server)
        keys = ApiKeyStore(store)
        if expect_valid:
            assert (await keys.verify(raw_key)).requests_per_minute == 5
        else:
            with pytest.raises(UnauthenticatedError):
                await keys.verify(raw_key)
        await store.close()

    asyncio.run(check(True))
    assert keys_cli.main(["revoke", key_id, *url]) == 0
    asyncio.run(check(False))
    assert keys_cli.main(["revoke", key_id, *url]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_idempotency_across_two_routers(redis_server: LocalRedisServer) -> None:
    async def scenario() -> None:
        first_store, second_store = _store(redis_server), _store(redis_server)
        first = IdempotencyCache(first_store, result_ttl_s=60, lease_s=2)
        second = IdempotencyCache(second_store, result_ttl_s=60, lease_s=2)
        digest = payload_hash(b"prompt=hello;max_tokens=3")
        assert (await first.claim("req-1", digest)).kind is ClaimKind.NEW
        await first.append("req-1", b"chunk-0")
        # Router 2 sees it in flight and joins the stream.
        joined = await second.claim("req-1", digest)
        assert joined.kind is ClaimKind.IN_FLIGHT
        with pytest.raises(AlreadyExistsError):
            await second.claim("req-1", payload_hash(b"another payload"))

        async def follow() -> list[bytes]:
            return [chunk async for chunk in second.replay("req-1", timeout_s=5)]

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        await first.append("req-1", b"chunk-1")
        await first.append("req-1", b"chunk-2")
        await first.complete("req-1")
        assert await follower == [b"chunk-0", b"chunk-1", b"chunk-2"]
        # A later retry gets the stored result without generating.
        again = await second.claim("req-1", digest)
        assert again.kind is ClaimKind.DONE
        assert [chunk async for chunk in second.replay("req-1")] == [
            b"chunk-0",
            b"chunk-1",
            b"chunk-2",
        ]
        # A failed attempt is forgotten: the retry runs again.
        assert (await first.claim("req-2", digest)).kind is ClaimKind.NEW
        await first.abandon("req-2")
        assert (await second.claim("req-2", digest)).kind is ClaimKind.NEW
        # An owner that dies mid-stream: its lease lapses and followers are told, not hung.
        assert (await first.claim("req-3", digest)).kind is ClaimKind.NEW
        await first.append("req-3", b"partial")
        with pytest.raises(UnavailableError):
            _ = [chunk async for chunk in second.replay("req-3", timeout_s=10)]
        assert (await second.claim("req-3", digest)).kind is ClaimKind.NEW
        await first_store.close()
        await second_store.close()

    asyncio.run(scenario())
