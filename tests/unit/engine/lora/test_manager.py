"""AdapterManager: background loads, LRU host cache and slots, pins that are never evicted."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future
from typing import Any

import pytest

from services.common.errors import FailedPreconditionError, NotFoundError, SluiceError
from services.common.protocol.adapter_record import AdapterRecord
from services.engine.lora.manager import AdapterManager


class ManualExecutor(Executor):
    """Runs submitted loads only when the test says so."""

    def __init__(self) -> None:
        self.queued: list[tuple[Future, Any, tuple]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        future: Future = Future()
        self.queued.append((future, fn, args))
        return future

    def run_all(self) -> None:
        queued, self.queued = self.queued, []
        for future, fn, args in queued:
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the manager like a real executor
                future.set_exception(exc)


def record(name: str, sha256: str = "c") -> AdapterRecord:
    return AdapterRecord(name=name, path=name, sha256=sha256, rank=8, target_modules=("q_proj",))


def make(
    max_loras: int = 2, max_cpu_loras: int = 3, broken: tuple[str, ...] = (), clock=time.monotonic
):
    executor = ManualExecutor()
    written: list[tuple[int, str]] = []

    def load(rec: AdapterRecord) -> str:
        if rec.name in broken:
            raise FailedPreconditionError(f"adapter {rec.name!r} changed on disk")
        return f"weights:{rec.name}:{rec.sha256}"

    manager = AdapterManager(
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        load=load,
        write_slot=lambda slot, weights: written.append((slot, weights)),
        executor=executor,
        clock=clock,
    )
    for name in ("a", "b", "c", "d", "e"):
        manager.register(record(name))
    return manager, executor, written


def test_unknown_adapter_is_not_found_before_anything_queues() -> None:
    manager, executor, _ = make()
    with pytest.raises(NotFoundError, match="unknown adapter 'zzz'"):
        manager.hold("zzz")
    assert manager.poll() == [] and executor.queued == []


def test_a_load_runs_off_the_step_and_the_request_waits_until_ready() -> None:
    manager, executor, written = make()
    a = manager.hold("a")
    assert not manager.ready(a) and manager.acquire(a) is None
    assert manager.loading() == ("a",)  # queued
    manager.poll()  # starts the load ...
    assert len(executor.queued) == 1 and not manager.ready(a) and manager.loading() == ("a",)
    manager.poll()  # ... which does not finish by itself
    assert len(executor.queued) == 1 and manager.num_loading == 1
    executor.run_all()
    manager.poll()
    assert manager.ready(a) and manager.num_loading == 0 and manager.loading() == ()
    slot = manager.acquire(a)
    assert slot == 0 and written == [(0, "weights:a:c")]
    assert manager.acquire(a) == 0 and len(written) == 1  # a second sequence shares the slot
    assert manager.resident() == ("a",)


def _load(manager: AdapterManager, executor: ManualExecutor, *names: str) -> list[AdapterRecord]:
    records = [manager.hold(name) for name in names]
    manager.poll()
    executor.run_all()
    manager.poll()
    return records


def test_pinned_slots_are_never_evicted_and_lru_goes_first() -> None:
    manager, executor, written = make(max_loras=2, max_cpu_loras=3)
    a, b, c = _load(manager, executor, "a", "b", "c")
    slot_a, slot_b = manager.acquire(a), manager.acquire(b)
    assert {slot_a, slot_b} == {0, 1}
    assert manager.acquire(c) is None  # both slots pinned: c waits
    manager.release(slot_a)
    manager.release(slot_b)
    manager.acquire(b)  # b used again: a is now the least recently used
    manager.release(slot_b)
    assert manager.acquire(c) == slot_a
    assert manager.slot_of(a) is None and manager.slot_of(b) == slot_b
    assert written[-1] == (slot_a, "weights:c:c")
    assert manager.resident() == ("b", "c")
    manager.release(slot_a)  # c's pin
    with pytest.raises(SluiceError, match="released more often"):
        manager.release(slot_a)


def test_host_cache_evicts_adapters_nobody_waits_for_first() -> None:
    manager, executor, _ = make(max_loras=1, max_cpu_loras=2)
    a, b = _load(manager, executor, "a", "b")
    manager.drop(a)  # a's request is gone; b's still waits
    c = manager.hold("c")
    manager.poll()
    executor.run_all()
    manager.poll()
    assert manager.ready(c) and manager.ready(b) and not manager.ready(a)


def test_host_cache_full_of_waiting_adapters_delays_loads_instead_of_thrashing() -> None:
    manager, executor, _ = make(max_loras=1, max_cpu_loras=1)
    a, b = _load(manager, executor, "a", "b")
    assert manager.ready(a) and not manager.ready(b) and manager.num_loading == 1
    slot = manager.acquire(a)
    manager.poll()  # a's host copy may go now that a slot holds it: b loads
    executor.run_all()
    manager.poll()
    assert manager.ready(b) and manager.ready(a)
    assert manager.acquire(b) is None  # the only slot is pinned by a
    manager.release(slot)
    manager.drop(a)
    assert manager.acquire(b) == slot


def test_an_evicted_adapter_still_in_demand_is_loaded_again() -> None:
    manager, executor, _ = make(max_loras=1, max_cpu_loras=1)
    (a,) = _load(manager, executor, "a")
    slot = manager.acquire(a)
    manager.release(slot)
    b = manager.hold("b")
    for _ in range(2):  # a's host copy makes room for b; b takes the slot
        manager.poll()
        executor.run_all()
    manager.poll()
    assert manager.acquire(b) == slot
    manager.release(slot)
    manager.drop(b)
    assert not manager.ready(a)  # a is in neither the host cache nor a slot ...
    manager.poll()
    executor.run_all()
    manager.poll()
    assert manager.ready(a)  # ... and its waiting request brings it back


def test_a_failed_load_is_reported_once_and_refuses_new_requests_until_reregistered() -> None:
    manager, executor, _ = make(broken=("a",))
    a = manager.hold("a")
    manager.poll()
    executor.run_all()
    failures = manager.poll()
    assert [(rec.name, type(error)) for rec, error in failures] == [("a", FailedPreconditionError)]
    assert manager.poll() == [] and executor.queued == []  # no retry loop
    with pytest.raises(FailedPreconditionError, match="changed on disk"):
        manager.hold("a")
    manager.drop(a)
    manager.register(record("a"))
    manager.hold("a")
    manager.poll()
    assert len(executor.queued) == 1


def test_reregistering_a_name_serves_new_requests_the_new_files() -> None:
    manager, executor, written = make()
    (old,) = _load(manager, executor, "a")
    slot = manager.acquire(old)
    manager.register(record("a", sha256="new"))
    (new,) = _load(manager, executor, "a")
    assert new.key != old.key
    new_slot = manager.acquire(new)
    assert new_slot != slot and written[-1] == (new_slot, "weights:a:new")
    manager.release(slot)
    manager.drop(old)
    assert manager.resident() == ("a",)
    assert manager.unregister("a") and not manager.unregister("a")
    with pytest.raises(NotFoundError):
        manager.hold("a")
    assert manager.resident() == ()


def test_loads_run_on_another_thread_by_default() -> None:
    threads: list[int] = []
    done = threading.Event()

    def load(rec: AdapterRecord) -> str:
        threads.append(threading.get_ident())
        done.set()
        return rec.name

    woken = threading.Event()
    manager = AdapterManager(
        max_loras=1,
        max_cpu_loras=1,
        load=load,
        write_slot=lambda *_: None,
        on_load_done=woken.set,
    )
    manager.register(record("a"))
    a = manager.hold("a")
    manager.poll()
    assert done.wait(5) and woken.wait(5)  # the step loop is woken, it need not spin
    manager.poll()
    assert manager.ready(a) and threads != [threading.get_ident()]
    manager.shutdown()


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        AdapterManager(max_loras=4, max_cpu_loras=2, load=str, write_slot=lambda *_: None)


def test_a_waiting_adapter_drains_a_slot_instead_of_starving() -> None:
    manager, executor, _ = make(max_loras=2, max_cpu_loras=3)
    a, b, c = _load(manager, executor, "a", "b", "c")
    slot_a, slot_b = manager.acquire(a), manager.acquire(b)
    assert manager.acquire(c) is None and manager.draining_slots == (slot_a,)
    assert manager.acquire(a) is None  # a takes no new sequences while it drains ...
    assert manager.acquire(b) == slot_b  # ... b still does
    manager.release(slot_a)  # a's last running sequence ends
    assert manager.acquire(c) == slot_a and manager.draining_slots == ()
    # Now a waits for a slot: it drains c's (one sequence), not b's (two).
    assert manager.acquire(a) is None and manager.draining_slots == (slot_a,)


def test_the_slot_running_the_fewest_sequences_drains_first() -> None:
    manager, executor, _ = make(max_loras=3, max_cpu_loras=4)
    a, b, c, d = _load(manager, executor, "a", "b", "c", "d")
    slot_a = manager.acquire(a)
    for _ in range(3):
        manager.acquire(a)  # a runs four sequences: least recently acquired, but busy
    slot_b = manager.acquire(b)
    manager.acquire(b)  # b runs two
    slot_c = manager.acquire(c)  # c runs one, acquired last
    assert manager.acquire(d) is None and manager.draining_slots == (slot_c,)
    manager.release(slot_c)
    assert manager.acquire(d) == slot_c
    for _ in range(2):
        manager.acquire(d)  # d runs three
    assert manager.acquire(c) is None and manager.draining_slots == (slot_b,)  # then b, not a
    assert manager.acquire(a) == slot_a


def test_draining_stops_when_the_waiting_adapter_is_gone() -> None:
    manager, executor, _ = make(max_loras=1, max_cpu_loras=2)
    a, b = _load(manager, executor, "a", "b")
    slot = manager.acquire(a)
    assert manager.acquire(b) is None and manager.draining_slots == (slot,)
    manager.drop(b)  # b's request was aborted
    manager.poll()
    assert manager.draining_slots == () and manager.acquire(a) == slot


def test_a_slot_drained_for_a_quantum_is_yielded_to_the_waiting_adapter() -> None:
    now = [100.0]
    manager, executor, written = make(max_loras=1, max_cpu_loras=2, clock=lambda: now[0])
    a, b = _load(manager, executor, "a", "b")
    slot = manager.acquire(a)
    manager.acquire(a)  # two running sequences of a
    assert manager.slots_to_yield(0.5) == []  # nobody waits yet
    assert manager.acquire(b) is None and manager.draining_slots == (slot,)
    now[0] += 0.4
    assert manager.slots_to_yield(0.5) == []  # drained for less than the quantum
    now[0] += 0.2
    assert manager.slots_to_yield(0.5) == [slot]  # the scheduler pauses a's sequences ...
    manager.release(slot)
    manager.release(slot)
    assert manager.slots_to_yield(0.5) == []  # ... and nothing pins it any more
    assert manager.acquire(a) is None  # a paused sequence cannot take it back
    assert manager.acquire(b) == slot and written[-1] == (slot, "weights:b:c")
    assert manager.acquire(a) is None and manager.draining_slots == (slot,)  # a's turn comes next
    now[0] += 0.6
    assert manager.slots_to_yield(0.5) == [slot]
    manager.drop(a)  # a's requests went away: nobody waits, nothing to yield
    manager.drop(a)
    manager.poll()
    assert manager.slots_to_yield(0.5) == []


def test_one_slot_drains_per_waiting_adapter_up_to_a_quarter() -> None:
    now = [0.0]
    manager, executor, _ = make(max_loras=8, max_cpu_loras=12, clock=lambda: now[0])
    for name in ("f", "g", "h", "i", "j", "k"):
        manager.register(record(name))
    a, b, c = _load(manager, executor, "a", "b", "c")
    slot_a, slot_b = manager.acquire(a), manager.acquire(b)
    for pinned in _load(manager, executor, "f", "g", "h", "i", "j", "k"):
        manager.acquire(pinned)  # six more adapters fill the other six slots
    assert manager.acquire(c) is None and manager.draining_slots == (slot_a,)
    assert manager.acquire(c) is None and manager.draining_slots == (slot_a,)  # still one
    (d,) = _load(manager, executor, "d")
    assert manager.acquire(d) is None and manager.draining_slots == (slot_a, slot_b)
    (e,) = _load(manager, executor, "e")
    assert manager.acquire(e) is None and len(manager.draining_slots) == 2  # a quarter of 8
    now[0] = 1.0
    assert manager.slots_to_yield(0.5) == [slot_a, slot_b]
    manager.release(slot_a)  # a's sequence paused
    assert manager.acquire(c) == slot_a and manager.draining_slots == (slot_b,)
    manager.drop(d)  # d's and e's requests went away; b keeps draining for a's paused one
    manager.drop(e)
    manager.poll()
    assert manager.draining_slots == (slot_b,)
    manager.drop(a)  # and once a's request ends too, nobody waits
    manager.poll()
    assert manager.draining_slots == () and manager.acquire(b) == slot_b


class PendingWrite:
    """A slot write that lands when the test says so (as a GPU copy on a side stream)."""

    def __init__(self) -> None:
        self.landed = False
        self.waited = False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.waited = self.landed = True


def test_a_slot_whose_copy_is_running_takes_no_sequence_until_it_lands() -> None:
    executor = ManualExecutor()
    writes: dict[int, PendingWrite] = {}

    def write_slot(slot: int, weights: Any) -> PendingWrite:
        writes[slot] = PendingWrite()
        return writes[slot]

    manager = AdapterManager(
        max_loras=2, max_cpu_loras=3, load=str, write_slot=write_slot, executor=executor
    )
    for name in ("a", "b", "c"):
        manager.register(record(name))
    a, b, c = (manager.hold(name) for name in ("a", "b", "c"))
    manager.poll()
    executor.run_all()
    manager.poll()
    assert manager.acquire(a) is None  # the copy into its slot started ...
    assert manager.num_pending_writes == 1 and manager.resident() == ("a",)
    assert manager.acquire(a) is None  # ... and is still running
    slot_a = manager.slot_of(a)
    assert manager.acquire(b) is None  # b's copy goes to the other slot, not over a's
    slot_b = manager.slot_of(b)
    assert {slot_a, slot_b} == {0, 1}
    assert manager.acquire(c) is None and manager.slot_of(c) is None  # both slots are busy
    writes[slot_a].landed = True
    assert manager.acquire(a) == slot_a and manager.num_pending_writes == 1
    assert manager.wait_for_writes() == 1 and writes[slot_b].waited
    assert manager.num_pending_writes == 0 and manager.acquire(b) == slot_b
    assert manager.wait_for_writes() == 0


def test_a_first_token_joins_a_draining_slot_while_its_sequences_run() -> None:
    now = [10.0]
    manager, executor, _ = make(max_loras=1, max_cpu_loras=2, clock=lambda: now[0])
    a, b = _load(manager, executor, "a", "b")
    slot = manager.acquire(a)
    assert manager.acquire(b) is None and manager.draining_slots == (slot,)
    # a resumed or decoding sequence of a may not take the draining slot again ...
    assert manager.acquire(a) is None and not manager.could_acquire(a)
    # ... a request of a yet to give its first token may, beside the running one
    assert manager.could_acquire(a, first_token=True)
    now[0] += 0.3
    assert manager.acquire(a, first_token=True) == slot
    # the slot still yields a quantum after its drain began, not after the join
    now[0] += 0.25
    assert manager.slots_to_yield(0.5) == [slot]
    manager.release(slot)
    manager.release(slot)
    # nothing of a runs there any more: a new request of a waits for a's next turn
    assert manager.acquire(a, first_token=True) is None
    assert not manager.could_acquire(a, first_token=True)
    assert manager.acquire(b) == slot
