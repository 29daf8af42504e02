"""Dispatch: which queued request goes to which engine, and when. A policy behind an interface.

The servicer admits requests into the `AdmissionQueue`; the engine pool streams them to
engines; between the two a `DispatchPolicy` decides placement from each engine's reported
capacity. `LeastLoadedPolicy` sends the next request in queue order to the engine with the
most free capacity, and holds it in the router while no engine has room, so the queue bound,
priorities and deadlines stay meaningful. The router's default, `LoraAwarePolicy`
(lora_batcher.py), fits behind the same `schedule` (per-adapter queues, adapter residency,
adapter caps) without touching the servicer or the engine pool. Plain Python: no gRPC, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.router.admission import AdmissionQueue


@dataclass
class EngineCapacity:
    """The router's view of one engine, refreshed from its Info and every step's load."""

    engine_id: str
    ready: bool = False
    max_num_seqs: int = 0
    max_model_len: int = 0
    block_size: int = 16
    total_blocks: int = 0
    free_blocks: int = 0  # as last reported by the engine
    reserved_blocks: int = 0  # promised to requests submitted since that report
    inflight: int = 0  # requests placed here and not finished
    max_inflight: int = 0  # the router's own cap (--max-inflight-per-engine); 0: the engine's
    engine_max_inflight: int = 0  # what the engine takes in flight (0: its max_num_seqs)
    resident_adapters: tuple[str, ...] = field(default_factory=tuple)
    # LoRA: device slots (0: not reported), the most distinct adapters served in flight at once
    # (the slots, or the host cache when the engine time-slices its slots; 0: not reported, the
    # slots count), adapters loading now, requests in flight here per adapter (base-model
    # requests are not counted), and the measured time an adapter takes to become resident here
    # (0: not measured yet).
    lora_slots: int = 0
    lora_adapter_capacity: int = 0
    loading_adapters: tuple[str, ...] = field(default_factory=tuple)
    adapters_inflight: dict[str, int] = field(default_factory=dict)
    adapter_load_s: float = 0.0
    _loading_since: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def slot_limit(self) -> int:
        return self.max_inflight or self.engine_max_inflight or self.max_num_seqs

    @property
    def adapter_cap(self) -> int:
        """The most distinct adapters in flight here: the reported capacity, else (an engine
        that predates it) the device slots; 0: no cap."""
        return self.lora_adapter_capacity if self.lora_adapter_capacity > 0 else self.lora_slots

    @property
    def free_slots(self) -> int:
        return max(self.slot_limit - self.inflight, 0)

    @property
    def available_blocks(self) -> int:
        return max(self.free_blocks - self.reserved_blocks, 0)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks a prompt of `num_tokens` needs for its prefill plus one generated token."""
        return -(-(num_tokens + 1) // max(self.block_size, 1))

    def can_accept(self, num_prompt_tokens: int) -> bool:
        if not self.ready or self.free_slots <= 0:
            return False
        # An idle engine takes any request it could ever fit; the engine itself refuses a
        # request that can never fit (RESOURCE_EXHAUSTED), so the router never waits forever.
        if self.inflight == 0:
            return True
        return self.blocks_for(num_prompt_tokens) <= self.available_blocks

    def take(self, num_prompt_tokens: int, adapter: str = "") -> None:
        """Count a request placed here (one call of a policy may place many)."""
        self.inflight += 1
        self.reserved_blocks += self.blocks_for(num_prompt_tokens)
        if adapter:
            self.adapters_inflight[adapter] = self.adapters_inflight.get(adapter, 0) + 1

    def release_adapter(self, adapter: str) -> None:
        """A request of `adapter` placed here finished (a no-op for the base model)."""
        count = self.adapters_inflight.get(adapter, 0)
        if count > 1:
            self.adapters_inflight[adapter] = count - 1
        else:
            self.adapters_inflight.pop(adapter, None)

    def warm(self, adapter: str) -> bool:
        """The adapter is resident, loading, or in flight here: placing it costs no new load."""
        return (
            adapter in self.adapters_inflight
            or adapter in self.resident_adapters
            or adapter in self.loading_adapters
        )

    def note_adapters(
        self,
        resident: tuple[str, ...],
        loading: tuple[str, ...],
        lora_slots: int,
        now: float,
        adapter_capacity: int = 0,
    ) -> None:
        """Take an engine's adapter report; time each adapter from loading to resident."""
        self.lora_slots = lora_slots
        self.lora_adapter_capacity = adapter_capacity
        for adapter in loading:
            self._loading_since.setdefault(adapter, now)
        for adapter in list(self._loading_since):
            if adapter in loading:
                continue
            started = self._loading_since.pop(adapter)
            if adapter in resident:
                took = now - started
                self.adapter_load_s = (
                    took if self.adapter_load_s <= 0 else 0.8 * self.adapter_load_s + 0.2 * took
                )
        self.resident_adapters = resident
        self.loading_adapters = loading

    def score(self) -> float:
        """Free capacity in [0, 1]: the tighter of free slots and free KV blocks."""
        slots = self.free_slots / self.slot_limit if self.slot_limit else 0.0
        blocks = self.available_blocks / self.total_blocks if self.total_blocks else 1.0
        return min(slots, blocks)


@dataclass(frozen=True)
class Placement:
    """Send `request` to engine `engine_id`."""

    request: object
    engine_id: str


class DispatchPolicy(Protocol):
    """Takes requests out of the queue and places them; called whenever anything changes."""

    def schedule(self, queue: AdmissionQueue, engines: list[EngineCapacity]) -> list[Placement]: ...


class LeastLoadedPolicy:
    """Queue order, each request to the engine with the most free capacity that can take it.

    The head of the queue is never overtaken: when no engine can take it, dispatch stops until
    capacity frees up (a later, smaller request would otherwise starve a long one).
    The policy updates the capacities it placed on (inflight, reserved blocks) so one call can
    place many requests consistently.
    """

    def schedule(self, queue: AdmissionQueue, engines: list[EngineCapacity]) -> list[Placement]:
        placements: list[Placement] = []
        while True:
            request = queue.peek()
            if request is None:
                break
            prompt_tokens = request.num_prompt_tokens
            candidates = [e for e in engines if e.can_accept(prompt_tokens)]
            if not candidates:
                break
            best = max(candidates, key=lambda e: (e.score(), -e.inflight, e.engine_id))
            queue.pop()
            best.take(prompt_tokens, getattr(request, "adapter", ""))
            placements.append(Placement(request, best.engine_id))
        return placements
