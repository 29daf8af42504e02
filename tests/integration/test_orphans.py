"""A private redis-server never outlives the process that started it, even one killed -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from services.common.redis_server import find_redis_server

_STARTER = """
import sys, time
from services.common.redis_server import start_redis_server
server = start_redis_server()
print(server.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie counts as gone
        return stat.read().split()[2] != "Z"


@pytest.mark.skipif(find_redis_server() is None, reason="redis-server is not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_private_redis_dies_with_a_killed_starter() -> None:
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], stdout=subprocess.PIPE, text=True)
    try:
        redis_pid = int(starter.stdout.readline())
        assert _alive(redis_pid)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(redis_pid), "redis-server outlived the process that started it"
    finally:
        starter.kill()
