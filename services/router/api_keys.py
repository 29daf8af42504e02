"""API keys kept in the shared store, hashed at rest, verified with a small local cache.

A key is `sk-sluice-<43 random url-safe chars>` (256 bits), shown once when created. The store
holds only HMAC-SHA256(pepper, key) as the field name of the hash `sluice:api_keys`, with a JSON
record (id, name, creation time, per-key rate limits, a short display prefix). The pepper is
per deployment: `--api-key-pepper` / SLUICE_API_KEY_PEPPER when given (best: kept outside Redis),
else one generated once and stored in Redis (then every router of the deployment shares it).
Keys are random, so a fast keyed hash is enough (no password-style stretching needed).

`verify` checks a presented key; a positive answer is cached for `cache_ttl_s`, so a revoked key
stops working within that time on every router. When the store is unreachable, keys this router
has already verified keep working from the cache (however old), and unknown keys are refused
with UNAVAILABLE (they can't be checked) rather than let through.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from services.common.config import field
from services.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from services.common.redis_store import SharedStore, StoreUnavailableError
from services.common.refresher import PeriodicRefresh
from services.router.rate_limit import RateLimits

log = logging.getLogger(__name__)

KEYS_HASH = "sluice:api_keys"
PEPPER_KEY = "sluice:api_keys:pepper"
KEY_PREFIX = "sk-sluice-"
DISPLAY_CHARS = 14


@dataclass(frozen=True)
class ApiKeyConfig:
    """How routers and `sluice keys` hash and cache API keys."""

    api_key_pepper: str | None = field(
        None, help="secret mixed into key hashes (default: generated once, stored in Redis)"
    )
    api_key_cache_ttl_s: float = field(
        5.0, help="seconds a verified key is trusted without asking Redis (revocation delay)"
    )

    def __post_init__(self) -> None:
        if self.api_key_pepper is not None and len(self.api_key_pepper) < 16:
            raise InvalidArgumentError("api_key_pepper must be at least 16 characters")
        if self.api_key_cache_ttl_s < 0:
            raise InvalidArgumentError("api_key_cache_ttl_s must be >= 0")


@dataclass(frozen=True)
class ApiKeyRecord:
    """What is stored about one key (never the key itself)."""

    key_id: str
    name: str
    created_at: float
    display_prefix: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0

    @property
    def limits(self) -> RateLimits:
        return RateLimits(self.requests_per_minute, self.tokens_per_minute)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> ApiKeyRecord:
        data = json.loads(raw)
        known = set(cls.__dataclass_fields__)
        return cls(**{name: value for name, value in data.items() if name in known})


def key_from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The key from `authorization: Bearer <key>` or `x-api-key: <key>` gRPC metadata."""
    for name, value in metadata:
        text = value.decode() if isinstance(value, bytes) else value
        lowered = name.lower()
        if lowered == "authorization" and text[:7].lower() == "bearer ":
            return text[7:].strip() or None
        if lowered == "x-api-key":
            return text.strip() or None
    return None


