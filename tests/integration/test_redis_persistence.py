"""The private redis-server's append-only file: state survives a kill -9, a new server and a
restart of the whole stack."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from benchmarks.faults import key_works, make_key
from services.common.errors import FailedPreconditionError
from services.common.redis_server import (
    LocalRedisServer,
    find_redis_server,
    redis_for_stack,
    start_redis_server,
)
from services.common.redis_store import StoreConfig, open_store

pytestmark = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")

# appendfsync everysec: a write is on disk within about a second.
FSYNC_WAIT_S = 1.5


def _set(url: str, key: str, value: str) -> None:
    async def scenario() -> None:
        store = open_store(StoreConfig(redis_url=url))
        try:
            await store.set(key, value)
        finally:
            await store.close()

    asyncio.run(scenario())


def _get(url: str, key: str) -> bytes | None:
    async def scenario() -> bytes | None:
        store = open_store(StoreConfig(redis_url=url))
        try:
            return await store.get(key)
        finally:
            await store.close()

    return asyncio.run(scenario())


def _kill(server: LocalRedisServer) -> None:
    # The wrapper execs redis-server, so the child's pid is the server's.
    os.kill(server.pid, signal.SIGKILL)
    server.process.wait(5)


def test_kill_restart_and_new_server_keep_the_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    server = start_redis_server(data_dir=data_dir)
    try:
        assert server.persistent
        _set(server.url, "sluice:test:persist", "kept")
        time.sleep(FSYNC_WAIT_S)
        _kill(server)
        assert not server.running()
        url_before = server.url
        server.restart()
        assert server.url == url_before  # same port and password: clients reconnect unchanged
        assert _get(server.url, "sluice:test:persist") == b"kept"
    finally:
        server.stop()
    assert data_dir.is_dir()  # a persistent directory outlives the server
    again = start_redis_server(data_dir=data_dir)
    try:
        assert _get(again.url, "sluice:test:persist") == b"kept"
    finally:
        again.stop()


def test_a_directory_in_use_is_refused_and_the_stack_falls_back(tmp_path: Path) -> None:
    data_dir = tmp_path / "redis"
    first = start_redis_server(data_dir=data_dir)
    try:
        with pytest.raises(FailedPreconditionError, match="in use"):
            start_redis_server(data_dir=data_dir)
        url, second = redis_for_stack(None, data_dir)
        assert second is not None and not second.persistent and url == second.url
        second.stop()
        assert not second.directory.exists()
    finally:
        first.stop()
    reused = start_redis_server(data_dir=data_dir)  # the lock went with the first server
    reused.stop()


def test_restart_refuses_a_running_server(tmp_path: Path) -> None:
    server = start_redis_server(data_dir=tmp_path / "redis")
    try:
        with pytest.raises(FailedPreconditionError, match="still running"):
            server.restart()
    finally:
        server.stop()


@pytest.mark.slow
def test_api_keys_survive_a_restart_of_the_whole_stack(stack_factory, tmp_path: Path) -> None:  # noqa: ANN001
    overrides = {
        "model": "dummy:tiny",
        "shared_state": True,
        "redis_data_dir": tmp_path / "redis",
        "router_args": ("--redis-api-keys",),
        "engine_args": ("--kv-cache-bytes", str(8 * 1024 * 1024)),
    }
    first = stack_factory(**overrides)
    key = make_key(first.redis_url)
    assert key_works(first.router_address, key)
    assert not key_works(first.router_address, key + "x", wait_s=0)  # keys are really checked
    first.stop()
    second = stack_factory(**overrides)
    assert second.redis_url != first.redis_url  # a new server, the same files
    assert key_works(second.router_address, key)
