"""`sluice up` in its default mode: engines as Ray actors, a private redis-server, one router.

It serves, the router finds the engines through the Redis registry, and SIGTERM stops every
process it started (Ray's own processes and redis-server included) with exit code 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from services.client import SluiceClient
from services.common.redis_server import find_redis_server
from services.launcher import free_port
from tests.integration.test_stack_up import child_pids, pid_alive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]


def _descendants(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        children = child_pids(pending.pop())
        found += children
        pending += children
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sluice_up_with_ray_and_redis_serves_then_stops_everything() -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            str(port),
            "--model",
            "dummy:tiny",
            "--engines",
            "2",
            "--kv-cache-bytes",
            str(8 * 1024 * 1024),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    descendants: list[int] = []
    try:
        ready = process.stdout.readline()
        assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
        descendants = _descendants(process.pid)
        commands = [_cmdline(pid) for pid in descendants]
        assert any("redis-server" in command for command in commands)
        assert any("raylet" in command for command in commands)
        assert any("--redis-url" in command and "router" in command for command in commands)
        with SluiceClient(f"127.0.0.1:{port}", timeout=60.0) as client:
            completion = client.complete("Hello", max_tokens=5, temperature=0.0, ignore_eos=True)
        assert completion.completion_tokens == 5
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        deadline = time.monotonic() + 20
        while any(pid_alive(pid) for pid in descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [_cmdline(pid) for pid in descendants if pid_alive(pid)]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
