"""Where engine addresses come from.

`EngineDiscovery` is the interface the engine pool polls: `async addresses()` returns the set of
engine addresses that should be connected now. `StaticDiscovery` returns the list from
`--engines`; `registry.RegistryDiscovery` (Redis heartbeat keys with a TTL) implements the
same interface, so the pool connects to new engines and drops vanished ones without other
changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class EngineDiscovery(Protocol):
    """A source of engine addresses."""

    async def addresses(self) -> tuple[str, ...]: ...


class StaticDiscovery:
    """A fixed list of engine addresses (duplicates dropped, order kept)."""

    def __init__(self, addresses: Iterable[str]) -> None:
        self._addresses = tuple(dict.fromkeys(a.strip() for a in addresses if a.strip()))

    async def addresses(self) -> tuple[str, ...]:
        return self._addresses
