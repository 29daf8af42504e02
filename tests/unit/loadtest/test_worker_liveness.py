"""The load generator tells a worker that died from one that finished and exited."""

from __future__ import annotations

import queue

import pytest

from loadtest.workers import _next_message
from services.common.errors import UnavailableError


class _Messages:
    """A queue that is empty for `silent` gets, then hands out one message."""

    def __init__(self, silent: int) -> None:
        self.silent = silent

    def get(self, timeout: float) -> tuple[str, int, str]:
        if self.silent:
            self.silent -= 1
            raise queue.Empty
        return ("records", 0, "[]")

    def empty(self) -> bool:
        return self.silent > 0


class _Process:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_a_worker_that_sent_its_records_may_exit_while_others_run() -> None:
    processes = [_Process(alive=True), _Process(alive=False)]
    assert _next_message(_Messages(silent=2), processes, finished={1}) == ("records", 0, "[]")


def test_a_worker_gone_before_its_records_fails_the_run() -> None:
    processes = [_Process(alive=True), _Process(alive=False)]
    with pytest.raises(UnavailableError, match="died"):
        _next_message(_Messages(silent=2), processes, finished=set())
