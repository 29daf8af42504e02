"""The stack benchmark's load generator as a process of its own, at the lowest CPU priority.

On a machine as small as 2 cores the load generator shares the stack's cores, and
at 64 streams it reads about 2,000 responses a second: a third of a core that a real client on
another machine would not take from the router, the tokenizer and the engine. So by default it
runs here, below the stack: in a session of its own (on Linux, its own scheduling autogroup)
at nice 19, on the group and on every thread, so it gets what the stack leaves. The stack's
services and the latency probe keep their normal priority. `--client-priority normal` in
benchmarks/stack_bench.py keeps the old arrangement (the load at the stack's priority), for
comparison. On a bigger machine `--client-cpus` moves it off the stack's cores instead.

Both sides (engine alone, router) run it the same way. Protocol on stdout, one JSON object a
line: first {"window": [start, end], "priority": {...}} as the load starts (time.monotonic(),
one clock for all processes; the parent samples CPU at its edges and starts the probe), then
the RunResult. Errors go to stderr with a non-zero exit.

    python -m benchmarks.stack_bench_load router 127.0.0.1:50051 '{"concurrency": 64, ...}' low
    python -m benchmarks.stack_bench_load engine 127.0.0.1:50061 SHAPE normal '[[1, 2, 3]]'
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

LOWEST_NICE = 19
PRIORITIES = ("low", "normal")
USAGE = (
    "python -m benchmarks.stack_bench_load router|engine ADDRESS SHAPE_JSON low|normal [IDS_JSON]"
)


def lower_priority() -> dict:
    """Nice 19 for this thread (threads started later inherit it) and for this process's
    autogroup, which only this process is in once it leads its own session. Returns what held."""
    applied: dict = {"nice": os.nice(LOWEST_NICE - os.nice(0))}
    autogroup = Path("/proc/self/autogroup")  # absent without CONFIG_SCHED_AUTOGROUP
    applied["autogroup_nice"] = None
    if os.getsid(0) == os.getpid() and autogroup.exists():
        with contextlib.suppress(OSError):  # autogroups off (sysctl): the thread nice holds
            autogroup.write_text(str(LOWEST_NICE))
            applied["autogroup_nice"] = int(autogroup.read_text().split("nice")[-1])
    return applied


def main(argv: list[str]) -> int:
    side, address, shape_json, priority = (list(argv) + [""] * 4)[:4]
    wanted = 5 if side == "engine" else 4
    if side not in ("router", "engine") or priority not in PRIORITIES or len(argv) != wanted:
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    # Before gRPC is imported: every thread it starts inherits this thread's priority.
    applied = lower_priority() if priority == "low" else {"nice": os.nice(0)}
    from dataclasses import asdict

    from benchmarks.stack_bench_clients import LoadShape, engine_run, router_run
    from services.common import event_loop

    sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)  # as the services do

    shape = LoadShape(**json.loads(shape_json))

    def started(start: float, end: float) -> None:
        print(json.dumps({"window": [start, end], "priority": applied}), flush=True)

    if side == "router":
        result = event_loop.run(router_run(address, shape, started))
    else:
        result = event_loop.run(engine_run(address, json.loads(argv[4]), shape, started))
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
