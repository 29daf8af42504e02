"""Rank 0's steps to the other ranks of its group through a ring in shared host memory.

Every step of a tensor-parallel engine starts with rank 0 telling the other ranks what to run
(a few hundred int64s for a decode step). Through a socket collective that costs a round trip
and thread hand-offs on rank 0's critical path and delays the other ranks, whose lateness rank
0's GPU then waits out at the first all-reduce. Here rank 0 copies the message into a slot of a
memory-mapped file and publishes it with one store; ranks 1..N-1 poll the slot's sequence number
(spinning while steps come often, sleeping briefly once idle) and copy the message out.

Layout: a control block (each reader's count of messages taken), then `SLOTS` slots, each with
a header (sequence number, element count, message length) and `slot_elements` int64s. A message
longer than a slot travels as consecutive chunks. Rank 0 reuses a slot only after every reader
took what it held. A lock acquired and released around each publish and take is the memory
barrier between the stores of one process and the loads of another.

The ranks of a group share one host (launch.py starts them as child processes); the file lives
in /dev/shm where there is one and is unlinked as soon as every rank has mapped it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from services.common.errors import FailedPreconditionError

SLOTS = 8
SLOT_ELEMENTS = 1 << 15  # 256 KiB a slot: a decode step of up to ~500 rows in one chunk
SLOT_HEADER = 4  # sequence number + 1, elements in this chunk, message length, spare
CONTROL = 16  # reader counters (int64 each), room for up to 16 readers
SPIN_S = 0.02  # poll without sleeping this long: steps of a busy engine come every few ms
IDLE_SLEEP_S = 0.0005
DEFAULT_TIMEOUT_S = 600.0


def shm_dir() -> Path:
    """/dev/shm where it exists and is writable, else the temporary directory."""
    path = Path("/dev/shm")
    return path if path.is_dir() and os.access(path, os.W_OK) else Path(tempfile.gettempdir())


class StepChannel:
    """One end of the ring: rank 0 writes (`put`), every other rank reads (`get`)."""

    def __init__(self, path: Path, *, rank: int, readers: int, slot_elements: int) -> None:
        if not 1 <= readers <= CONTROL:
            raise FailedPreconditionError(f"a step channel serves 1..{CONTROL} readers")
        self.path = path
        self.rank = rank
        self.readers = readers
        self.slot_elements = slot_elements
        self.slot_size = SLOT_HEADER + slot_elements
        size = (CONTROL + SLOTS * self.slot_size) * 8
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), size)
        words = np.frombuffer(self._map, dtype=np.int64)
        self._taken = words[:CONTROL]
        self._slots = words[CONTROL:].reshape(SLOTS, self.slot_size)
        self._fence = threading.Lock()
        self.sent = 0  # messages chunks put (rank 0) or taken (this reader)

    @classmethod
    def create(cls, readers: int, slot_elements: int = SLOT_ELEMENTS) -> StepChannel:
        """Rank 0's end, on a new zeroed file (pass `path` to the other ranks)."""
        path = shm_dir() / f"sluice-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        size = (CONTROL + SLOTS * (SLOT_HEADER + slot_elements)) * 8
        with open(path, "xb") as handle:
            handle.truncate(size)
        return cls(path, rank=0, readers=readers, slot_elements=slot_elements)

    @classmethod
    def attach(cls, path: Path, rank: int, readers: int, slot_elements: int = SLOT_ELEMENTS):
        """Rank `rank`'s (>= 1) end of rank 0's channel at `path`."""
        return cls(path, rank=rank, readers=readers, slot_elements=slot_elements)

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); once every rank has attached."""
        self.path.unlink(missing_ok=True)

    def _barrier(self) -> None:
        with self._fence:
            pass

    # ---- rank 0 -------------------------------------------------------------------------
    def put(self, message: np.ndarray, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Publish one int64 message (1-D) to every reader."""
        flat = np.ascontiguousarray(message, dtype=np.int64).reshape(-1)
        length = flat.size
        offset = 0
        while True:
            chunk = flat[offset : offset + self.slot_elements]
            self._put_chunk(chunk, length, timeout_s)
            offset += chunk.size
            if offset >= length:
                return

    def _put_chunk(self, chunk: np.ndarray, length: int, timeout_s: float) -> None:
        index = self.sent
        readers = self._taken[: self.readers]
        # The slot's previous chunk (index - SLOTS) must have been taken by every reader.
        _wait(lambda: int(readers.min()) > index - SLOTS, timeout_s, "a rank to take a step")
        self._barrier()
        slot = self._slots[index % SLOTS]
        slot[SLOT_HEADER : SLOT_HEADER + chunk.size] = chunk
        slot[1] = chunk.size
        slot[2] = length
        self._barrier()
        slot[0] = index + 1  # published
        self.sent = index + 1

    # ---- ranks 1..N-1 ---------------------------------------------------------------------
    def get(self, timeout_s: float | None = None) -> np.ndarray:
        """The next message (a copy), waiting for it; `timeout_s` None: as long as it takes."""
        first = self._take_chunk(timeout_s)
        length = int(self._last_length)
        if first.size == length:
            return first
        parts = [first]
        received = first.size
        while received < length:
            part = self._take_chunk(timeout_s)
            parts.append(part)
            received += part.size
        return np.concatenate(parts)

    def _take_chunk(self, timeout_s: float | None) -> np.ndarray:
        index = self.sent
        slot = self._slots[index % SLOTS]
        _wait(lambda: int(slot[0]) == index + 1, timeout_s, "rank 0's next step")
        self._barrier()
        size = int(slot[1])
        self._last_length = int(slot[2])
        chunk = slot[SLOT_HEADER : SLOT_HEADER + size].copy()
        self._barrier()
        self.sent = index + 1
        self._taken[self.rank - 1] = index + 1
        return chunk

    def close(self) -> None:
        self._taken = self._slots = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still alive: it goes with the process
            self._map.close()


def _wait(ready, timeout_s: float | None, what: str) -> None:
    """Poll `ready()`: spin for SPIN_S, then sleep a little between polls."""
    if ready():
        return
    start = time.monotonic()
    while not ready():
        waited = time.monotonic() - start
        if waited > SPIN_S:
            if timeout_s is not None and waited > timeout_s:
                raise FailedPreconditionError(f"timed out after {waited:.0f} s waiting for {what}")
            time.sleep(IDLE_SLEEP_S)
