"""What a router shares with other routers through Redis, built in one place.

`SharedState.open(settings)` wires the shared-state pieces for one router process: the store
(Redis, or an in-memory fallback without --redis-url), the engine registry (discovery of engines
that join and leave), the LoRA adapter registry, API keys kept in Redis (mirrored locally, next
to --api-keys-file), per-key rate limits and the idempotency cache (request ids are idempotent
only with a shared Redis). While Redis is unreachable every piece serves from its last view or
local fallback and `degraded` is True; `on_degraded(cb)` reports changes so the server can
publish them on a named health service. Nothing here blocks the event loop.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.common.errors import UnauthenticatedError
from services.common.redis_store import RedisStore, SharedStore, open_store
from services.router.adapter_registry import AdapterRegistry
from services.router.api_keys import ApiKeyRecord, ApiKeyStore, MirroredKeyAuthenticator
from services.router.auth import ApiKeyAuthenticator, extract_key
from services.router.config import RouterSettings
from services.router.discovery import EngineDiscovery, StaticDiscovery
from services.router.idempotency import IdempotencyCache
from services.router.rate_limit import RateLimiter, RateLimits
from services.router.registry import EngineRegistry, RegistryDiscovery

log = logging.getLogger(__name__)

SHARED_STATE_HEALTH = "sluice.v1.Router.SharedState"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant its ids and limits are scoped to."""

    key_id: str
    limits: RateLimits = field(default_factory=RateLimits)


ANONYMOUS = Caller("")


class CombinedAuthenticator:
    """Keys from --api-keys-file and/or Redis; `check` returns the caller (see `Caller`).

    With neither source the router is open and every caller is anonymous. A key from the file
    is identified by a digest prefix (never the key) and has no per-key limits.
    """

    def __init__(
        self, file_keys: ApiKeyAuthenticator, redis_keys: MirroredKeyAuthenticator | None
    ) -> None:
        self.file_keys = file_keys
        self.redis_keys = redis_keys

    @property
    def enabled(self) -> bool:
        return self.file_keys.enabled or self.redis_keys is not None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        if not self.enabled:
            return ANONYMOUS
        metadata = list(metadata or ())
        if self.file_keys.enabled:
            try:
                self.file_keys.check(metadata)
            except UnauthenticatedError:
                if self.redis_keys is None:
                    raise
            else:
                key = extract_key(metadata) or ""
                return Caller("file:" + hashlib.sha256(key.encode()).hexdigest()[:16])
        if self.redis_keys is None:
            raise UnauthenticatedError("invalid API key")
        record: ApiKeyRecord = self.redis_keys.check(metadata)
        return Caller(record.key_id, record.limits)


class SharedState:
    """The router's store-backed parts (module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        discovery: EngineDiscovery,
        authenticator: CombinedAuthenticator,
        *,
        registry: EngineRegistry | None,
        idempotency_ttl_s: float,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.store = store
        self.adapters = adapters if adapters is not None else AdapterRegistry(store)
        self.discovery = discovery
        self.authenticator = authenticator
        self.registry = registry
        self.rate_limiter = RateLimiter(store)
        # Request ids are idempotent only with a shared store: several routers must agree, and
        # an in-memory record would silently differ per router.
        self.idempotency = (
            IdempotencyCache(store, result_ttl_s=idempotency_ttl_s) if store.shared else None
        )

    @classmethod
    async def open(cls, settings: RouterSettings) -> SharedState:
        config = settings.router
        store = open_store(settings.store)
        registry = None
        discovery: EngineDiscovery = StaticDiscovery(config.engines)
        if config.engine_registry:
            registry = EngineRegistry(store, poll_interval_s=max(config.registry_poll_s, 0.05))
            await registry.start()
            discovery = RegistryDiscovery(registry)
        redis_keys = None
        if config.redis_api_keys:
            redis_keys = MirroredKeyAuthenticator(ApiKeyStore(store, settings.api_keys))
            await redis_keys.start()
        authenticator = CombinedAuthenticator(
            ApiKeyAuthenticator.from_file(config.api_keys_file), redis_keys
        )
        adapters = AdapterRegistry(store, refresh_s=max(config.registry_poll_s, 0.05))
        await adapters.start()
        return cls(
            store,
            discovery,
            authenticator,
            registry=registry,
            idempotency_ttl_s=config.idempotency_ttl_s,
            adapters=adapters,
        )

    @property
    def degraded(self) -> bool:
        return self.store.degraded

    def on_degraded(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(degraded)` whenever Redis goes away or comes back."""
        if isinstance(self.store, RedisStore):
            self.store.add_health_listener(listener)

    def follow_registry(self, refresh: Callable[[], object]) -> None:
        if isinstance(self.discovery, RegistryDiscovery):
            self.discovery.follow(refresh)  # type: ignore[arg-type]

    async def close(self) -> None:
        if self.registry is not None:
            await self.registry.stop()
        if self.authenticator.redis_keys is not None:
            await self.authenticator.redis_keys.stop()
        await self.adapters.stop()
        await self.store.close()
