"""Opt-in timing of each hop a request's first token takes through the processes (diagnostics).

Off unless `SLUICE_HOP_TRACE_DIR` names a directory. Then every process appends one line per
event to `<dir>/<pid>.log`: the event name, its keys and `time.monotonic()` (one clock for all
processes of a machine), written unbuffered, so a process killed at the end loses nothing.

- The router records the requests whose call carries the `sluice-hop-trace` metadata key, at
  each step of their first token's way: arrival, tokenize sent and answered, placement, the
  engine submit, the engine step that carried the token, the detokenize round trip, the
  first response.
- The engine records every submit it receives and every step: the turn that applied submits,
  the step's end and the step message handed to gRPC.
- The tokenizer records every tokenize and detokenize message it receives and answers.

`benchmarks/hop_report.py` joins the files into one row per traced request; `stack_bench
--hop-trace DIR` traces its latency probe that way. Call sites check `ENABLED` first, so the
cost when off is one global lookup.
"""

from __future__ import annotations

import os
import time

from services.common import env

METADATA_KEY = "sluice-hop-trace"

_DIR = env.setting("hop_trace_dir")
ENABLED = _DIR is not None
_fd: int | None = None


def mark(event: str, *keys: object) -> None:
    """Append `event keys... time` to this process's file (only call when ENABLED)."""
    global _fd
    now = time.monotonic()
    if _fd is None:
        os.makedirs(_DIR, exist_ok=True)
        _fd = os.open(
            os.path.join(_DIR, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
    os.write(_fd, (" ".join([event, *map(str, keys), f"{now:.6f}"]) + "\n").encode())


def requested(metadata: object) -> bool:
    """Whether a call's invocation metadata asks for its request to be traced."""
    return ENABLED and any(key == METADATA_KEY for key, _ in metadata or ())
