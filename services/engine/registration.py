"""Keeps an engine's entry in the shared worker registry fresh: written with a TTL, rewritten.

Each engine (standalone or as a Ray actor) publishes an `EngineRecord`
(services/common/protocol/engine_record.py: its gRPC address, model, capacity, current load and
resident LoRA adapters) as JSON under `sluice:engines:<engine_id>` with a TTL, and rewrites it
every `refresh_s` (a fraction of the TTL). Routers watch these keys
(services/router/registry.py): a new engine shows up without restarting anything, and an engine
that dies stops refreshing and vanishes when its key expires. A clean exit deletes the key at once.
A Redis outage is ridden out: failed refreshes are logged and retried, and the record is rewritten
as soon as Redis answers again. Plain asyncio + JSON; no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from services.common.errors import InvalidArgumentError
from services.common.protocol.engine_record import EngineRecord
from services.common.redis_store import SharedStore, StoreUnavailableError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 10.0


class EngineRegistration:
    """Keeps one engine's record alive in the store (module docstring).

    `snapshot()` (plain or async) is called before each refresh to get the current record (load,
    adapters); its `updated_at` is stamped here.
    """

    def __init__(
        self,
        store: SharedStore,
        snapshot: Callable[[], EngineRecord | Awaitable[EngineRecord]],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        refresh_s: float | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise InvalidArgumentError("registration ttl_s must be > 0")
        self.store = store
        self.snapshot = snapshot
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s if refresh_s is not None else ttl_s / 3
        if not 0 < self.refresh_s < ttl_s:
            raise InvalidArgumentError("refresh_s must be > 0 and shorter than ttl_s")
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.last_record: EngineRecord | None = None
        self.failures = 0

    async def publish(self) -> EngineRecord:
        """Write the record now (raises StoreUnavailableError when the store is down)."""
        current = self.snapshot()
        if inspect.isawaitable(current):
            current = await current
        record = replace(current, updated_at=time.time())
        await self.store.set(record.key, record.to_json(), ttl_s=self.ttl_s)
        self.last_record = record
        return record

    async def start(self) -> EngineRecord | None:
        """Publish once (best effort) and keep refreshing in the background."""
        record: EngineRecord | None = None
        try:
            record = await self.publish()
            log.info("registered engine %s at %s", record.engine_id, record.address)
        except StoreUnavailableError as exc:
            self.failures += 1
            log.warning("could not register engine yet (%s); will retry", exc)
        self._task = asyncio.get_running_loop().create_task(self._refresh_loop())
        return record

    async def _refresh_loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.refresh_s)
            if self._stopping.is_set():
                return
            try:
                await self.publish()
            except StoreUnavailableError as exc:
                self.failures += 1
                log.warning("engine registry refresh failed (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - a bad snapshot must not end the refresher
                self.failures += 1
                log.exception("engine registry refresh failed")

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop refreshing; with `deregister`, delete the record so routers drop it now."""
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister and self.last_record is not None:
            try:
                await self.store.delete(self.last_record.key)
                log.info("deregistered engine %s", self.last_record.engine_id)
            except StoreUnavailableError as exc:
                log.warning("could not deregister (%s); the key expires in %.0f s", exc, self.ttl_s)
