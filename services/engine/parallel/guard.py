"""What ends a tensor-parallel engine whose ranks fell out of step (stdlib only: cheap to import).

Rank 0 sends each step to the other ranks before running its own part. If its part then fails,
the others wait at an all-reduce this rank never reaches, and every later sum would pair with
the wrong one: the group is out of step for good. `after_send` wraps rank 0's part: on a failure
the engine process ends (exit code 1) and its supervisor (the launcher, or Ray) restarts the
whole group, so its requests see the engine go away instead of wrong text or a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.engine.parallel.group import TensorParallelRank

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def after_send(tensor_parallel: TensorParallelRank | None) -> Iterator[None]:
    """Around rank 0's part of a step the other ranks were sent (nothing without a group)."""
    if tensor_parallel is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        logger.critical(
            "tensor-parallel step failed after the other ranks started it, the group is out "
            "of step: stopping this engine (%s: %s)",
            type(exc).__name__,
            exc,
        )
        leave_process(1)
        raise


def leave_process(code: int) -> None:
    """End this process now, without clean-up that would wait on the other ranks."""
    logging.shutdown()
    os._exit(code)
