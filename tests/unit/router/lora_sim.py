"""A discrete-time simulation of engines with LoRA slots fed by a router dispatch policy.

Requests of adapters drawn from a Zipf mix arrive as a Poisson process; every tick the policy
places queued requests; an engine runs each placed request for its service time (plus the
adapter's load time when the adapter was not resident in one of its slots) and then frees it.
Resident adapters are the engine's LRU over its slots. Used by the fairness tests: the router's
real `AdmissionQueue` and policy, a simulated clock, no processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.router.admission import AdmissionQueue
from services.router.dispatch import EngineCapacity
from tests.fake_clock import FakeClock


@dataclass(eq=False)
class SimRequest:
    adapter: str
    arrival: float
    service_s: float
    num_prompt_tokens: int = 16
    priority: int = 0
    placed_at: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return False


@dataclass
class SimEngine:
    capacity: EngineCapacity
    load_s: float
    running: list[tuple[float, SimRequest]] = field(default_factory=list)  # (ends_at, request)
    lru: list[str] = field(default_factory=list)  # resident adapters, most recent last

    def start(self, request: SimRequest, now: float) -> None:
        extra = 0.0
        if request.adapter and request.adapter not in self.lru:
            extra = self.load_s
            in_flight = set(self.capacity.adapters_inflight)
            evictable = [a for a in self.lru if a not in in_flight]
            if len(self.lru) >= self.capacity.lora_slots and evictable:
                self.lru.remove(evictable[0])
        if request.adapter:
            if request.adapter in self.lru:
                self.lru.remove(request.adapter)
            self.lru.append(request.adapter)
        self.running.append((now + extra + request.service_s, request))
        self.capacity.resident_adapters = tuple(self.lru)

    def finish_until(self, now: float) -> None:
        still = []
        for ends_at, request in self.running:
            if ends_at <= now:
                self.capacity.inflight -= 1
                self.capacity.release_adapter(request.adapter)
            else:
                still.append((ends_at, request))
        self.running = still


def zipf_weights(count: int, exponent: float) -> list[float]:
    weights = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass
class SimResult:
    requests: list[SimRequest]
    max_distinct_inflight: int

    @property
    def waits(self) -> list[float]:
        return [r.placed_at - r.arrival for r in self.requests if r.placed_at is not None]

    @property
    def unplaced(self) -> int:
        return sum(r.placed_at is None for r in self.requests)

    def longest_wait_by_adapter(self) -> dict[str, float]:
        longest: dict[str, float] = {}
        for r in self.requests:
            if r.placed_at is not None:
                longest[r.adapter] = max(longest.get(r.adapter, 0.0), r.placed_at - r.arrival)
        return longest


def simulate(
    policy,
    *,
    adapters: int = 8,
    slots: int = 2,
    engines: int = 1,
    max_num_seqs: int = 8,
    rate_per_s: float = 25.0,
    duration_s: float = 60.0,
    service_s: tuple[float, float] = (0.05, 0.3),
    load_s: float = 0.02,
    zipf_exponent: float = 1.1,
    base_share: float = 0.0,
    tick_s: float = 0.01,
    seed: int = 7,
) -> SimResult:
    """Run the policy over a Zipf mix; `policy` must read the clock of `simulate.now`."""
    rng = random.Random(seed)
    names = [f"adapter-{i}" for i in range(adapters)]
    weights = zipf_weights(adapters, zipf_exponent)
    sim_engines = [
        SimEngine(
            EngineCapacity(
                engine_id=f"engine-{e}",
                ready=True,
                max_num_seqs=max_num_seqs,
                max_model_len=4096,
                block_size=16,
                total_blocks=100_000,
                free_blocks=100_000,
                lora_slots=slots,
            ),
            load_s,
        )
        for e in range(engines)
    ]
    by_id = {e.capacity.engine_id: e for e in sim_engines}
    queue = AdmissionQueue(max_requests=1_000_000, max_tokens=10**9)
    requests: list[SimRequest] = []
    next_arrival = rng.expovariate(rate_per_s)
    max_distinct = 0
    now = 0.0
    while now < duration_s or len(queue):
        clock.now = now
        while next_arrival <= now and next_arrival < duration_s:
            adapter = "" if rng.random() < base_share else rng.choices(names, weights)[0]
            request = SimRequest(adapter, next_arrival, rng.uniform(*service_s))
            requests.append(request)
            queue.admit(request)
            next_arrival += rng.expovariate(rate_per_s)
        for engine in sim_engines:
            engine.finish_until(now)
            engine.capacity.reserved_blocks = 0
        for placement in policy.schedule(queue, [e.capacity for e in sim_engines]):
            placement.request.placed_at = now
            by_id[placement.engine_id].start(placement.request, now)
        for engine in sim_engines:
            max_distinct = max(max_distinct, len(engine.capacity.adapters_inflight))
        now += tick_s
        if now > duration_s * 10:
            break
    return SimResult(requests, max_distinct)


clock = FakeClock()
