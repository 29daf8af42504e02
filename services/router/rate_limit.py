"""Per-key rate limits (requests/min and tokens/min), shared by every router through Redis.

Each API key has two token buckets: one of `requests_per_minute` requests and one of
`tokens_per_minute` tokens, each refilling continuously and holding at most one minute's worth
(so a burst of N is allowed, then N per minute). One Lua script checks and takes from both buckets
atomically on the Redis server, using the server's clock, so several routers share one budget and
never admit more than the limit between them. A request is admitted only if both buckets can pay;
otherwise it is refused with ResourceExhaustedError carrying `retry_after_s` (when the missing
amount will have refilled). Tokens can be charged after the fact (`charge_tokens`, e.g. generated
tokens beyond the estimate), which may leave the bucket in debt.

When Redis is unreachable (or not configured), each router falls back to the same buckets held in
its own memory: per-router limits, so the cluster-wide budget is only approximate until Redis
returns, and then the shared buckets are used again on the next request without any action.
Policy code: no torch, no gRPC.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.redis_store import RedisStore, SharedStore, StoreUnavailableError

log = logging.getLogger(__name__)

KEY_PREFIX = "sluice:ratelimit:"
WINDOW_S = 60.0

# KEYS[1] = bucket hash. ARGV: requests_per_minute, tokens_per_minute, request_cost, token_cost,
# key_ttl_ms. A limit of 0 means unlimited. Returns {admitted (1/0), retry_after_ms}.
# Levels are stored as floats in a hash with the time (microseconds) of the last update.
LUA_TAKE = """
local key = KEYS[1]
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local request_cost = tonumber(ARGV[3])
local token_cost = tonumber(ARGV[4])
local ttl_ms = tonumber(ARGV[5])
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local state = redis.call('HMGET', key, 'requests', 'tokens', 'updated')
local requests = tonumber(state[1])
local tokens = tonumber(state[2])
local updated = tonumber(state[3])
if updated == nil then
  requests = rpm
  tokens = tpm
  updated = now
end
local elapsed_s = math.max(0, now - updated) / 1000000
if rpm > 0 then requests = math.min(rpm, requests + elapsed_s * rpm / 60) end
if tpm > 0 then tokens = math.min(tpm, tokens + elapsed_s * tpm / 60) end
local wait_s = 0
if rpm > 0 and requests < request_cost then
  wait_s = math.max(wait_s, (request_cost - requests) * 60 / rpm)
end
if tpm > 0 and token_cost > 0 and tokens < token_cost then
  wait_s = math.max(wait_s, (token_cost - tokens) * 60 / tpm)
end
local admitted = 0
if wait_s == 0 then
  admitted = 1
  if rpm > 0 then requests = requests - request_cost end
  if tpm > 0 then tokens = tokens - token_cost end
end
redis.call('HSET', key, 'requests', tostring(requests), 'tokens', tostring(tokens),
           'updated', tostring(now))
redis.call('PEXPIRE', key, ttl_ms)
return {admitted, math.ceil(wait_s * 1000)}
"""


@dataclass(frozen=True)
class RateLimits:
    """One key's limits; 0 means unlimited."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute == 0 and self.tokens_per_minute == 0


@dataclass
class _Bucket:
    requests: float
    tokens: float
    updated: float


class LocalBuckets:
    """The same two-bucket arithmetic as the Lua script, in this process's memory.

    Buckets idle for two windows are full again and are dropped once there are many."""

    MAX_BUCKETS = 10_000

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def _prune(self, now: float) -> None:
        idle = [key for key, b in self._buckets.items() if now - b.updated > 2 * WINDOW_S]
        for key in idle:
            del self._buckets[key]

    def take(self, key: str, limits: RateLimits, requests: int, tokens: int) -> float:
        """Take the costs if both buckets can pay; returns 0.0, else seconds until they can."""
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.MAX_BUCKETS:
                self._prune(now)
            bucket = _Bucket(float(rpm), float(tpm), now)
            self._buckets[key] = bucket
        elapsed = max(0.0, now - bucket.updated)
        bucket.updated = now
        if rpm > 0:
            bucket.requests = min(rpm, bucket.requests + elapsed * rpm / WINDOW_S)
        if tpm > 0:
            bucket.tokens = min(tpm, bucket.tokens + elapsed * tpm / WINDOW_S)
        wait_s = 0.0
        if rpm > 0 and bucket.requests < requests:
            wait_s = max(wait_s, (requests - bucket.requests) * WINDOW_S / rpm)
        if tpm > 0 and tokens > 0 and bucket.tokens < tokens:
            wait_s = max(wait_s, (tokens - bucket.tokens) * WINDOW_S / tpm)
        if wait_s == 0.0:
            if rpm > 0:
                bucket.requests -= requests
            if tpm > 0:
                bucket.tokens -= tokens
        return wait_s