class ApiKeyStore:
    """Add, list, revoke and verify API keys (module docstring)."""

    def __init__(
        self,
        store: SharedStore,
        config: ApiKeyConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config or ApiKeyConfig()
        self._clock = clock
        self._pepper: bytes | None = (
            self.config.api_key_pepper.encode() if self.config.api_key_pepper else None
        )
        self._cache: dict[str, tuple[ApiKeyRecord, float]] = {}

    async def _get_pepper(self) -> bytes:
        if self._pepper is None:
            await self.store.set(PEPPER_KEY, secrets.token_hex(32), only_if_absent=True)
            stored = await self.store.get(PEPPER_KEY)
            if stored is None:
                raise UnavailableError("API key pepper vanished from the store")
            self._pepper = stored
        return self._pepper

    async def digest(self, raw_key: str) -> str:
        pepper = await self._get_pepper()
        return hmac.new(pepper, raw_key.encode(), hashlib.sha256).hexdigest()

    async def add(self, name: str, limits: RateLimits | None = None) -> tuple[str, ApiKeyRecord]:
        """Create a key; returns (the raw key — show it once, it is not stored — , its record)."""
        if not name or not name.strip():
            raise InvalidArgumentError("a key needs a non-empty name")
        limits = limits or RateLimits()
        raw_key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKeyRecord(
            key_id="key_" + secrets.token_hex(6),
            name=name.strip(),
            created_at=time.time(),
            display_prefix=raw_key[:DISPLAY_CHARS],
            requests_per_minute=limits.requests_per_minute,
            tokens_per_minute=limits.tokens_per_minute,
        )
        await self.store.hash_set(KEYS_HASH, await self.digest(raw_key), record.to_json())
        return raw_key, record

    async def list_keys(self) -> list[ApiKeyRecord]:
        entries = await self.store.hash_get_all(KEYS_HASH)
        records = [ApiKeyRecord.from_json(raw) for raw in entries.values()]
        return sorted(records, key=lambda record: record.created_at)

    async def revoke(self, key_id: str) -> ApiKeyRecord:
        """Delete the key with this id (or this raw key); NotFoundError if there is none."""
        entries = await self.store.hash_get_all(KEYS_HASH)
        wanted = await self.digest(key_id) if key_id.startswith(KEY_PREFIX) else None
        for digest, raw in entries.items():
            record = ApiKeyRecord.from_json(raw)
            if record.key_id == key_id or digest == wanted:
                await self.store.hash_delete(KEYS_HASH, digest)
                self._cache.pop(digest, None)
                return record
        raise NotFoundError(f"no API key {key_id!r}")

    async def verify(self, raw_key: str | None) -> ApiKeyRecord:
        """The record of a valid key; UnauthenticatedError if missing/wrong (module docstring)."""
        if not raw_key:
            raise UnauthenticatedError("missing API key (authorization: Bearer <key>)")
        if not raw_key.startswith(KEY_PREFIX) or len(raw_key) > 200:
            raise UnauthenticatedError("invalid API key")
        pepper = self._pepper
        digest = None
        if pepper is not None:
            digest = hmac.new(pepper, raw_key.encode(), hashlib.sha256).hexdigest()
            cached = self._cache.get(digest)
            if cached is not None and self._clock() - cached[1] < self.config.api_key_cache_ttl_s:
                return cached[0]
        try:
            digest = await self.digest(raw_key)
            raw = await self.store.hash_get(KEYS_HASH, digest)
        except StoreUnavailableError as exc:
            cached = self._cache.get(digest) if digest is not None else None
            if cached is not None:
                return cached[0]  # known key: keep serving through the outage
            raise UnavailableError("cannot check the API key right now; retry shortly") from exc
        if raw is None:
            self._cache.pop(digest, None)
            raise UnauthenticatedError("invalid API key")
        record = ApiKeyRecord.from_json(raw)
        self._cache[digest] = (record, self._clock())
        return record


class MirroredKeyAuthenticator:
    """A synchronous `check(metadata)` for the router, over a local mirror of the key table.

    The router's admission path checks keys synchronously (like services/router/auth.py's
    `ApiKeyAuthenticator`, whose `enabled`/`check` this mirrors, so it can be passed as
    `RouterCore(authenticator=...)`). The mirror (digests and records; never raw keys) is
    reloaded from the store every `refresh_s`: a new key works, and a revoked key stops working,
    on every router within that time. While the store is unreachable the last mirror keeps
    serving (known keys keep working); before the first successful load every call is refused
    with UNAVAILABLE.
    """

    enabled = True

    def __init__(self, keys: ApiKeyStore, *, refresh_s: float = 2.0) -> None:
        if not refresh_s > 0:
            raise InvalidArgumentError("refresh_s must be > 0")
        self.keys = keys
        self.refresh_s = refresh_s
        self._records: dict[str, ApiKeyRecord] | None = None
        self._refresher: PeriodicRefresh | None = None
        self.degraded = False

    async def refresh(self) -> None:
        """Reload the mirror now (raises StoreUnavailableError when the store is down)."""
        try:
            await self.keys._get_pepper()
            entries = await self.keys.store.hash_get_all(KEYS_HASH)
        except StoreUnavailableError:
            self.degraded = True
            raise
        self.degraded = False
        self._records = {digest: ApiKeyRecord.from_json(raw) for digest, raw in entries.items()}

    async def start(self) -> None:
        self._refresher = PeriodicRefresh(self.refresh, self.refresh_s, "API key mirror refresh")
        await self._refresher.start()

    async def stop(self) -> None:
        if self._refresher is not None:
            await self._refresher.stop()
            self._refresher = None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> ApiKeyRecord:
        """The caller's key record; UnauthenticatedError if missing or unknown."""
        raw_key = key_from_metadata(metadata or ())
        if not raw_key:
            raise UnauthenticatedError(
                "missing API key: send 'authorization: Bearer <key>' or 'x-api-key' metadata"
            )
        pepper = self.keys._pepper
        if self._records is None or pepper is None:
            raise UnavailableError("API keys not loaded yet (Redis unreachable); retry shortly")
        digest = hmac.new(pepper, raw_key.encode(), hashlib.sha256).hexdigest()
        record = self._records.get(digest)
        if record is None:
            raise UnauthenticatedError("invalid API key")
        return record
