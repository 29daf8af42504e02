"""`sluice up` in its default mode: engines as Ray actors, a private redis-server, one router.

It serves, the router finds the engines through the Redis registry, and SIGTERM stops every
process it started (Ray's own processes and redis-server included) with exit code 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from services.client import SluiceClient
from services.common.redis_server import find_redis_server
from tests.integration.processes import cmdline, descendants, start_sluice_up, wait_until_gone

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]


def test_sluice_up_with_ray_and_redis_serves_then_stops_everything() -> None:
    process, port = start_sluice_up()
    started: list[int] = []
    try:
        ready = process.stdout.readline()
        assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
        started = descendants(process.pid)
        commands = [cmdline(pid) for pid in started]
        assert any("redis-server" in command for command in commands)
        assert any("raylet" in command for command in commands)
        assert any("--redis-url" in command and "router" in command for command in commands)
        with SluiceClient(f"127.0.0.1:{port}", timeout_s=60.0) as client:
            completion = client.complete("Hello", max_tokens=5, temperature=0.0, ignore_eos=True)
        assert completion.completion_tokens == 5
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        assert not [cmdline(pid) for pid in wait_until_gone(started, timeout_s=20)]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
