"""The supervisor's restart policy: backoff, restarts on the same child, crash loops."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.supervisor import CHILD_RESTARTS, CrashLoopError, RestartPolicy, Supervisor
from tests.fake_clock import FakeClock


class FakeChild:
    """A child that is alive until `crash()`; `restart()` brings it back (or fails)."""

    def __init__(self) -> None:
        self.running = True
        self.starts = 0
        self.fail_next_starts = 0

    def crash(self) -> None:
        self.running = False

    def restart(self) -> None:
        if self.fail_next_starts:
            self.fail_next_starts -= 1
            raise OSError("address already in use")
        self.starts += 1
        self.running = True


def supervised(policy: RestartPolicy) -> tuple[Supervisor, FakeChild, FakeClock, list[str]]:
    clock, child, said = FakeClock(1000.0), FakeChild(), []
    supervisor = Supervisor(policy, announce=said.append, clock=clock)
    supervisor.watch(
        "tokenizer",
        alive=lambda: child.running,
        exit_code=lambda: None if child.running else -9,
        restart=child.restart,
    )
    return supervisor, child, clock, said


def test_backoff_doubles_and_is_capped() -> None:
    policy = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_crashed_child_is_restarted_after_its_backoff() -> None:
    supervisor, child, clock, said = supervised(RestartPolicy(backoff_initial_s=1.0))
    before = CHILD_RESTARTS.labels(child="tokenizer")._value.get()
    supervisor.poll()
    assert child.starts == 0 and not said
    child.crash()
    supervisor.poll()
    assert supervisor.pending() == ["tokenizer"]
    assert "exited unexpectedly with code -9" in said[-1] and "1.0 s" in said[-1]
    clock.now += 0.5
    supervisor.poll()
    assert child.starts == 0  # backoff not over
    clock.now += 0.6
    supervisor.poll()
    assert child.starts == 1 and child.running
    assert supervisor.restarts("tokenizer") == 1 and supervisor.pending() == []
    assert CHILD_RESTARTS.labels(child="tokenizer")._value.get() == before + 1
    assert "restarted" in said[-1]


def test_crash_loop_raises_with_a_clear_message() -> None:
    policy = RestartPolicy(max_crashes=3, crash_window_s=60.0, backoff_initial_s=0.1)
    supervisor, child, clock, _ = supervised(policy)
    for _ in range(2):
        child.crash()
        supervisor.poll()
        clock.now += 1.0
        supervisor.poll()
        assert child.running
    child.crash()
    with pytest.raises(CrashLoopError, match=r"tokenizer .*crashed 3 times within 60 s"):
        supervisor.poll()


def test_crashes_outside_the_window_are_forgotten() -> None:
    policy = RestartPolicy(max_crashes=2, crash_window_s=10.0, backoff_initial_s=0.1)
    supervisor, child, clock, _ = supervised(policy)
    for _ in range(4):  # one crash every 20 s never makes two within 10 s
        child.crash()
        supervisor.poll()
        clock.now += 20.0
        supervisor.poll()
    assert child.starts == 4


def test_failed_restart_counts_as_a_crash_and_is_retried() -> None:
    policy = RestartPolicy(max_crashes=5, backoff_initial_s=1.0, backoff_max_s=8.0)
    supervisor, child, clock, said = supervised(policy)
    child.fail_next_starts = 1
    child.crash()
    supervisor.poll()
    clock.now += 1.0
    supervisor.poll()  # the restart fails: a second crash, backoff doubles
    assert child.starts == 0 and "could not be restarted" in said[-1] and "2.0 s" in said[-1]
    clock.now += 2.0
    supervisor.poll()
    assert child.starts == 1 and child.running


def test_policy_validation() -> None:
    with pytest.raises(InvalidArgumentError):
        RestartPolicy(max_crashes=0)
    with pytest.raises(InvalidArgumentError):
        RestartPolicy(backoff_initial_s=5.0, backoff_max_s=1.0)
    supervisor, _, _, _ = supervised(RestartPolicy())
    with pytest.raises(InvalidArgumentError):
        supervisor.watch("tokenizer", alive=bool, exit_code=lambda: 0, restart=lambda: None)
