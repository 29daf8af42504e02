"""The shared-state store: Redis when configured, an in-memory stand-in when not.

Routers and engines share a worker registry, API keys, rate-limit buckets and idempotency
records (ARCHITECTURE.md, "Redis"). They talk to one small async interface, `SharedStore`, so
that:
- `RedisStore` wraps `redis.asyncio` from a `--redis-url` (`redis://` or TLS `rediss://`, with a
  password in the URL or given apart). Every command runs under a short timeout; a failure marks
  the store degraded and raises `StoreUnavailableError` (an UnavailableError) so callers fall back
  to their last known state. The client reconnects by itself on the next command; a background
  probe pings while degraded so health recovers even without traffic.
- `MemoryStore` keeps the same data in this process (keys with TTLs, hashes, lists) for a single
  router with no Redis. `open_store` says which one it made at start-up.
Values are bytes or str (JSON by convention); nothing is pickled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from services.common.config import field
from services.common.errors import InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")
Value = bytes | str


class StoreUnavailableError(UnavailableError):
    """The shared store could not be reached within its timeout."""


@dataclass(frozen=True)
class StoreConfig:
    """Where the shared state lives and how long to wait for it."""

    redis_url: str | None = field(
        None, help="redis:// or rediss:// (TLS) URL of the shared Redis; None = in-memory store"
    )
    redis_password: str | None = field(
        None, help="Redis password (when not in the URL); prefer SLUICE_REDIS_PASSWORD"
    )
    redis_timeout_s: float = field(0.5, help="per-command timeout before Redis counts as down")
    redis_probe_interval_s: float = field(1.0, help="how often a degraded store pings Redis")
    redis_tls_ca_file: str | None = field(None, help="CA bundle to verify a rediss:// server")

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            scheme = urlsplit(self.redis_url).scheme
            if scheme not in ("redis", "rediss", "unix"):
                raise InvalidArgumentError(
                    f"redis_url must start with redis://, rediss:// or unix://, got {scheme!r}"
                )
        if not self.redis_timeout_s > 0:
            raise InvalidArgumentError("redis_timeout_s must be > 0")
        if not self.redis_probe_interval_s > 0:
            raise InvalidArgumentError("redis_probe_interval_s must be > 0")


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class SharedStore:
    """The operations Sluice needs from shared state (implemented by Redis and memory stores)."""

    kind: str = "abstract"

    @property
    def degraded(self) -> bool:
        """True while the backing service is unreachable (the memory store never is)."""
        return False

    @property
    def shared(self) -> bool:
        """True when other processes see the same data (Redis), False for the memory store."""
        return False

    async def ping(self) -> bool:
        raise NotImplementedError

    async def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        raise NotImplementedError

    async def set(
        self, key: str, value: Value, *, ttl_s: float | None = None, only_if_absent: bool = False
    ) -> bool:
        """Store `value`; with `only_if_absent` write nothing and return False if the key exists."""
        raise NotImplementedError

    async def delete(self, *keys: str) -> int:
        raise NotImplementedError

    async def expire(self, key: str, ttl_s: float) -> bool:
        raise NotImplementedError

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        raise NotImplementedError

    async def hash_set(self, key: str, field_name: str, value: Value) -> None:
        raise NotImplementedError

    async def hash_get(self, key: str, field_name: str) -> bytes | None:
        raise NotImplementedError

    async def hash_get_all(self, key: str) -> dict[str, bytes]:
        raise NotImplementedError

    async def hash_delete(self, key: str, field_name: str) -> int:
        raise NotImplementedError

    async def list_append(self, key: str, value: Value, *, ttl_s: float | None = None) -> int:
        raise NotImplementedError

    async def list_range(self, key: str, start: int) -> list[bytes]:
        """Items from index `start` to the end."""
        raise NotImplementedError

    async def close(self) -> None:
        return None


def _to_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RedisStore(SharedStore):
    """`SharedStore` over redis.asyncio with timeouts and degraded tracking (module docstring)."""

    kind = "redis"

    def __init__(self, client: Any, *, timeout_s: float, probe_interval_s: float, url: str) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.url = redact_url(url)
        self._degraded = False
        self._probe_task: asyncio.Task[None] | None = None
        self._scripts: dict[str, Any] = {}
        self._listeners: list[Callable[[bool], None]] = []
        self.last_error: str | None = None

    def add_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(degraded)` whenever the store goes down or comes back."""
        self._listeners.append(listener)

    def _set_degraded(self, degraded: bool) -> None:
        if degraded == self._degraded:
            return
        self._degraded = degraded
        for listener in list(self._listeners):
            try:
                listener(degraded)
            except Exception:  # noqa: BLE001 - a listener must not break the store
                log.exception("store health listener failed")

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def shared(self) -> bool:
        return True

    async def run(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis operation under the timeout; failures raise StoreUnavailableError."""
        try:
            result = await asyncio.wait_for(operation(), self.timeout_s)
        except (asyncio.TimeoutError, OSError, ConnectionError) as exc:
            self._mark_down(exc)
            raise StoreUnavailableError(f"Redis at {self.url} unreachable: {exc!r}") from exc
        except Exception as exc:
            import redis.exceptions

            if isinstance(exc, redis.exceptions.AuthenticationError):
                self._mark_down(exc)
                raise StoreUnavailableError(
                    f"Redis at {self.url} refused the password (check --redis-url/password)"
                ) from exc
            if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
                self._mark_down(exc)
                raise StoreUnavailableError(f"Redis at {self.url} unreachable: {exc!r}") from exc
            raise
        if self._degraded:
            log.warning("Redis at %s is reachable again", self.url)
            self._set_degraded(False)
        return result

    def _mark_down(self, exc: BaseException) -> None:
        self.last_error = repr(exc)
        if not self._degraded:
            log.warning("Redis at %s unreachable (%r): running degraded", self.url, exc)
            self._set_degraded(True)
        if self._probe_task is None or self._probe_task.done():
            try:
                self._probe_task = asyncio.get_running_loop().create_task(self._probe())
            except RuntimeError:
                self._probe_task = None

    async def _probe(self) -> None:
        while self._degraded:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.ping()
            except StoreUnavailableError:
                continue

    async def ping(self) -> bool:
        return bool(await self.run(self.client.ping))

    async def get(self, key: str) -> bytes | None:
        return await self.run(lambda: self.client.get(key))

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return list(await self.run(lambda: self.client.mget(list(keys))))

    async def set(
        self, key: str, value: Value, *, ttl_s: float | None = None, only_if_absent: bool = False
    ) -> bool:
        milliseconds = None if ttl_s is None else max(1, int(ttl_s * 1000))
        result = await self.run(
            lambda: self.client.set(key, _to_bytes(value), px=milliseconds, nx=only_if_absent)
        )
        return bool(result)

    async def delete(self, *keys: str) -> int:
        if not keys:
            return 0
        return int(await self.run(lambda: self.client.delete(*keys)))

    async def expire(self, key: str, ttl_s: float) -> bool:
        return bool(await self.run(lambda: self.client.pexpire(key, max(1, int(ttl_s * 1000)))))

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        async def scan() -> list[str]:
            pattern = _escape_glob(prefix) + "*"
            found = [key async for key in self.client.scan_iter(match=pattern, count=500)]
            return [key.decode() if isinstance(key, bytes) else key for key in found]

        return await self.run(scan)

    async def hash_set(self, key: str, field_name: str, value: Value) -> None:
        await self.run(lambda: self.client.hset(key, field_name, _to_bytes(value)))

    async def hash_get(self, key: str, field_name: str) -> bytes | None:
        return await self.run(lambda: self.client.hget(key, field_name))

    async def hash_get_all(self, key: str) -> dict[str, bytes]:
        raw = await self.run(lambda: self.client.hgetall(key))
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}

    async def hash_delete(self, key: str, field_name: str) -> int:
        return int(await self.run(lambda: self.client.hdel(key, field_name)))

    async def list_append(self, key: str, value: Value, *, ttl_s: float | None = None) -> int:
        async def append() -> int:
            pipe = self.client.pipeline(transaction=True)
            pipe.rpush(key, _to_bytes(value))
            if ttl_s is not None:
                pipe.pexpire(key, max(1, int(ttl_s * 1000)))
            results = await pipe.execute()
            return int(results[0])

        return await self.run(append)

    async def list_range(self, key: str, start: int) -> list[bytes]:
        return list(await self.run(lambda: self.client.lrange(key, start, -1)))

    async def eval_script(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a Lua script atomically (cached by SHA; EVALSHA with EVAL fallback)."""
        script = self._scripts.get(source)
        if script is None:
            script = self.client.register_script(source)
            self._scripts[source] = script
        return await self.run(lambda: script(keys=list(keys), args=list(args)))

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        await self.client.aclose()


def _escape_glob(text: str) -> str:
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


class MemoryStore(SharedStore):
    """`SharedStore` held in this process: one router, no Redis, same semantics incl. TTLs."""

    kind = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._values: dict[str, Any] = {}
        self._expiry: dict[str, float] = {}

    def _live(self, key: str) -> Any:
        deadline = self._expiry.get(key)
        if deadline is not None and self._clock() >= deadline:
            self._values.pop(key, None)
            self._expiry.pop(key, None)
        return self._values.get(key)

    def _set_ttl(self, key: str, ttl_s: float | None) -> None:
        if ttl_s is None:
            self._expiry.pop(key, None)
        else:
            self._expiry[key] = self._clock() + ttl_s

    async def ping(self) -> bool:
        return True

    async def get(self, key: str) -> bytes | None:
        value = self._live(key)
        return value if isinstance(value, bytes) else None

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [await self.get(key) for key in keys]

    async def set(
        self, key: str, value: Value, *, ttl_s: float | None = None, only_if_absent: bool = False
    ) -> bool:
        if only_if_absent and self._live(key) is not None:
            return False
        self._values[key] = _to_bytes(value)
        self._set_ttl(key, ttl_s)
        return True

    async def delete(self, *keys: str) -> int:
        removed = 0
        for key in keys:
            if self._live(key) is not None:
                removed += 1
            self._values.pop(key, None)
            self._expiry.pop(key, None)
        return removed

    async def expire(self, key: str, ttl_s: float) -> bool:
        if self._live(key) is None:
            return False
        self._set_ttl(key, ttl_s)
        return True

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        return [
            key
            for key in list(self._values)
            if key.startswith(prefix) and self._live(key) is not None
        ]

    async def hash_set(self, key: str, field_name: str, value: Value) -> None:
        table = self._live(key)
        if not isinstance(table, dict):
            table = {}
            self._values[key] = table
        table[field_name] = _to_bytes(value)

    async def hash_get(self, key: str, field_name: str) -> bytes | None:
        table = self._live(key)
        return table.get(field_name) if isinstance(table, dict) else None

    async def hash_get_all(self, key: str) -> dict[str, bytes]:
        table = self._live(key)
        return dict(table) if isinstance(table, dict) else {}

    async def hash_delete(self, key: str, field_name: str) -> int:
        table = self._live(key)
        if not isinstance(table, dict) or field_name not in table:
            return 0
        del table[field_name]
        return 1

    async def list_append(self, key: str, value: Value, *, ttl_s: float | None = None) -> int:
        items = self._live(key)
        if not isinstance(items, list):
            items = []
            self._values[key] = items
        items.append(_to_bytes(value))
        if ttl_s is not None:
            self._set_ttl(key, ttl_s)
        return len(items)

    async def list_range(self, key: str, start: int) -> list[bytes]:
        items = self._live(key)
        return list(items[start:]) if isinstance(items, list) else []


def open_store(config: StoreConfig) -> SharedStore:
    """A RedisStore for `config.redis_url`, else a MemoryStore; logs which one at start-up."""
    if config.redis_url is None:
        log.warning(
            "no --redis-url: using an in-memory store (registry, keys, rate limits and "
            "idempotency are local to this process and not shared)"
        )
        return MemoryStore()
    import redis.asyncio

    kwargs: dict[str, Any] = {
        "socket_timeout": config.redis_timeout_s,
        "socket_connect_timeout": config.redis_timeout_s,
        "health_check_interval": 5,
    }
    if config.redis_password is not None:
        kwargs["password"] = config.redis_password
    if urlsplit(config.redis_url).scheme == "rediss" and config.redis_tls_ca_file:
        kwargs["ssl_ca_certs"] = config.redis_tls_ca_file
    client = redis.asyncio.Redis.from_url(config.redis_url, **kwargs)
    log.info("shared store: Redis at %s", redact_url(config.redis_url))
    return RedisStore(
        client,
        timeout_s=config.redis_timeout_s,
        probe_interval_s=config.redis_probe_interval_s,
        url=config.redis_url,
    )
