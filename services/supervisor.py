"""Keeps `sluice up`'s children running: restart on a crash, stop only on a crash loop.

`sluice up` starts a tokenizer (or several), engines (as processes under --no-ray), a router
and a private redis-server. One crashed child must not be an outage, so the launcher hands each
child to a `Supervisor`, which it polls from its main loop:

- a child that exits unexpectedly is restarted after an exponential backoff
  (`backoff_initial_s`, doubling per recent crash, capped at `backoff_max_s`), on the same port,
  so its peers reconnect without new configuration;
- a restart that itself fails (the process cannot be started) counts as another crash;
- `max_crashes` crashes of one child within `crash_window_s` is a crash loop: `poll` raises
  `CrashLoopError` and the launcher stops the whole stack with that message and a non-zero exit.

Every restart is logged and counted in the Prometheus counter `sluice_child_restarts_total`
(label `child`), served by the launcher's metrics endpoint. Policy only: no processes here; the
launcher supplies, per child, how to tell it is alive and how to start it again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from services.common.errors import InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)

CHILD_RESTARTS = Counter(
    "sluice_child_restarts_total",
    "Children of `sluice up` restarted after they exited unexpectedly.",
    ["child"],
)


class CrashLoopError(UnavailableError):
    """One child crashed too often in too short a time: the stack stops."""


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a crashed child, and when to give up on it (and on the stack)."""

    max_crashes: int = 5  # this many crashes of one child within crash_window_s: a crash loop
    crash_window_s: float = 60.0
    backoff_initial_s: float = 0.5  # delay before the first restart; doubles per recent crash
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_crashes < 1:
            raise InvalidArgumentError(f"max_crashes must be >= 1, got {self.max_crashes}")
        if self.crash_window_s <= 0:
            raise InvalidArgumentError(f"crash_window_s must be > 0, got {self.crash_window_s}")
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise InvalidArgumentError(
                "need 0 <= backoff_initial_s <= backoff_max_s, got "
                f"{self.backoff_initial_s} and {self.backoff_max_s}"
            )

    def backoff_s(self, recent_crashes: int) -> float:
        """The delay before restarting a child that crashed `recent_crashes` times lately."""
        exponent = max(recent_crashes - 1, 0)
        return min(self.backoff_initial_s * (2**exponent), self.backoff_max_s)


@dataclass
class _Watched:
    name: str
    alive: Callable[[], bool]
    exit_code: Callable[[], int | None]
    restart: Callable[[], None]
    crashes: deque[float] = field(default_factory=deque)
    restart_at: float | None = None  # set while a restart is pending
    restarts: int = 0


class Supervisor:
    """Polls watched children; restarts the crashed ones; raises `CrashLoopError` on a loop."""

    def __init__(
        self,
        policy: RestartPolicy | None = None,
        *,
        announce: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self._announce = announce
        self._clock = clock
        self._watched: dict[str, _Watched] = {}

    def watch(
        self,
        name: str,
        *,
        alive: Callable[[], bool],
        exit_code: Callable[[], int | None],
        restart: Callable[[], None],
    ) -> None:
        """Supervise one child: `alive()` says whether it runs, `restart()` starts it again."""
        if name in self._watched:
            raise InvalidArgumentError(f"{name} is already supervised")
        self._watched[name] = _Watched(name, alive, exit_code, restart)

    def names(self) -> list[str]:
        """The supervised children's names."""
        return list(self._watched)

    def restarts(self, name: str) -> int:
        """How many times `name` was restarted so far."""
        return self._watched[name].restarts

    def pending(self) -> list[str]:
        """Children whose restart is scheduled but not yet done."""
        return [w.name for w in self._watched.values() if w.restart_at is not None]

    def poll(self) -> None:
        """One pass: note new crashes, run due restarts. Raises CrashLoopError on a loop."""
        now = self._clock()
        for watched in self._watched.values():
            if watched.restart_at is not None:
                if now >= watched.restart_at:
                    self._restart(watched, now)
                continue
            if not watched.alive():
                self._crashed(watched, now, f"exited unexpectedly with code {watched.exit_code()}")

    def _crashed(self, watched: _Watched, now: float, what: str) -> None:
        policy = self.policy
        watched.crashes.append(now)
        while watched.crashes and now - watched.crashes[0] > policy.crash_window_s:
            watched.crashes.popleft()
        recent = len(watched.crashes)
        if recent >= policy.max_crashes:
            raise CrashLoopError(
                f"{watched.name} {what}; it crashed {recent} times within "
                f"{policy.crash_window_s:g} s (a crash loop): stopping the stack"
            )
        delay_s = policy.backoff_s(recent)
        watched.restart_at = now + delay_s
        message = (
            f"sluice: {watched.name} {what}; restarting it in {delay_s:.1f} s "
            f"(crash {recent} of {policy.max_crashes} allowed within {policy.crash_window_s:g} s)"
        )
        log.warning(message)
        self._announce(message)

    def _restart(self, watched: _Watched, now: float) -> None:
        watched.restart_at = None
        try:
            watched.restart()
        except Exception as exc:  # noqa: BLE001 - a failed start is one more crash
            log.exception("restarting %s failed", watched.name)
            self._crashed(watched, now, f"could not be restarted ({exc})")
            return
        watched.restarts += 1
        CHILD_RESTARTS.labels(child=watched.name).inc()
        message = f"sluice: {watched.name} restarted (restart {watched.restarts})"
        log.info(message)
        self._announce(message)
