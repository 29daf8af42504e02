"""The shared-memory ring that carries rank 0's steps: order, chunking, back-pressure, errors."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from services.common.errors import FailedPreconditionError
from services.engine.parallel import channel as channel_module
from services.engine.parallel.channel import SLOTS, StepChannel


@pytest.fixture
def small_ring():
    """A writer with 8-element slots (longer messages travel in chunks) and two readers."""
    writer = StepChannel.create(readers=2, slot_elements=8)
    readers = [StepChannel.attach(writer.path, rank, 2, slot_elements=8) for rank in (1, 2)]
    writer.unlink()
    yield writer, readers
    for end in (writer, *readers):
        end.close()


def messages(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(-(2**40), 2**40, size=int(rng.integers(1, 40))) for _ in range(count)]


def test_every_reader_gets_every_message_in_order_across_chunks_and_wraps(small_ring):
    writer, readers = small_ring
    sent = messages(5 * SLOTS)
    received: dict[int, list[np.ndarray]] = {0: [], 1: []}

    def read(index: int) -> None:
        for _ in sent:
            received[index].append(readers[index].get(timeout_s=10))

    threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for message in sent:  # 40 messages of up to 5 chunks each: the 8 slots are reused often
        writer.put(message, timeout_s=10)
    for thread in threads:
        thread.join(10)
    for index in (0, 1):
        assert len(received[index]) == len(sent)
        for ours, theirs in zip(received[index], sent, strict=True):
            np.testing.assert_array_equal(ours, theirs)


def test_the_writer_waits_for_the_slowest_reader_before_reusing_a_slot(small_ring):
    writer, readers = small_ring
    for value in range(SLOTS):  # fills the ring: nobody has read yet
        writer.put(np.array([value]), timeout_s=1)
    with pytest.raises(FailedPreconditionError, match="a rank to take a step"):
        writer.put(np.array([99]), timeout_s=0.05)
    assert readers[0].get(timeout_s=1).tolist() == [0]
    with pytest.raises(FailedPreconditionError):  # reader 2 still holds slot 0
        writer.put(np.array([99]), timeout_s=0.05)
    assert readers[1].get(timeout_s=1).tolist() == [0]
    writer.put(np.array([SLOTS]), timeout_s=1)
    assert [readers[0].get(timeout_s=1).tolist()[0] for _ in range(SLOTS)] == list(
        range(1, SLOTS + 1)
    )


def test_a_reader_with_nothing_to_read_times_out_with_a_clear_error(small_ring, monkeypatch):
    _, readers = small_ring
    monkeypatch.setattr(channel_module, "SPIN_S", 0.001)
    started = time.monotonic()
    with pytest.raises(FailedPreconditionError, match="rank 0's next step"):
        readers[0].get(timeout_s=0.05)
    assert time.monotonic() - started < 2


def test_a_reader_in_another_process_sees_the_messages():
    writer = StepChannel.create(readers=1)
    script = (
        "import sys; from pathlib import Path;"
        "from services.engine.parallel.channel import StepChannel;"
        "end = StepChannel.attach(Path(sys.argv[1]), 1, 1);"
        "print(sum(int(end.get(timeout_s=30).sum()) for _ in range(3)))"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(writer.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        big = np.arange(100_000)  # four chunks of the default slot size
        for message in (np.array([5]), big, np.array([-7, 2])):
            writer.put(message, timeout_s=30)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        writer.unlink()
        writer.close()
    assert int(out) == 5 + int(big.sum()) - 5