class RateLimiter:
    """Admits or refuses requests per key (module docstring). One per router process."""

    def __init__(
        self,
        store: SharedStore,
        *,
        default_limits: RateLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.default_limits = default_limits or RateLimits()
        self.local = LocalBuckets(clock)
        self.used_fallback = 0

    async def acquire(self, key: str, *, tokens: int = 0, limits: RateLimits | None = None) -> None:
        """Admit one request costing `tokens` for `key`, or raise ResourceExhaustedError."""
        limits = limits or self.default_limits
        if limits.unlimited:
            return
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidArgumentError(f"token cost must be an integer >= 0, got {tokens!r}")
        if limits.tokens_per_minute and tokens > limits.tokens_per_minute:
            raise ResourceExhaustedError(
                f"the request needs {tokens} tokens, more than this key's limit of "
                f"{limits.tokens_per_minute} tokens per minute"
            )
        wait_s = await self._take(key, limits, 1, tokens)
        if wait_s > 0:
            raise ResourceExhaustedError(
                f"rate limit of key {key!r} reached "
                f"({limits.requests_per_minute} requests/min, {limits.tokens_per_minute} "
                f"tokens/min); retry in {wait_s:.1f} s",
                retry_after_s=wait_s,
            )

    async def charge_tokens(
        self, key: str, tokens: int, *, limits: RateLimits | None = None
    ) -> None:
        """Charge tokens used beyond what `acquire` took (never refuses; may leave a debt)."""
        limits = limits or self.default_limits
        if tokens <= 0 or limits.tokens_per_minute == 0:
            return
        debt_limits = RateLimits(0, limits.tokens_per_minute)
        # Taking from a bucket that may be short: charge what is there, then force the rest.
        wait_s = await self._take(key, debt_limits, 0, tokens)
        if wait_s > 0:
            await self._force(key, debt_limits, tokens)

    async def _take(self, key: str, limits: RateLimits, requests: int, tokens: int) -> float:
        if isinstance(self.store, RedisStore):
            try:
                admitted, retry_ms = await self.store.eval_script(
                    LUA_TAKE,
                    [KEY_PREFIX + key],
                    [
                        limits.requests_per_minute,
                        limits.tokens_per_minute,
                        requests,
                        tokens,
                        int(WINDOW_S * 2 * 1000),
                    ],
                )
            except StoreUnavailableError:
                self.used_fallback += 1
                log.debug("rate limit for %r from local buckets (Redis unreachable)", key)
            else:
                return 0.0 if int(admitted) == 1 else max(0.001, int(retry_ms) / 1000)
        return self.local.take(key, limits, requests, tokens)

    async def _force(self, key: str, limits: RateLimits, tokens: int) -> None:
        # The bucket can't pay: subtract anyway (HINCRBYFLOAT is atomic), leaving a debt.
        store = self.store
        if isinstance(store, RedisStore):
            try:
                await store.run(
                    lambda: store.client.hincrbyfloat(KEY_PREFIX + key, "tokens", -tokens)
                )
                return
            except StoreUnavailableError:
                pass
        bucket = self.local._buckets.get(key)
        if bucket is not None:
            bucket.tokens -= tokens


def retry_after_ceiling(seconds: float) -> int:
    """Whole seconds for an HTTP-style Retry-After value."""
    return max(1, math.ceil(seconds))
