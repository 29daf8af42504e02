"""Helpers for child processes that must not outlive the process that started them."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """`preexec_fn` for Popen: Linux sends the child SIGTERM when its parent dies.

    Covers a launcher killed with SIGKILL, which gets no chance to stop its children.
    Elsewhere (or without libc) it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass
