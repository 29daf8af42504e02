"""Prefix affinity: prompts that share leading KV blocks go to the same engine while it has
nearly as much room as the best; otherwise least-loaded placement wins."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.admission import AdmissionQueue
from services.router.dispatch import EngineCapacity
from services.router.lora_batcher import LoraAwarePolicy
from services.router.prefix_affinity import PrefixAffinity

SYSTEM_PROMPT = list(range(1000, 1064))  # four full 16-token blocks


@dataclass(eq=False)
class Item:
    prompt_token_ids: list[int] = field(default_factory=list)
    adapter: str = ""
    arrival: float = 0.0
    priority: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def expired(self, now: float | None = None) -> bool:
        return False


def engines(count: int = 2, seqs: int = 16) -> list[EngineCapacity]:
    return [
        EngineCapacity(
            engine_id=f"engine-{i}",
            ready=True,
            max_num_seqs=seqs,
            max_model_len=4096,
            total_blocks=10_000,
            free_blocks=10_000,
        )
        for i in range(count)
    ]


def place(policy: LoraAwarePolicy, pool: list[EngineCapacity], *items: Item) -> list[str]:
    queue = AdmissionQueue(max_requests=1000, max_tokens=10**6)
    for item in items:
        queue.admit(item)
    return [p.engine_id for p in policy.schedule(queue, pool)]


def test_a_shared_prefix_stays_on_one_engine_and_others_spread() -> None:
    policy, pool = LoraAwarePolicy(), engines()
    shared = [Item(SYSTEM_PROMPT + [i, i + 1]) for i in range(4)]
    assert len(set(place(policy, pool, *shared))) == 1
    # Without a shared prefix, least-loaded placement alternates.
    others = [Item([i] * 40) for i in range(4)]
    assert len(set(place(policy, engines(), *others))) == 2


def test_affinity_yields_to_a_much_emptier_engine() -> None:
    policy, pool = LoraAwarePolicy(), engines(seqs=4)
    first = place(policy, pool, Item(SYSTEM_PROMPT + [1]))[0]
    home = next(e for e in pool if e.engine_id == first)
    home.inflight = 3  # 1 of 4 slots left: far below the other engine
    assert place(policy, pool, Item(SYSTEM_PROMPT + [2])) != [first]


def test_prefix_keys_count_only_full_blocks_and_the_adapter() -> None:
    affinity = PrefixAffinity(max_prefix_tokens=32)
    assert affinity.key(list(range(15)), 16) is None  # no full block: nothing to reuse
    assert affinity.key(list(range(20)), 16) == affinity.key(list(range(16)) + [99] * 4, 16)
    assert affinity.key(list(range(64)), 16) == affinity.key(list(range(32)) + [7] * 32, 16)
    assert affinity.key(list(range(32)), 16, "a") != affinity.key(list(range(32)), 16, "b")


def test_the_map_is_bounded() -> None:
    affinity = PrefixAffinity(max_entries=2)
    for index in range(3):
        affinity.record(("", index), f"engine-{index}")
    pool = engines(3)
    assert affinity.choose(pool, ("", 0), pool[1]) is pool[1]  # evicted: no preference
    assert affinity.choose(pool, ("", 2), pool[1]) is pool[2]
