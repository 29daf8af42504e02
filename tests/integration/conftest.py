"""Fixtures that start the real Sluice stack (separate processes on loopback) for integration tests.

- `stack` (session scope): tokenizer + one engine + router on free ports, default model
  (SmolLM2-135M-Instruct), a small KV cache. Shared by every integration test module, so the
  model is loaded once per test session. Tests must leave it healthy (don't kill its processes;
  use `stack_factory` for that).
- `router_address`, `client`: the shared stack's router address and a SluiceClient to it.
- `stack_factory` (function scope): `stack_factory(**StackConfig overrides)` starts a private
  stack (e.g. with `router_args=("--max-queued-requests", "2")`, or one to SIGTERM); every stack
  it started is stopped when the test ends.
Both run engines as plain processes without Redis (fast, and what most tests need); the
cluster tests (test_cluster_stack.py, test_cluster_up.py) start their own Ray + Redis stack once
per module with `StackConfig(ray=True, shared_state=True)`.
Child logs go to a temporary directory; a start-up failure shows the failing child's log tail.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from services.common.redis_server import LocalRedisServer, start_redis_server
from services.launcher import Stack, StackConfig

# 128 MiB of float32 KV for SmolLM2-135M is ~180 blocks of 16 tokens: small, but room for
# dozens of short concurrent streams.
SMALL_KV_CACHE_BYTES = 128 * 1024 * 1024
STACK_STARTUP_TIMEOUT_S = 600.0


def default_stack_config(log_dir: Any, **overrides: Any) -> StackConfig:
    """The shared stack's configuration; `overrides` are StackConfig fields."""
    config = StackConfig(
        model=None,
        port=0,
        engines=1,
        engine_args=("--kv-cache-bytes", str(SMALL_KV_CACHE_BYTES), "--max-num-seqs", "64"),
        # The tests send bursts (50 streams at once) to check what happens to them, not
        # admission: on a busy 2-core machine the router's estimate of their wait can pass the
        # default 3 s, so the shared stack admits up to a minute of queueing (admission has
        # its own stacks: test_router_admission.py).
        router_args=("--max-queue-delay-s", "60"),
        startup_timeout_s=STACK_STARTUP_TIMEOUT_S,
        stop_grace_s=10.0,
        log_dir=log_dir,
    )
    return replace(config, **overrides)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(default_stack_config(tmp_path_factory.mktemp("stack-logs")))
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def router_address(stack: Stack) -> str:
    return stack.router_address


@pytest.fixture
def client(router_address: str) -> Iterator[Any]:
    from services.client import SluiceClient

    with SluiceClient(router_address, timeout_s=120.0) as sluice_client:
        yield sluice_client


@pytest.fixture
def stack_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Stack]]:
    started: list[Stack] = []

    def start(**overrides: Any) -> Stack:
        log_dir = tmp_path_factory.mktemp("private-stack-logs")
        private = Stack(default_stack_config(log_dir, **overrides))
        started.append(private)
        return private.start()

    try:
        yield start
    finally:
        for private in reversed(started):
            private.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedisServer]:
    """A private redis-server per test module; resumed (SIGCONT) before stopping, in case a test
    paused it to simulate an outage."""
    server = start_redis_server()
    yield server
    os.kill(server.pid, signal.SIGCONT)
    server.stop()
