"""The adapter registry against a real redis-server: two routers share it, and an outage keeps
the last view serving while changes are refused with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.common.errors import AlreadyExistsError, NotFoundError, UnavailableError
from services.common.protocol.adapter_record import AdapterRecord
from services.common.redis_server import LocalRedisServer, find_redis_server
from services.common.redis_store import RedisStore, StoreConfig, open_store
from services.router.adapter_registry import AdapterRegistry

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def _store(server: LocalRedisServer) -> RedisStore:
    store = open_store(
        StoreConfig(redis_url=server.url, redis_timeout_s=0.3, redis_probe_interval_s=0.2)
    )
    assert isinstance(store, RedisStore)
    return store


def _record(name: str) -> AdapterRecord:
    return AdapterRecord(name=name, path=f"dirs/{name}", sha256="cd" * 32, rank=4)


def test_two_routers_share_adapters_and_survive_an_outage(redis_server: LocalRedisServer) -> None:
    async def scenario() -> None:
        stores = [_store(redis_server), _store(redis_server)]
        first = AdapterRegistry(stores[0], refresh_s=0.1)
        second = AdapterRegistry(stores[1], refresh_s=0.1)
        await first.start()
        await second.start()
        try:
            await first.add(_record("alpha"))
            assert (await second.lookup("alpha")).path == "dirs/alpha"  # read through at once
            await first.add(_record("beta"))
            await asyncio.sleep(0.35)
            assert second.names() == {"alpha", "beta"}  # the background refresh
            with pytest.raises(AlreadyExistsError):
                await second.add(_record("alpha"))
            await second.remove("beta")
            with pytest.raises(NotFoundError):
                await first.remove("beta")
            await asyncio.sleep(0.35)
            assert first.names() == {"alpha"}

            os.kill(redis_server.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(0.5)
                assert first.degraded and first.names() == {"alpha"}  # the last view serves
                assert (await first.lookup("alpha")).name == "alpha"
                assert await first.lookup("gamma") is None  # unknown, not an error
                with pytest.raises(UnavailableError):
                    await first.add(_record("gamma"))
                with pytest.raises(UnavailableError):
                    await first.remove("alpha")
            finally:
                os.kill(redis_server.pid, signal.SIGCONT)
            await asyncio.sleep(0.6)
            assert not first.degraded
            await first.add(_record("gamma"))
            assert (await second.lookup("gamma")).rank == 4
        finally:
            for registry in (first, second):
                await registry.stop()
            for store in stores:
                await store.close()

    asyncio.run(scenario())
