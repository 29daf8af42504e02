"""How every Sluice process runs its asyncio loop: uvloop where installed, else asyncio's own.

grpc.aio works on any asyncio loop; uvloop's cuts the loop's own cost per callback, which on
the per-token path (one gRPC message per token per stream) is a large share of the router's,
the tokenizer's and the clients' CPU. `SLUICE_EVENT_LOOP=asyncio` keeps the standard loop
(e.g. to compare, or where uvloop misbehaves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from services.common.env import setting

T = TypeVar("T")
CHOICES = ("auto", "uvloop", "asyncio")
# Python's GIL switch interval for every Sluice process and the bench clients. gRPC's poller
# thread needs the GIL to hand each completed message to the event loop (and the engine's
# forward thread needs it back after each torch op); with Python's default 5 ms each hand-off
# can wait that long behind the loop's own Python, on every hop of a request. 0.5 ms bounds the
# wait (engine: stack_bench through the router, dummy:tiny, 7.7-8.1k -> 9.0-9.3k tokens/s).
GIL_SWITCH_INTERVAL_S = 0.0005


def use_uvloop() -> bool:
    """Whether this process runs on uvloop (SLUICE_EVENT_LOOP: auto, uvloop or asyncio)."""
    choice = (setting("event_loop") or "auto").lower()
    if choice not in CHOICES:
        raise ValueError(f"SLUICE_EVENT_LOOP must be one of {CHOICES}, got {choice!r}")
    if choice == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise
        return False
    return True


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    if not use_uvloop():
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)
