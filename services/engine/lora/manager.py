"""Which adapters are in host memory and in device slots, and who may evict what.

Plain Python policy (no tensors): the tensor work is injected — `load(record)` reads and
prepares an adapter's weights and runs on a background executor, so a step never waits for a
disk read; `write_slot(slot, weights)` copies them into a device slot: called on the step
thread, it may return a pending write (`done()`, `wait()`: a GPU copy on a side stream while
steps go on), and until that is done the slot belongs to its new adapter but takes no sequence.
The engine drives it:

- `hold(name)` when a request arrives (NOT_FOUND for an unknown name, before anything queues):
  the adapter is now in demand and `poll()` starts its load if it is not in memory.
- `poll()` once per step: finished loads enter the host cache, failed ones are returned (their
  requests end with that error), and loads start while the host cache has room.
- `ready(record)` tells the scheduler whether a waiting request can be admitted; `acquire`
  gives a running sequence a slot (pinned: never evicted while pinned), `release` unpins it on
  finish, preemption or pause, `drop` when the request is gone.
- `wait_for_writes()` when nothing else can run: blocks until the pending slot writes land.
- `slots_to_yield(quantum_s)`: with slot time-slicing, the slots whose running sequences the
  scheduler pauses so that adapters waiting for a slot get them (services/engine/scheduler.py).

Host cache (`max_cpu_loras`) and slots (`max_loras`) are LRU; the host cache evicts adapters
nobody waits for first, and never one that a waiting request needs and that is in no slot.
Entries are keyed by (name, checksum): re-registering a name with new files is a new adapter,
and requests already running keep the files they started with.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.common.errors import NotFoundError, SluiceError
from services.common.protocol.adapter_record import AdapterRecord

logger = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass
class _Slot:
    key: Key | None = None
    pins: int = 0
    pinned_since_s: float = 0.0  # when its pins last went from none to some
    pending: Any = None  # a slot write still running (done(), wait()), None once landed


class AdapterManager:
    """Host cache and device slots of one engine's adapters, with pins and background loads."""

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        load: Callable[[AdapterRecord], Any],
        write_slot: Callable[[int, Any], Any],
        executor: Executor | None = None,
        on_load_done: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_load_done` is called on a loader thread when a load ends (success or not):
        an engine loop idle only because of loads in flight can wake on it and poll."""
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError("need 1 <= max_loras <= max_cpu_loras")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._load = load
        self._on_load_done = on_load_done
        self._write_slot = write_slot
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._records: dict[str, AdapterRecord] = {}
        self._demand: dict[Key, int] = {}  # live requests per adapter, in order of first demand
        self._wanted: dict[Key, AdapterRecord] = {}  # the record of each adapter in demand
        self._failed: dict[Key, SluiceError] = {}  # loads that failed, until registered again
        self._host: OrderedDict[Key, Any] = OrderedDict()  # LRU: oldest first
        self._loading: dict[Key, tuple[AdapterRecord, Future[Any]]] = {}
        self._slots = [_Slot() for _ in range(max_loras)]
        self._slot_by_key: dict[Key, int] = {}  # the slot each adapter in a slot holds
        self._slot_order: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))
        # Slots taking no new pins, each for an adapter waiting for a slot: slot -> since when.
        self._draining: dict[int, float] = {}
        self._max_draining = max(1, max_loras // 4)
        self._clock = clock
        self.num_loads = 0
        self.num_slot_writes = 0
        # An adapter refused a slot is refused again without a look until something that could
        # free one for it changes (a release, a drop, a step's poll): a step with hundreds of
        # paused or waiting sequences of adapters without a slot asks once per adapter.
        self._version = 0
        self._refused: dict[Key, int] = {}

    # ---- catalogue ------------------------------------------------------------------------
    def register(self, record: AdapterRecord) -> None:
        """Add or replace the adapter called `record.name` (requests in flight keep theirs)."""
        self._version += 1
        self._records[record.name] = record
        self._failed.pop(record.key, None)

    def unregister(self, name: str) -> bool:
        """Forget a name; its memory goes once no request uses it. False if unknown."""
        record = self._records.pop(name, None)
        if record is None:
            return False
        if not self._demand.get(record.key):
            self._host.pop(record.key, None)
        return True

    def record(self, name: str) -> AdapterRecord:
        record = self._records.get(name)
        if record is None:
            raise NotFoundError(f"unknown adapter {name!r}")
        return record

    def records(self) -> list[AdapterRecord]:
        return sorted(self._records.values(), key=lambda record: record.name)

    # ---- requests -------------------------------------------------------------------------
    def hold(self, name: str) -> AdapterRecord:
        """A request for `name` arrived; NotFoundError if no such adapter is registered, or
        the error of its failed load (until it is registered again)."""
        record = self.record(name)
        failure = self._failed.get(record.key)
        if failure is not None:
            raise type(failure)(failure.message)
        self._demand[record.key] = self._demand.get(record.key, 0) + 1
        self._wanted[record.key] = record
        if record.key in self._host:
            self._host.move_to_end(record.key)
        return record

    def drop(self, record: AdapterRecord) -> None:
        """A request that held `record` is finished (or refused)."""
        self._version += 1
        count = self._demand.get(record.key, 0) - 1
        if count > 0:
            self._demand[record.key] = count
            return
        self._demand.pop(record.key, None)
        self._wanted.pop(record.key, None)
        if self._records.get(record.name) is not record:  # unregistered or replaced
            self._host.pop(record.key, None)

    def ready(self, record: AdapterRecord) -> bool:
        """Whether a sequence of this adapter can get a slot now (its weights are in memory)."""
        return record.key in self._host or self._slot_of(record.key) is not None

    def acquire(self, record: AdapterRecord, *, first_token: bool = False) -> int | None:
        """Pin a device slot holding `record` (writing it if needed); None: none can be had now.

        When every slot is pinned, the one running the fewest sequences (the least recently
        acquired among equals) starts draining (one per adapter waiting): it takes no new pins,
        so once its running sequences end (or are paused: `slots_to_yield`) a waiting adapter
        gets it (no adapter waits forever behind a steady stream of requests for resident ones).
        A request yet to give its first token (`first_token`) may still join a draining slot
        whose sequences run: it is prefilled beside them and paused with them when the slot
        yields, which happens when it would have anyway, so the drain takes no longer while the
        request's first token need not wait for its adapter's next turn.
        """
        key = record.key
        if first_token and self._joinable(key):
            slot = self._slot_by_key[key]
            self._slots[slot].pins += 1
            return slot
        if self._refused.get(key) == self._version:
            return None  # refused since the last change that could free a slot for it
        slot = self._try_acquire(record)
        if slot is None:
            self._refused[key] = self._version
        return slot

    def _try_acquire(self, record: AdapterRecord) -> int | None:
        slot = self._slot_of(record.key)
        if slot is not None and slot in self._draining:
            return None
        if slot is None:
            weights = self._host.get(record.key)
            if weights is None:
                return None
            slot = self._free_slot()
            if slot is None:
                self._drain_for_waiting()
                return None
            self._slots[slot].pending = self._write_slot(slot, weights)
            self.num_slot_writes += 1
            self._version += 1  # the adapter it held waits now: its next ask may drain a slot
            self._slot_by_key.pop(self._slots[slot].key, None)
            self._slots[slot].key = record.key
            self._slot_by_key[record.key] = slot
            self._slot_order.move_to_end(slot)  # not the next one taken while it waits
            self._draining.pop(slot, None)
        entry = self._slots[slot]
        if entry.pending is not None:
            if not entry.pending.done():
                return None  # its copy is still running: the sequence waits a step or two
            entry.pending = None
        if entry.pins == 0:
            entry.pinned_since_s = self._clock()
        entry.pins += 1
        self._slot_order.move_to_end(slot)
        return slot

    def _joinable(self, key: Key) -> bool:
        """Whether `key`'s slot is draining with sequences still running in it (and its copy
        landed): a first token may join it (`acquire`)."""
        slot = self._slot_of(key)
        if slot is None or slot not in self._draining:
            return False
        entry = self._slots[slot]
        return entry.pins > 0 and entry.pending is None

    def could_acquire(self, record: AdapterRecord, *, first_token: bool = False) -> bool:
        """Whether `acquire(record)` could pin a slot now (changes nothing)."""
        if first_token and self._joinable(record.key):
            return True
        slot = self._slot_of(record.key)
        if slot is not None:
            pending = self._slots[slot].pending
            return slot not in self._draining and (pending is None or pending.done())
        return record.key in self._host and self._free_slot() is not None

    def drain_due(self) -> bool:
        """Whether an adapter waiting for a slot would start a slot draining now."""
        if len(self._draining) >= self._max_draining:
            return False
        return len(self._draining) < self._num_blocked() and any(
            slot not in self._draining and not self._reserved(self._slots[slot])
            for slot in self._slot_order
        )

    def release(self, slot: int) -> None:
        """A sequence stopped using `slot` (finished or preempted)."""
        entry = self._slots[slot]
        if entry.pins <= 0:
            raise SluiceError(f"LoRA slot {slot} released more often than acquired")
        entry.pins -= 1
        self._version += 1

    # ---- step -----------------------------------------------------------------------------
    def poll(self) -> list[tuple[AdapterRecord, SluiceError]]:
        """Collect finished loads and start new ones; returns the loads that failed."""
        self._version += 1  # slot copies may have landed since the last step
        self._refused.clear()
        failures: list[tuple[AdapterRecord, SluiceError]] = []
        for key, (record, future) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[key]
            error = future.exception()
            if error is None:
                self.num_loads += 1
                if self._demand.get(key) or len(self._host) < self.max_cpu_loras:
                    self._host[key] = future.result()
            else:
                if not isinstance(error, SluiceError):
                    logger.error("adapter %r failed to load", record.name, exc_info=error)
                    error = SluiceError(f"adapter {record.name!r} failed to load: {error}")
                self._failed[key] = error
                failures.append((record, error))
        surplus = len(self._draining) - self._num_blocked()
        for slot in list(self._draining)[: max(surplus, 0)]:
            del self._draining[slot]  # the adapters they drained for are gone or got slots
        for key in self._missing():
            if not self._make_host_room():
                break
            record = self._wanted[key]
            future = self._executor.submit(self._load, record)
            if self._on_load_done is not None:
                future.add_done_callback(self._load_done)
            self._loading[key] = (record, future)
        return failures

    @property
    def num_pending_writes(self) -> int:
        """Slot writes issued and not yet seen done."""
        return sum(1 for entry in self._slots if entry.pending is not None)

    def wait_for_writes(self) -> int:
        """Block until every pending slot write has landed; how many there were."""
        self._version += 1
        count = 0
        for entry in self._slots:
            if entry.pending is not None:
                entry.pending.wait()
                entry.pending = None
                count += 1
        return count

    def resident(self) -> tuple[str, ...]:
        """Names of the adapters in device slots (for the engine's load report)."""
        names = {entry.key[0] for entry in self._slots if entry.key is not None}
        return tuple(sorted(name for name in names if name in self._records))

    def loading(self) -> tuple[str, ...]:
        """Names of adapters that waiting requests need and that are not in memory yet."""
        keys = [*self._loading, *self._missing()]
        return tuple(sorted({key[0] for key in keys}))

    def slot_of(self, record: AdapterRecord) -> int | None:
        return self._slot_of(record.key)

    @property
    def num_loading(self) -> int:
        """Adapters in demand whose weights are not in memory yet (loading or queued)."""
        return len(self._loading) + len(self._missing())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- internals ------------------------------------------------------------------------
    def _missing(self) -> list[Key]:
        """Adapters in demand that are nowhere in memory and not loading, oldest demand first."""
        in_slots = {entry.key for entry in self._slots}
        return [
            key
            for key in self._demand
            if key not in self._host
            and key not in self._loading
            and key not in in_slots
            and key not in self._failed
        ]

    def _load_done(self, _future: Future[Any]) -> None:
        if self._on_load_done is not None:
            self._on_load_done()

    def _num_blocked(self) -> int:
        """Adapters in demand that are in memory but in no slot (they wait for one)."""
        in_slots = {entry.key for entry in self._slots}
        return sum(key in self._host and key not in in_slots for key in self._demand)

    @property
    def draining_slots(self) -> tuple[int, ...]:
        """Slots taking no new pins, oldest drain first."""
        return tuple(self._draining)

    def slots_to_yield(self, quantum_s: float) -> list[int]:
        """Draining slots whose running sequences have pinned them for `quantum_s` and that
        have drained as long: the engine pauses those sequences (their KV stays) so the slots
        change hands."""
        now = self._clock()
        slots = []
        for slot, since in self._draining.items():
            entry = self._slots[slot]
            if entry.pins and now - max(since, entry.pinned_since_s) >= quantum_s:
                slots.append(slot)
        return slots

    def _drain_for_waiting(self) -> None:
        """One slot drains per adapter that waits for a slot, at most a quarter of the slots
        at once (at least one): several adapters change places at a time, while most slots
        keep serving the adapters they hold. The slot running the fewest sequences drains
        first (the least recently acquired among equals): a turn then pauses the fewest
        sequences, and an adapter busy enough to fill many rows keeps its slot while the
        rarely used ones take turns on the others (they hold the paused sequences' KV blocks
        for the shortest total time: `benchmarks.lora_schedule_sim`)."""
        # The cap first: with every draining place taken (the usual case while adapters take
        # turns), a refused ask costs no count of the blocked adapters.
        if len(self._draining) >= self._max_draining:
            return
        if len(self._draining) >= self._num_blocked():
            return
        candidates = [
            slot
            for slot in self._slot_order
            if slot not in self._draining and not self._reserved(self._slots[slot])
        ]
        if candidates:
            victim = min(candidates, key=lambda slot: self._slots[slot].pins)
            self._draining[victim] = self._clock()

    def _slot_of(self, key: Key) -> int | None:
        return self._slot_by_key.get(key)

    def _free_slot(self) -> int | None:
        for index, entry in enumerate(self._slots):
            if entry.key is None:
                return index
        for index in self._slot_order:  # least recently acquired (or written) first
            entry = self._slots[index]
            if entry.pins == 0 and not self._reserved(entry):
                return index
        return None

    def _reserved(self, entry: _Slot) -> bool:
        """A slot just written for an adapter that has not taken it yet: its copy is still
        running, or its adapter's sequences are still to come. Neither taken nor drained."""
        if entry.pending is None:
            return False
        return not entry.pending.done() or bool(self._demand.get(entry.key))

    def _make_host_room(self) -> bool:
        """Free a host entry if the cache (with loads in flight) is full; False if it can't."""
        if len(self._host) + len(self._loading) < self.max_cpu_loras:
            return True
        in_slots = {entry.key for entry in self._slots}
        for wanted in (False, True):  # adapters nobody waits for, then those already in slots
            for key in self._host:
                if bool(self._demand.get(key)) == wanted and (not wanted or key in in_slots):
                    del self._host[key]
                    return True
        return False
