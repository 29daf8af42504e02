"""Prefix affinity: a prompt that starts like a recent one goes where that one went.

Each engine keeps a prefix cache of KV blocks (hashed per adapter). With several engines,
least-loaded placement alone scatters requests that share a system prompt or a conversation's
history over all engines, and each engine computes the shared blocks again. `PrefixAffinity`
remembers, for the leading full KV blocks of recent prompts (up to `max_prefix_tokens`), the
engine each was placed on, and the dispatch policy prefers that engine while its free capacity
is within `slack` of the best candidate's, so affinity never piles load on one engine.
Plain Python: no gRPC, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.dispatch import EngineCapacity


class PrefixAffinity:
    """A bounded LRU map from prompt prefixes to the engine they were last placed on."""

    def __init__(
        self, *, max_prefix_tokens: int = 256, max_entries: int = 65_536, slack: float = 0.25
    ) -> None:
        self.max_prefix_tokens = max_prefix_tokens
        self.max_entries = max_entries
        self.slack = slack
        self._homes: OrderedDict[tuple[str, int], str] = OrderedDict()

    def key(
        self, prompt_token_ids: Sequence[int], block_size: int, adapter: str = ""
    ) -> tuple[str, int] | None:
        """The prefix identity: the adapter and a hash of the leading full KV blocks (None when
        the prompt fills no block: nothing reusable)."""
        block_size = max(block_size, 1)
        length = min(len(prompt_token_ids), self.max_prefix_tokens) // block_size * block_size
        if length == 0:
            return None
        return adapter, hash(tuple(prompt_token_ids[:length]))

    def choose(
        self, candidates: list[EngineCapacity], key: tuple[str, int] | None, best: EngineCapacity
    ) -> EngineCapacity:
        """`best`, unless the prefix's home is a candidate with nearly as much free capacity."""
        home_id = self._homes.get(key) if key is not None else None
        if home_id is None or home_id == best.engine_id:
            return best
        for engine in candidates:
            if engine.engine_id == home_id and engine.score() >= best.score() - self.slack:
                return engine
        return best

    def record(self, key: tuple[str, int] | None, engine_id: str) -> None:
        if key is None:
            return
        self._homes[key] = engine_id
        self._homes.move_to_end(key)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)
