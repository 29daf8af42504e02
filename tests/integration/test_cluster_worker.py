"""A standalone registered engine (`python -m services.engine.worker`, no Ray) and a real Redis:
it appears in the registry with its capacity once ready and leaves it on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from services.common.redis_server import LocalRedisServer, find_redis_server, start_redis_server
from services.common.redis_store import StoreConfig, open_store
from services.router.registry import EngineRegistry

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]


@pytest.fixture
def redis_server() -> Iterator[LocalRedisServer]:
    server = start_redis_server()
    yield server
    server.stop()


async def _view(url: str) -> dict:
    store = open_store(StoreConfig(redis_url=url))
    registry = EngineRegistry(store)
    try:
        await registry.poll()
        return registry.engines()
    finally:
        await store.close()


def test_standalone_worker_registers_and_deregisters(redis_server: LocalRedisServer) -> None:
    process = subprocess.Popen(
        [
            sys.executable, "-m", "services.engine.worker",
            "--model", "dummy:tiny", "--device", "cpu", "--port", "0",
            "--kv-cache-bytes", str(8 * 1024 * 1024),
            "--redis-url", redis_server.url, "--engine-id", "solo",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "engine solo ready at 127.0.0.1:" in line, line
        address = line.rsplit(" ", 1)[-1].strip()
        view = asyncio.run(_view(redis_server.url))
        assert view["solo"].address == address
        assert view["solo"].model == "dummy:tiny" and view["solo"].num_blocks > 0
        assert view["solo"].pid == process.pid
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert asyncio.run(_view(redis_server.url)) == {}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
