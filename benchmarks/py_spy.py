"""A py-spy sampler over this very process, for the GPU benchmarks' host profiles.

py-spy (a sampling profiler: no cost per Python call, unlike cProfile) records the process from
a child process between `start()` and `stop()`; `summarize` then gives each function's share of
the samples taken under one root frame (own time and inclusive), e.g. under the engine's
`LLMEngine.step`. py-spy must be on PATH or in a `bin/` beside an entry of sys.path (a wheel
installed with `pip --target`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def binary() -> str | None:
    """The py-spy executable, or None."""
    found = shutil.which("py-spy")
    if found:
        return found
    for directory in (Path(sys.executable).parent, *map(Path, sys.path)):
        for candidate in (directory / "py-spy", directory / "bin" / "py-spy"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


class Sampler:
    """py-spy recording this process into `raw_path` (py-spy's raw collapsed stacks)."""

    def __init__(self, raw_path: Path, rate: int = 500) -> None:
        self.raw_path = raw_path
        self.rate = rate
        self._process: subprocess.Popen[str] | None = None
        self.error: str | None = None

    def start(self) -> bool:
        executable = binary()
        if executable is None:
            self.error = "py-spy not found"
            return False
        _allow_tracing_by_children()
        self.raw_path.parent.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            [
                executable, "record", "--pid", str(os.getpid()), "--rate", str(self.rate),
                "--nonblocking", "--format", "raw", "--output", str(self.raw_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        time.sleep(1.0)  # attached before the work to sample starts
        if self._process.poll() is not None:
            self.error = (self._process.communicate()[0] or "py-spy exited").strip()[-400:]
            return False
        return True

    def stop(self) -> None:
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # py-spy writes its output on an interrupt
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        if not self.raw_path.exists():
            self.error = f"py-spy wrote nothing: {(output or '').strip()[-400:]}"


def _allow_tracing_by_children() -> None:
    """Let a child process (the sampler) attach to this one under Yama's ptrace scope 1."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass


def summarize(raw_path: Path, root: str, top: int = 40) -> dict[str, Any]:
    """Own and inclusive shares per function ('name (dir/file.py)') of the samples in a py-spy
    raw file taken under the frame `root` (its outermost occurrence), largest first."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = [short_frame(frame) for frame in stack.split(";")]
        if root not in frames:
            continue
        frames = frames[frames.index(root) :]
        count = int(count_text)
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return {"samples": 0}
    return {
        "samples": total,
        "own_share": {name: round(n / total, 4) for name, n in own.most_common(top)},
        "inclusive_share": {name: round(n / total, 4) for name, n in inclusive.most_common(top)},
    }


def short_frame(frame: str) -> str:
    """'Cls.fn (path/to/file.py:12)' -> 'Cls.fn (to/file.py)': one entry per function."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    path = where.rstrip(")")
    head, _, line = path.rpartition(":")
    if line.isdigit():
        path = head
    parts = Path(path).parts
    return f"{name} ({'/'.join(parts[-2:]) if parts else path})"
