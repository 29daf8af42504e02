"""A private redis-server never outlives the process that started it, even one killed -9."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from services.common.redis_server import find_redis_server
from tests.integration.processes import pid_alive, wait_until_gone

_STARTER = """
import sys, time
from services.common.redis_server import start_redis_server
server = start_redis_server()
print(server.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(find_redis_server() is None, reason="redis-server is not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_private_redis_dies_with_a_killed_starter() -> None:
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], stdout=subprocess.PIPE, text=True)
    try:
        redis_pid = int(starter.stdout.readline())
        assert pid_alive(redis_pid)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        assert not wait_until_gone([redis_pid], timeout_s=10), (
            "redis-server outlived the process that started it"
        )
    finally:
        starter.kill()
