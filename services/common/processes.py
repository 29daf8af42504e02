"""Child processes that must not outlive the process that started them.

On Linux a process can ask for a signal when its parent dies (`prctl(PR_SET_PDEATHSIG)`), which
covers a launcher killed with SIGKILL: it gets no chance to stop its children. The child has to
ask for itself. Asking from Popen's `preexec_fn`, between fork and exec, is what this module
used to do, and it can hang: with a `preexec_fn` Python must fork() (not vfork()), fork() runs
every library's pthread_atfork handlers, and gRPC's can block (a test's stack start hung in it
for good: fork → grpc's cygrpc → futex). So nothing runs between fork and exec any more
(Python then uses vfork, which runs no handlers); instead the parent names itself in the
child's environment (`tied_env`) and the child arms the signal first thing
(`exit_with_parent`): `sluice serve ...` in services/cli.py, and, for programs that cannot,
this module as a wrapper that arms it and then execs them:

    python -m services.common.processes redis-server /path/to/redis.conf

Elsewhere than Linux nothing is armed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence

PARENT_ENV = "SLUICE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def tied_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that should get SIGTERM when this process dies.

    Linux sends the signal when the *thread* that started the child ends, so only the main
    thread ties children (one started from a worker thread would die with that thread).
    """
    env = dict(os.environ if base is None else base)
    env.pop(PARENT_ENV, None)
    if threading.current_thread() is threading.main_thread():
        env[PARENT_ENV] = str(os.getpid())
    return env


def exit_with_parent() -> None:
    """In a child started with `tied_env`: SIGTERM when the parent dies; exit if it already has.

    Reads (and removes, so its own children do not inherit it) SLUICE_PARENT_PID; without it,
    or off Linux, does nothing.
    """
    raw = os.environ.pop(PARENT_ENV, None)
    if raw is None or not sys.platform.startswith("linux"):
        return
    try:
        parent = int(raw)
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, ValueError):
        return
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str]) -> int:
    """`python -m services.common.processes PROGRAM [ARGS...]`: tie, then become PROGRAM."""
    if not argv:
        print("usage: python -m services.common.processes PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    exit_with_parent()
    os.execvp(argv[0], list(argv))
    return 1  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
