"""`sluice up` survives kill -9 of any one child: the child is restarted on its port, only the
requests that were on it fail (UNAVAILABLE), and a crash loop stops the stack cleanly.

Runs `sluice up --no-ray --no-redis` as a user does, with the `dummy:tiny` model and two engines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO

import grpc
import pytest

from services.client import SluiceClient
from services.common.ports import free_port
from tests.integration.processes import (
    TINY_UP_ARGS,
    child_pids,
    cmdline,
    pid_alive,
    wait_until_gone,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

RECOVERY_GOAL_S = 5.0  # requests succeed again this soon after a kill -9


def start_up(stderr: IO[str], *extra: str) -> tuple[subprocess.Popen[str], int]:
    """`sluice up` on a free port; its (and its children's) log goes to the file `stderr`."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), *TINY_UP_ARGS, *extra],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    ready = process.stdout.readline()
    assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
    return process, port


def child_pid(launcher: subprocess.Popen[str], role: str) -> int:
    """The pid of the launcher's child that serves `role` (e.g. "serve tokenizer")."""
    for pid in child_pids(launcher.pid):
        if role in cmdline(pid):
            return pid
    raise AssertionError(f"no child runs {role!r}")


def kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def seconds_until_served(address: str, limit_s: float = 30.0) -> float:
    """Send short requests until one succeeds; how long that took."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            with SluiceClient(address, timeout_s=5.0) as client:
                done = client.complete("Hi", max_tokens=2, temperature=0.0, ignore_eos=True)
            if done.completion_tokens == 2:
                return time.monotonic() - start
        except grpc.RpcError:
            time.sleep(0.1)
    raise AssertionError(f"no request succeeded within {limit_s} s")


class Streams:
    """A few long streams in threads; each ends complete or with one status code."""

    def __init__(self, address: str, count: int, max_tokens: int = 1500) -> None:
        self.started = threading.Barrier(count + 1)
        self.outcomes: list[str] = []
        self._threads = [
            threading.Thread(target=self._run, args=(address, max_tokens), daemon=True)
            for _ in range(count)
        ]
        for thread in self._threads:
            thread.start()
        self.started.wait(timeout=60)

    def _run(self, address: str, max_tokens: int) -> None:
        try:
            with SluiceClient(address, timeout_s=120.0) as client:
                stream = client.generate(
                    "Count:", max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                )
                first = True
                tokens = 0
                for response in stream:
                    tokens += len(response.token_ids)
                    if first:
                        first = False
                        self.started.wait(timeout=60)
                self.outcomes.append("ok" if tokens == max_tokens else f"short:{tokens}")
        except grpc.RpcError as exc:
            self.outcomes.append(exc.code().name)

    def join(self) -> list[str]:
        for thread in self._threads:
            thread.join(timeout=120)
        return sorted(self.outcomes)


def restarts_metric(metrics_port: int, child: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith(f'sluice_child_restarts_total{{child="{child}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_each_child_killed_is_restarted_and_only_its_requests_fail(tmp_path: Path) -> None:
    metrics_port = free_port()
    log = (tmp_path / "up.log").open("w")
    launcher, port = start_up(log, "--no-ray", "--no-redis", "--metrics-port", str(metrics_port))
    address = f"127.0.0.1:{port}"
    try:
        # The tokenizer holds every stream's text state: all in-flight streams end UNAVAILABLE.
        streams = Streams(address, 3)
        kill_and_wait(child_pid(launcher, "serve tokenizer"))
        assert streams.join() == ["UNAVAILABLE"] * 3
        assert seconds_until_served(address) < RECOVERY_GOAL_S
        assert restarts_metric(metrics_port, "tokenizer") == 1.0

        # One of two engines: the streams on it fail, the others finish.
        streams = Streams(address, 4)
        kill_and_wait(child_pid(launcher, "serve engine"))
        outcomes = streams.join()
        assert set(outcomes) <= {"ok", "UNAVAILABLE"} and "UNAVAILABLE" in outcomes, outcomes
        assert seconds_until_served(address) < RECOVERY_GOAL_S

        # The router: its clients reconnect to the same port.
        kill_and_wait(child_pid(launcher, "serve router"))
        assert seconds_until_served(address) < RECOVERY_GOAL_S
        assert launcher.poll() is None  # the stack never shut itself down
        assert restarts_metric(metrics_port, "router") == 1.0
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0


def test_a_crash_loop_stops_the_stack_with_a_clear_message(tmp_path: Path) -> None:
    log_path = tmp_path / "up.log"
    launcher, _ = start_up(
        log_path.open("w"), "--no-ray", "--no-redis", "--metrics-port", "0", "--max-crashes", "2"
    )
    try:
        children = child_pids(launcher.pid)
        first = child_pid(launcher, "serve tokenizer")
        kill_and_wait(first)
        deadline = time.monotonic() + 30
        second = first
        while second == first and time.monotonic() < deadline:  # wait for the restart
            time.sleep(0.1)
            try:
                second = child_pid(launcher, "serve tokenizer")
            except AssertionError:
                continue
        assert second != first
        kill_and_wait(second)
        assert launcher.wait(timeout=60) == 1
        said = log_path.read_text()
        assert "crash loop" in said and "tokenizer" in said
        assert not wait_until_gone(children, timeout_s=10)  # the rest of the stack stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_with_two_tokenizers_one_lost_fails_only_its_streams(tmp_path: Path) -> None:
    log = (tmp_path / "up.log").open("w")
    launcher, port = start_up(
        log, "--no-ray", "--no-redis", "--metrics-port", "0", "--tokenizers", "2"
    )
    address = f"127.0.0.1:{port}"
    try:
        tokenizers = [pid for pid in child_pids(launcher.pid) if "serve tokenizer" in cmdline(pid)]
        assert len(tokenizers) == 2
        streams = Streams(address, 6)
        kill_and_wait(tokenizers[0])
        outcomes = streams.join()
        # Streams are pinned round robin, three on each replica: only the ones on the lost
        # replica may fail (one may have finished before the kill), the others finish.
        assert set(outcomes) <= {"ok", "UNAVAILABLE"}, outcomes
        assert 1 <= outcomes.count("UNAVAILABLE") <= 3 and outcomes.count("ok") >= 3, outcomes
        # The other replica serves new requests at once, while the lost one restarts.
        assert seconds_until_served(address) < 1.0
        assert launcher.poll() is None
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
