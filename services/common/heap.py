"""Garbage collection in the long-running service processes: the start-up heap frozen.

A service process holds hundreds of thousands of objects that live as long as it does (the
modules it imported, torch's, the model's, gRPC's), and every full collection of CPython's
cyclic garbage collector walks all of them: with torch and the engine of
`benchmarks.engine_host_bench` built (~240,000 tracked objects), one full collection takes
67-72 ms on a 2-vCPU Xeon, a stall of the engine's step loop (the GPU waits) or of the
router's streams (every token in flight late), and 0.01 ms once they are frozen. Full
collections are rare (when the objects promoted since the last one reach a quarter of the
long-lived ones), so this is a tail effect: minutes apart under load. Once a process is up,
`freeze_startup_heap` collects once and moves what is left into the permanent generation,
which no collection walks again: later collections see only what requests created. The
collector stays on for that (request state can form cycles).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then exempt every object alive now from later collections; how many are."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("garbage collector: %d start-up objects frozen", frozen)
    return frozen
