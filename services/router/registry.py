"""The router's view of the worker registry: which engines exist, where, and how loaded.

Engines publish `EngineRecord`s (services/common/protocol/engine_record.py) with a TTL.
`EngineRegistry` polls them every `poll_interval_s` and keeps a local view: an engine that
registers joins the view at the next poll (no router restart), one whose key expired (it stopped
refreshing: dead or partitioned) leaves it, so a dead engine is gone within TTL + one poll.
Listeners are told of joins, updates (new address after a restart, new load) and leaves, which is
how an engine pool opens and closes its sessions.

When the store is unreachable the poll fails fast (the store's timeout), the registry reports
`degraded` and keeps serving its last known view unchanged; it keeps polling and resumes on its
own when the store answers again. Plain asyncio; no torch, no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError
from services.common.protocol.engine_record import ENGINE_KEY_PREFIX, EngineRecord
from services.common.redis_store import SharedStore, StoreUnavailableError
from services.common.refresher import PeriodicRefresh

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryChange:
    """What one poll changed."""

    joined: tuple[EngineRecord, ...] = ()
    updated: tuple[EngineRecord, ...] = ()  # refreshed records (load, adapters, address)
    left: tuple[EngineRecord, ...] = ()
    moved: tuple[EngineRecord, ...] = ()  # the subset of `updated` with a new address

    @property
    def addresses_changed(self) -> bool:
        return bool(self.joined or self.left or self.moved)

    @property
    def empty(self) -> bool:
        return not (self.joined or self.updated or self.left)


Listener = Callable[[RegistryChange], None]


class EngineRegistry:
    """Watches `sluice:engines:*` and keeps the last known view (module docstring)."""

    def __init__(self, store: SharedStore, *, poll_interval_s: float = 1.0) -> None:
        if not poll_interval_s > 0:
            raise InvalidArgumentError("poll_interval_s must be > 0")
        self.store = store
        self.poll_interval_s = poll_interval_s
        self._engines: dict[str, EngineRecord] = {}
        self._listeners: list[Listener] = []
        self._refresher: PeriodicRefresh | None = None
        self._degraded = False
        self.last_success: float | None = None
        self.changed = asyncio.Event()

    @property
    def degraded(self) -> bool:
        """True while the last poll failed: the view is the last known one."""
        return self._degraded

    def engines(self) -> dict[str, EngineRecord]:
        """engine_id -> record, as of the last successful poll."""
        return dict(self._engines)

    def addresses(self) -> list[str]:
        return sorted(record.address for record in self._engines.values())

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def poll(self) -> RegistryChange:
        """Read the registry once and update the view (raises StoreUnavailableError)."""
        try:
            keys = await self.store.keys_with_prefix(ENGINE_KEY_PREFIX)
            values = await self.store.get_many(keys)
        except StoreUnavailableError:
            if not self._degraded:
                log.warning("engine registry unreachable: serving the last known view")
            self._degraded = True
            raise
        if self._degraded:
            log.warning("engine registry reachable again")
        self._degraded = False
        self.last_success = time.monotonic()
        fresh: dict[str, EngineRecord] = {}
        for key, raw in zip(keys, values, strict=True):
            if raw is None:
                continue  # expired between SCAN and MGET
            try:
                record = EngineRecord.from_json(raw)
            except (ValueError, TypeError) as exc:
                log.warning("ignoring malformed registry entry %s: %s", key, exc)
                continue
            fresh[record.engine_id] = record
        change = self._apply(fresh)
        if not change.empty:
            self._notify(change)
        return change

    def _apply(self, fresh: dict[str, EngineRecord]) -> RegistryChange:
        old = self._engines
        joined = tuple(record for engine_id, record in fresh.items() if engine_id not in old)
        left = tuple(record for engine_id, record in old.items() if engine_id not in fresh)
        updated = tuple(
            record
            for engine_id, record in fresh.items()
            if engine_id in old and record.updated_at != old[engine_id].updated_at
        )
        moved = tuple(
            record
            for engine_id, record in fresh.items()
            if engine_id in old and record.address != old[engine_id].address
        )
        self._engines = fresh
        for record in moved:
            log.info("engine %s moved to %s", record.engine_id, record.address)
        for record in joined:
            log.info("engine %s joined at %s", record.engine_id, record.address)
        for record in left:
            log.info("engine %s left (%s)", record.engine_id, record.address)
        return RegistryChange(joined, updated, left, moved)

    def _notify(self, change: RegistryChange) -> None:
        self.changed.set()
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:  # noqa: BLE001 - one bad listener must not stop the watcher
                log.exception("registry listener failed")

    async def start(self) -> None:
        """Poll once (best effort), then keep polling in the background."""
        self._refresher = PeriodicRefresh(self.poll, self.poll_interval_s, "engine registry poll")
        await self._refresher.start()

    async def wait_until(
        self, predicate: Callable[[dict[str, EngineRecord]], bool], timeout_s: float
    ) -> bool:
        """Wait until `predicate(view)` holds (checked after each change); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.engines()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, self.poll_interval_s))
        return True

    async def stop(self) -> None:
        if self._refresher is not None:
            await self._refresher.stop()
            self._refresher = None


class RegistryDiscovery:
    """The router's `EngineDiscovery` (services/router/discovery.py) backed by the registry.

    `addresses()` is the registry's current view (the last known one while Redis is down).
    `follow(refresh)` calls `refresh()` (e.g. `EnginePool.refresh`) after every change, so
    engines that join, restart on a new address or leave are picked up without a restart.
    """

    def __init__(self, registry: EngineRegistry) -> None:
        self.registry = registry
        self._refresh_tasks: set[asyncio.Task[None]] = set()

    async def addresses(self) -> tuple[str, ...]:
        return tuple(self.registry.addresses())

    def follow(self, refresh: Callable[[], Awaitable[None]]) -> None:
        def on_change(change: RegistryChange) -> None:
            if not change.addresses_changed:
                return  # a load-only refresh: the address set is unchanged
            task = asyncio.get_running_loop().create_task(refresh())
            self._refresh_tasks.add(task)
            task.add_done_callback(self._refresh_tasks.discard)

        self.registry.add_listener(on_change)
