"""freeze_startup_heap: what is alive at start-up is exempt from later collections."""

from __future__ import annotations

import gc

from services.common.heap import freeze_startup_heap


def test_the_start_up_heap_is_frozen_and_later_objects_are_not() -> None:
    alive = [[index] for index in range(1000)]  # tracked containers alive "at start-up"
    try:
        frozen = freeze_startup_heap()
        # Threads left by other tests may free frozen objects meanwhile (the count falls by
        # those); freezing the 1,000 later containers would raise it by about that many.
        assert frozen >= gc.get_freeze_count() >= len(alive)
        later = [[index] for index in range(1000)]  # what requests create afterwards
        assert gc.get_freeze_count() <= frozen
        assert gc.isenabled()  # the collector still runs for what comes later
        assert all(gc.is_tracked(item) for item in later)
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
    assert gc.get_freeze_count() == 0
