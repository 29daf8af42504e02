"""The stack bench's load generator lowers its own CPU priority, and only its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import json, os, threading
from benchmarks.stack_bench_load import lower_priority
applied = lower_priority()
seen = {}
thread = threading.Thread(target=lambda: seen.update(nice=os.nice(0)))  # started afterwards
thread.start(); thread.join()
print(json.dumps({"applied": applied, "thread": seen["nice"], "main": os.nice(0)}))
"""


def _run(start_new_session: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=start_new_session,
        cwd=Path(__file__).resolve().parents[3],
    ).stdout
    return json.loads(out)


def test_low_priority_is_nice_19_for_the_process_and_the_threads_it_starts_later() -> None:
    before = os.nice(0)
    autogroup = Path("/proc/self/autogroup")
    group_before = autogroup.read_text() if autogroup.exists() else None
    seen = _run(start_new_session=True)
    assert seen["applied"]["nice"] == seen["main"] == seen["thread"] == 19
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    if group_before is not None and enabled.exists() and enabled.read_text().strip() == "1":
        assert seen["applied"]["autogroup_nice"] == 19  # its own session's group
    assert os.nice(0) == before  # this process is untouched, and so is its group
    assert (autogroup.read_text() if autogroup.exists() else None) == group_before


def test_outside_a_session_of_its_own_the_callers_autogroup_is_left_alone() -> None:
    seen = _run(start_new_session=False)
    assert seen["applied"]["nice"] == 19
    assert seen["applied"]["autogroup_nice"] is None


@pytest.mark.parametrize(
    "argv",
    [["bogus", "x", "{}", "low"], ["router", "x", "{}", "high"], ["router"],
     ["engine", "x", "{}", "low"]],  # the engine side needs its prompt ids
)  # fmt: skip
def test_bad_arguments_exit_2_with_the_usage(argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.stack_bench_load", *argv],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert result.returncode == 2 and "usage:" in result.stderr
