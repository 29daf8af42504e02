"""Children tie themselves to their launcher: the environment names it, the child arms it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from services.common import processes

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)

_ARM_AND_REPORT = """
import ctypes, os
from services.common.processes import exit_with_parent
exit_with_parent()
signal_number = ctypes.c_int()
ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(signal_number))  # PR_GET_PDEATHSIG
print(signal_number.value, os.environ.get("SLUICE_PARENT_PID"), flush=True)
"""


def test_the_main_thread_names_this_process_and_a_worker_thread_names_none() -> None:
    assert processes.tied_env({"SLUICE_PARENT_PID": "1", "X": "y"}) == {
        "SLUICE_PARENT_PID": str(os.getpid()),
        "X": "y",
    }
    from_worker: list[dict[str, str]] = []
    worker = threading.Thread(target=lambda: from_worker.append(processes.tied_env({"X": "y"})))
    worker.start()
    worker.join()
    assert from_worker == [{"X": "y"}]


@linux_only
def test_a_tied_child_arms_sigterm_and_hides_the_variable_from_its_own_children() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _ARM_AND_REPORT],
        env=processes.tied_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split() == [str(int(signal.SIGTERM)), "None"]


@linux_only
def test_a_child_whose_parent_is_already_gone_ends_at_once() -> None:
    env = dict(os.environ, SLUICE_PARENT_PID="1")  # not its parent: that one "died" already
    result = subprocess.run(
        [sys.executable, "-c", _ARM_AND_REPORT], env=env, capture_output=True, timeout=60
    )
    assert result.returncode == -signal.SIGTERM
    assert result.stdout == b""


def test_an_untied_child_arms_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_PARENT_PID"}
    result = subprocess.run(
        [sys.executable, "-c", _ARM_AND_REPORT], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    assert result.stdout.split()[0] == "0"


@linux_only
def test_the_wrapper_ties_a_program_and_becomes_it() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.common.processes",
            "sh",
            "-c",
            "echo $$; cat /proc/$$/comm",
        ],
        env=processes.tied_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pid, name = result.stdout.split()
    assert name == "sh" and int(pid) > 0  # the same process, now running the program


def test_the_wrapper_without_a_program_says_how_to_use_it() -> None:
    assert processes.main([]) == 2
