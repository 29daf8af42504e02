"""A background task that keeps a local view of shared state fresh.

Used by the router's views of Redis (engine registry, API-key mirror): refresh once at start
(best effort), then every interval; a store outage skips a round (the view keeps its last
state), any other error is logged and the task keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from services.common.redis_store import StoreUnavailableError

log = logging.getLogger(__name__)


class PeriodicRefresh:
    """Calls `refresh()` now and then every `interval_s` seconds until stopped."""

    def __init__(
        self, refresh: Callable[[], Awaitable[object]], interval_s: float, what: str
    ) -> None:
        self._refresh = refresh
        self._interval_s = interval_s
        self._what = what
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with contextlib.suppress(StoreUnavailableError):
            await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._refresh()
            except StoreUnavailableError:
                continue
            except Exception:  # noqa: BLE001 - keep the view alive whatever happens
                log.exception("%s failed", self._what)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
