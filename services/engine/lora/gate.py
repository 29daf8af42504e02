"""AdapterGate: the adapter bookkeeping of each sequence, for the engine and the scheduler.

Plain Python. The engine calls `hold(seq)` when a request arrives (NOT_FOUND for an unknown
adapter, before anything is queued) and `drop(seq)` when it is gone; `poll()` once per step
(background loads land; sequences whose adapter failed to load come back with the error). The
scheduler calls `acquire(seq)` before admitting a waiting sequence — False while its adapter is
loading or no slot can be had, so the sequence stays waiting and others go ahead — and
`release(seq)` when it preempts, pauses or finishes one; `seq.adapter_slot` is the slot it runs
with. With slot time-slicing (`slot_quantum_s` > 0), `slots_to_yield()` names the slots whose
running sequences the scheduler pauses so that waiting adapters get the slots, and a request
yet to give its first token may join its adapter's draining slot beside the sequences still
running there (`first_token_joins`): it is paused with them at the turn, which comes when it
would have anyway.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.errors import SluiceError
from services.common.protocol.adapter_record import AdapterRecord
from services.engine.lora.batch import BASE_SLOT
from services.engine.lora.manager import AdapterManager
from services.engine.sequence import Sequence


class AdapterGate:
    """Which registered adapter each live sequence uses, and the slot it holds while it runs."""

    def __init__(
        self,
        manager: AdapterManager,
        *,
        slot_quantum_s: float = 0.0,
        first_token_joins: bool = True,
    ) -> None:
        self.manager = manager
        self.slot_quantum_s = slot_quantum_s  # 0: running sequences keep their slot to the end
        # a sequence yet to give its first token may join its adapter's draining slot
        self.first_token_joins = first_token_joins
        self._records: dict[int, AdapterRecord] = {}

    def hold(self, seq: Sequence) -> AdapterRecord | None:
        """Register a new request's adapter use (raises NotFoundError for an unknown name);
        the record it will run with (None for the base model)."""
        if seq.adapter is None:
            return None
        record = self._records[seq.seq_id] = self.manager.hold(seq.adapter)
        return record

    def record_of(self, seq: Sequence) -> AdapterRecord | None:
        return self._records.get(seq.seq_id)

    def acquire(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot; False if it must keep waiting (base model: True)."""
        record = self._records.get(seq.seq_id)
        if record is None or seq.adapter_slot != BASE_SLOT:
            return True
        # None too while its weights are not in memory
        slot = self.manager.acquire(record, first_token=self._may_join(seq))
        if slot is None:
            return False
        seq.adapter_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        """`seq` stops running (preempted or finished): unpin its slot."""
        if seq.adapter_slot != BASE_SLOT:
            self.manager.release(seq.adapter_slot)
            seq.adapter_slot = BASE_SLOT

    def slots_to_yield(self) -> list[int]:
        """With time-slicing, the slots whose running sequences should pause now (they keep
        their KV and resume once their adapter has a slot again)."""
        if self.slot_quantum_s <= 0:
            return []
        return self.manager.slots_to_yield(self.slot_quantum_s)

    def turn_due(self, sequences: Iterable[Sequence]) -> bool:
        """Whether a schedule now could change who holds the slots: a slot due to start
        draining, or one of `sequences` (paused or waiting) able to get its adapter's slot
        (a base-model one always can)."""
        manager = self.manager
        if manager.drain_due():
            return True
        seen: set[tuple[int, bool]] = set()
        for seq in sequences:
            record = self._records.get(seq.seq_id)
            if record is None:
                return True
            joins = self._may_join(seq)
            if (id(record), joins) in seen:
                continue
            seen.add((id(record), joins))
            if manager.could_acquire(record, first_token=joins):
                return True
        return False

    def could_acquire(self, seq: Sequence) -> bool:
        """Whether `acquire(seq)` could pin its adapter's slot now (changes nothing)."""
        record = self._records.get(seq.seq_id)
        return record is None or self.manager.could_acquire(record, first_token=self._may_join(seq))

    def drop(self, seq: Sequence) -> None:
        """The request is finished or aborted: release its slot and its demand."""
        self.release(seq)
        record = self._records.pop(seq.seq_id, None)
        if record is not None:
            self.manager.drop(record)

    def poll(self) -> list[tuple[int, SluiceError]]:
        """Advance loads; (seq_id, error) of each live sequence whose adapter failed to load."""
        failed = {record.key: error for record, error in self.manager.poll()}
        if not failed:
            return []
        return [
            (seq_id, failed[record.key])
            for seq_id, record in self._records.items()
            if record.key in failed
        ]

    def _may_join(self, seq: Sequence) -> bool:
        """Whether `seq` may join a draining slot: joining is on, the slots are time-sliced
        (a draining slot then yields after its quantum, joiners or not; without time-slicing
        it drains only as its sequences end, and joiners could keep it from ever changing
        hands), and it has given no token yet (never run, or preempted or paused before)."""
        return self.first_token_joins and self.slot_quantum_s > 0 and seq.num_output_tokens == 0

    @property
    def num_held(self) -> int:
        return len(self._records)
