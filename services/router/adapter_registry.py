"""The adapter registry: which LoRA adapters requests may name, kept in the shared store.

Records (services/common/protocol/adapter_record.py) are JSON fields of the hash
`sluice:adapters` in Redis, so every router of a deployment serves the same adapters; without
Redis the store is the in-memory one and the registry is this router's own. The router reads a
local view (`get`, `records`) on its admission path without awaiting; the view is reloaded every
`refresh_s` (an adapter added or removed through another router shows up within that time) and
a name missing from it is looked up in the store once before a request is refused. While Redis
is unreachable the last view keeps serving; adding or removing then fails with UNAVAILABLE.
"""

from __future__ import annotations

import logging

from services.common.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from services.common.protocol.adapter_record import AdapterRecord, validate_adapter_name
from services.common.redis_store import MemoryStore, SharedStore, StoreUnavailableError
from services.common.refresher import PeriodicRefresh

log = logging.getLogger(__name__)

ADAPTERS_HASH = "sluice:adapters"


class AdapterRegistry:
    """Add, remove and look up registered adapters (module docstring)."""

    def __init__(self, store: SharedStore | None = None, *, refresh_s: float = 2.0) -> None:
        if not refresh_s > 0:
            raise InvalidArgumentError("refresh_s must be > 0")
        self.store = store if store is not None else MemoryStore()
        self.refresh_s = refresh_s
        self._view: dict[str, AdapterRecord] = {}
        self._refresher: PeriodicRefresh | None = None
        self.degraded = False

    # ---- the local view (synchronous) ---------------------------------------------------
    def get(self, name: str) -> AdapterRecord | None:
        return self._view.get(name)

    def records(self) -> list[AdapterRecord]:
        """Every registered adapter, by name."""
        return [self._view[name] for name in sorted(self._view)]

    def names(self) -> set[str]:
        return set(self._view)

    def __len__(self) -> int:
        return len(self._view)

    # ---- the store ----------------------------------------------------------------------
    async def refresh(self) -> None:
        """Reload the view (raises StoreUnavailableError; the view is kept then)."""
        try:
            entries = await self.store.hash_get_all(ADAPTERS_HASH)
        except StoreUnavailableError:
            self.degraded = True
            raise
        self.degraded = False
        view: dict[str, AdapterRecord] = {}
        for name, raw in entries.items():
            try:
                view[name] = AdapterRecord.from_json(raw)
            except InvalidArgumentError as exc:
                log.warning("ignoring malformed adapter record %r: %s", name, exc.message)
        self._view = view

    async def lookup(self, name: str) -> AdapterRecord | None:
        """The view's record, else the store's (one read; None when unknown or unreachable)."""
        record = self._view.get(name)
        if record is not None or not self.store.shared or self.store.degraded:
            return record  # while Redis is down, the view alone answers (no wait per request)
        try:
            raw = await self.store.hash_get(ADAPTERS_HASH, name)
        except StoreUnavailableError:
            return None
        if raw is None:
            return None
        try:
            record = AdapterRecord.from_json(raw)
        except InvalidArgumentError:
            return None
        self._view[name] = record
        return record

    async def add(self, record: AdapterRecord) -> AdapterRecord:
        """Register `record`; ALREADY_EXISTS when its name is taken, UNAVAILABLE without Redis."""
        await self.check_free(record.name)
        await self.store.hash_set(ADAPTERS_HASH, record.name, record.to_json())
        self._view[record.name] = record
        log.info("adapter %s registered (%s, rank %d)", record.name, record.path, record.rank)
        return record

    async def check_free(self, name: str) -> None:
        """Raise ALREADY_EXISTS when `name` is registered (checked in the store itself)."""
        validate_adapter_name(name)
        if await self.store.hash_get(ADAPTERS_HASH, name) is not None:
            raise AlreadyExistsError(
                f"adapter {name!r} is already registered; remove it first to replace it"
            )

    async def remove(self, name: str) -> AdapterRecord:
        """Unregister `name` and return what it was; NOT_FOUND when unknown."""
        raw = await self.store.hash_get(ADAPTERS_HASH, name)
        if raw is None or not await self.store.hash_delete(ADAPTERS_HASH, name):
            self._view.pop(name, None)
            raise NotFoundError(f"unknown adapter {name[:128]!r}")
        self._view.pop(name, None)
        log.info("adapter %s unregistered", name)
        try:
            return AdapterRecord.from_json(raw)
        except InvalidArgumentError:
            return AdapterRecord(name=name, path=".", sha256="", rank=0)

    async def start(self) -> None:
        """Load the view (best effort) and keep it fresh when the store is shared."""
        if self.store.shared:
            self._refresher = PeriodicRefresh(self.refresh, self.refresh_s, "adapter registry")
            await self._refresher.start()
        else:
            await self.refresh()

    async def stop(self) -> None:
        if self._refresher is not None:
            await self._refresher.stop()
            self._refresher = None
