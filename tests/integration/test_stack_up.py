"""`sluice up` as a user runs it, and the launcher's handling of a child that dies.

Uses the `dummy:tiny` model (random weights, the default tokenizer) so start-up is quick.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.client import SluiceClient
from services.launcher import Stack, wait_until_serving
from tests.integration.processes import child_pids, start_sluice_up, wait_until_gone

TINY_ENGINE_ARGS = ("--kv-cache-bytes", str(8 * 1024 * 1024))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sluice_up_serves_then_stops_everything_on_sigterm() -> None:
    process, port = start_sluice_up(
        "--no-ray",  # plain processes: the Ray + Redis stack is test_cluster_stack.py's
        "--no-redis",
        # durations name their unit: the launcher's own, one passed on to the router, and
        # the engines' through --engine-args
        *("--startup-timeout-s", "300", "--stop-grace-s", "20", "--shutdown-grace-s", "5"),
        "--engine-args=--shutdown-grace-s 2 --load-report-interval-s 0.5",
    )
    try:
        ready = process.stdout.readline()  # blocks until ready (or the launcher exits)
        assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
        children = child_pids(process.pid)
        assert len(children) == 4  # tokenizer, two engines, router
        with SluiceClient(f"127.0.0.1:{port}", timeout_s=60.0) as client:
            completion = client.complete("Hello", max_tokens=5, temperature=0.0, ignore_eos=True)
            models = client.list_models()
        assert completion.completion_tokens == 5
        assert models[0].name == "dummy:tiny"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert not wait_until_gone(children, timeout_s=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_launcher_restarts_a_child_that_dies_on_its_port(stack_factory) -> None:  # noqa: ANN001
    stack: Stack = stack_factory(model="dummy:tiny", engine_args=TINY_ENGINE_ARGS)
    victim = stack.engines[0]
    address, pid = victim.address, victim.process.pid
    lines: list[str] = []
    supervisor = stack.supervisor(lines.append)
    os.kill(pid, signal.SIGKILL)
    victim.process.wait()
    deadline = time.monotonic() + 30
    while supervisor.restarts("engine-0") == 0 and time.monotonic() < deadline:
        supervisor.poll()
        time.sleep(0.05)
    assert "engine-0" in lines[0] and "exited unexpectedly" in lines[0] and "-9" in lines[0]
    assert "restarted" in lines[1]
    assert victim.alive() and victim.process.pid != pid and victim.address == address
    assert all(child.alive() for child in stack.children)
    wait_until_serving(victim, time.monotonic() + 60)  # same port, serving again


def test_bad_model_fails_before_starting_children(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            "0",
            "--model",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: NOT_FOUND: ")


def test_terminate_kills_a_child_that_ignores_sigterm() -> None:
    from services.launcher import ChildProcess, terminate

    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stubborn.stdout.readline().strip() == "ready"
    started = time.monotonic()
    terminate([ChildProcess("stubborn", "127.0.0.1:1", stubborn)], grace_s=0.5)
    assert stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10


def test_a_child_failing_to_start_is_named_and_the_rest_stopped(tmp_path: Path) -> None:
    from services.common.errors import UnavailableError
    from services.launcher import StackConfig

    stack = Stack(
        StackConfig(
            model="dummy:tiny",
            port=0,
            engine_args=("--block-size", "3"),
            log_dir=tmp_path,
            startup_timeout_s=300,
        )
    )
    with pytest.raises(UnavailableError, match="engine-0 exited with code") as caught:
        stack.start()
    assert "block_size must be a power of two" in str(caught.value)  # the child's log tail
    assert stack.router is None
    assert all(not child.alive() for child in stack.children)
