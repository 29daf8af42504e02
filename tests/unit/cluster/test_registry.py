"""Registration and registry over the in-memory store: join, refresh, expiry, moves, discovery."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgumentError
from services.common.protocol.engine_record import EngineRecord
from services.common.redis_store import MemoryStore
from services.engine.registration import EngineRegistration
from services.router.registry import EngineRegistry, RegistryDiscovery


def test_record_round_trip_and_validation() -> None:
    record = EngineRecord("e", "10.0.0.1:5", "m", resident_adapters=("a", "b"), extra={"k": "v"})
    assert EngineRecord.from_json(record.to_json()) == record
    assert EngineRecord.from_json('{"engine_id": "e", "address": "h:1", "model": "m", "new": 1}')
    with pytest.raises(InvalidArgumentError):
        EngineRecord("", "h:1", "m")
    with pytest.raises(InvalidArgumentError):
        EngineRecord("e", "no-port", "m")


def test_join_move_expire_and_discovery_follow() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        registry = EngineRegistry(store, poll_interval_s=0.02)
        discovery = RegistryDiscovery(registry)
        refreshed: list[tuple[str, ...]] = []

        async def refresh() -> None:
            refreshed.append(await discovery.addresses())

        discovery.follow(refresh)
        await registry.start()
        port = {"value": 1}
        registration = EngineRegistration(
            store,
            lambda: EngineRecord("e1", f"127.0.0.1:{port['value']}", "m"),
            ttl_s=0.3,
            refresh_s=0.05,
        )
        await registration.start()
        assert await registry.wait_until(lambda view: "e1" in view, 1.0)
        await asyncio.sleep(0.05)
        assert refreshed[-1] == ("127.0.0.1:1",)
        port["value"] = 2  # restarted on another port, same id
        assert await registry.wait_until(
            lambda view: view.get("e1") is not None and view["e1"].address.endswith(":2"), 1.0
        )
        await asyncio.sleep(0.05)
        assert refreshed[-1] == ("127.0.0.1:2",)
        count = len(refreshed)
        await asyncio.sleep(0.2)  # load-only refreshes don't trigger pool refreshes
        assert len(refreshed) == count
        await registration.stop(deregister=False)
        assert await registry.wait_until(lambda view: not view, 1.0)
        await asyncio.sleep(0.05)
        assert refreshed[-1] == ()
        await store.set("sluice:engines:bad", "{not json")
        await registry.poll()
        assert registry.engines() == {}
        await registry.stop()

    asyncio.run(scenario())


def test_registration_validation() -> None:
    store = MemoryStore()
    with pytest.raises(InvalidArgumentError):
        EngineRegistration(store, lambda: EngineRecord("e", "h:1", "m"), ttl_s=0)
    with pytest.raises(InvalidArgumentError):
        EngineRegistration(store, lambda: EngineRecord("e", "h:1", "m"), ttl_s=1, refresh_s=2)
