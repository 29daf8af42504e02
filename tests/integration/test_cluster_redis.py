"""Shared state against a real redis-server: store, rate limits shared by two routers, registry.

Each test module starts its own private redis-server (random port and password, temp dir) and
stops it at the end. SIGSTOP/SIGCONT on that server simulates Redis becoming unreachable.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.common.errors import ResourceExhaustedError
from services.common.protocol.engine_record import EngineRecord
from services.common.redis_server import (
    LocalRedisServer,
    find_redis_server,
    redis_for_stack,
    start_redis_server,
)
from services.common.redis_store import (
    RedisStore,
    StoreConfig,
    StoreUnavailableError,
    open_store,
)
from services.engine.registration import EngineRegistration
from services.router.rate_limit import RateLimiter, RateLimits
from services.router.registry import EngineRegistry

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")


def _store(server: LocalRedisServer, timeout_s: float = 0.3) -> RedisStore:
    store = open_store(
        StoreConfig(redis_url=server.url, redis_timeout_s=timeout_s, redis_probe_interval_s=0.2)
    )
    assert isinstance(store, RedisStore)
    return store


def test_private_server_requires_its_password(redis_server: LocalRedisServer) -> None:
    async def scenario() -> None:
        wrong = open_store(StoreConfig(redis_url=f"redis://:wrong@127.0.0.1:{redis_server.port}/0"))
        with pytest.raises(StoreUnavailableError, match="refused the password"):
            await wrong.ping()
        assert wrong.degraded
        await wrong.close()
        store = _store(redis_server)
        assert await store.ping()
        assert await store.set("sluice:test:a", "1", ttl_s=0.3)
        assert not await store.set("sluice:test:a", "2", only_if_absent=True)
        assert await store.get("sluice:test:a") == b"1"
        assert "sluice:test:a" in await store.keys_with_prefix("sluice:test:")
        await asyncio.sleep(0.45)
        assert await store.get("sluice:test:a") is None
        await store.close()

    asyncio.run(scenario())


def test_two_routers_share_one_request_limit_exactly(redis_server: LocalRedisServer) -> None:
    limit = 7
    limits = RateLimits(requests_per_minute=limit)

    async def scenario() -> tuple[int, list[float]]:
        stores = [_store(redis_server, timeout_s=2.0) for _ in range(2)]
        routers = [RateLimiter(store, default_limits=limits) for store in stores]

        async def attempt(index: int) -> float | None:
            try:
                await routers[index % 2].acquire("tenant-shared")
            except ResourceExhaustedError as exc:
                return exc.retry_after_s
            return None

        results = await asyncio.gather(*(attempt(i) for i in range(40)))
        for store in stores:
            await store.close()
        admitted = sum(1 for result in results if result is None)
        return admitted, [result for result in results if result is not None]

    admitted, retry_hints = asyncio.run(scenario())
    assert admitted == limit
    assert len(retry_hints) == 40 - limit
    # One request refills every 60/limit seconds: the hint is positive and at most that.
    assert all(0 < hint <= 60 / limit + 0.01 for hint in retry_hints)


def test_token_limit_and_fallback_when_redis_paused(redis_server: LocalRedisServer) -> None:
    limits = RateLimits(requests_per_minute=1000, tokens_per_minute=100)

    async def scenario() -> None:
        store = _store(redis_server)
        limiter = RateLimiter(store, default_limits=limits)
        await limiter.acquire("tenant-tokens", tokens=60)
        with pytest.raises(ResourceExhaustedError) as refused:
            await limiter.acquire("tenant-tokens", tokens=60)
        assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 10
        with pytest.raises(ResourceExhaustedError):
            await limiter.acquire("tenant-tokens", tokens=101)  # can never fit
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            # Redis is down: this router's own buckets decide, quickly.
            await limiter.acquire("tenant-tokens", tokens=60)
            with pytest.raises(ResourceExhaustedError):
                await limiter.acquire("tenant-tokens", tokens=60)
            assert time.monotonic() - started < 2.0
            assert limiter.used_fallback >= 2
            assert store.degraded
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        await asyncio.sleep(0.5)
        # Back on the shared bucket, which still holds only 40 tokens.
        with pytest.raises(ResourceExhaustedError):
            await limiter.acquire("tenant-tokens", tokens=60)
        assert not store.degraded
        await limiter.acquire("tenant-tokens", tokens=30)
        await store.close()

    asyncio.run(scenario())


def _record(engine_id: str, port: int) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, address=f"127.0.0.1:{port}", model="m", num_blocks=8)


def test_registry_join_leave_and_degraded(redis_server: LocalRedisServer) -> None:
    async def scenario() -> None:
        engine_store = _store(redis_server)
        router_store = _store(redis_server)
        registry = EngineRegistry(router_store, poll_interval_s=0.1)
        changes = []
        registry.add_listener(changes.append)
        await registry.start()
        assert registry.engines() == {}
        first = EngineRegistration(engine_store, lambda: _record("e1", 1111), ttl_s=1.0)
        second = EngineRegistration(engine_store, lambda: _record("e2", 2222), ttl_s=1.0)
        await first.start()
        await second.start()
        assert await registry.wait_until(lambda view: set(view) == {"e1", "e2"}, 3.0)
        assert registry.engines()["e1"].address == "127.0.0.1:1111"
        # e1 stops refreshing without deregistering (a crash): gone within the TTL (+ a poll).
        await first.stop(deregister=False)
        stopped = time.monotonic()
        assert await registry.wait_until(lambda view: set(view) == {"e2"}, 3.0)
        assert time.monotonic() - stopped < 1.0 + 0.5
        assert any(record.engine_id == "e1" for change in changes for record in change.left)
        # Redis frozen: the watcher keeps its last view and reports degraded within its timeout.
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            while not registry.degraded and time.monotonic() - frozen < 3.0:
                await asyncio.sleep(0.05)
            assert registry.degraded
            assert time.monotonic() - frozen < 0.1 + 0.3 + 0.5
            await asyncio.sleep(1.5)  # longer than the TTL: the view must not empty itself
            assert set(registry.engines()) == {"e2"}
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        # Resumes on its own: degraded clears, e2's refresher re-publishes, e3 can join.
        third = EngineRegistration(engine_store, lambda: _record("e3", 3333), ttl_s=1.0)
        await third.start()
        assert await registry.wait_until(lambda view: set(view) == {"e2", "e3"}, 5.0)
        assert not registry.degraded
        # A clean exit deregisters at once.
        await third.stop()
        assert await registry.wait_until(lambda view: set(view) == {"e2"}, 0.5)
        await second.stop()
        await registry.stop()
        await engine_store.close()
        await router_store.close()

    asyncio.run(scenario())


def test_store_calls_fail_fast_while_paused(redis_server: LocalRedisServer) -> None:
    async def scenario() -> None:
        store = _store(redis_server, timeout_s=0.2)
        transitions: list[bool] = []
        store.add_health_listener(transitions.append)
        await store.set("sluice:test:b", "x")
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                await store.get("sluice:test:b")
            assert time.monotonic() - started < 0.6
            assert store.degraded
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 3
        while store.degraded and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the background probe clears it without any traffic
        assert not store.degraded
        assert transitions == [True, False]
        assert await store.get("sluice:test:b") == b"x"
        await store.close()

    asyncio.run(scenario())


def test_redis_for_stack_starts_a_private_server_or_uses_the_url() -> None:
    assert redis_for_stack("redis://example:1/0") == ("redis://example:1/0", None)
    url, server = redis_for_stack(None)
    assert server is not None and url == server.url and ":" + server.password + "@" in url
    try:

        async def ping() -> bool:
            store = open_store(StoreConfig(redis_url=url))
            try:
                return await store.ping()
            finally:
                await store.close()

        assert asyncio.run(ping())
    finally:
        server.stop()
    assert not server.running() and not server.directory.exists()


def _make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    key, csr, cert = directory / "redis.key", directory / "redis.csr", directory / "redis.crt"
    extensions = directory / "san.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=sluice-test-ca", "-keyout", str(ca_key), "-out", str(ca_cert))  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(key), "-out", str(csr))  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(extensions),
            "-out", str(cert))  # fmt: skip
    return ca_cert, cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_rediss_url_with_ca(tmp_path: Path) -> None:
    ca_file, cert_file, key_file = _make_tls_files(tmp_path)
    server = start_redis_server(tls_files=(ca_file, cert_file, key_file))
    try:
        assert server.url.startswith("rediss://")

        async def scenario() -> None:
            store = open_store(StoreConfig(redis_url=server.url, redis_tls_ca_file=str(ca_file)))
            assert await store.ping()
            await store.set("sluice:tls", "ok")
            assert await store.get("sluice:tls") == b"ok"
            await store.close()
            # The plain-text protocol is refused on the TLS port.
            plain = open_store(StoreConfig(redis_url=server.url.replace("rediss://", "redis://")))
            with pytest.raises(StoreUnavailableError):
                await plain.ping()
            await plain.close()

        asyncio.run(scenario())
    finally:
        server.stop()
