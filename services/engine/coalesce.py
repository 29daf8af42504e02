"""Gather a request's tokens of several steps into one update, as the router's pacing asks.

Under load the router sends each client a response per `interval` tokens (router/pacing.py).
Without help from the engine it still receives, parses and holds one update per request per
step, and at a few hundred streams that per-update work is most of its CPU. A router session
therefore tells the engine its pacing (EngineRequest.pacing), and marks the requests whose
tokens may wait (SubmitRequest.hold_tokens: not those with stop strings, whose text is checked
every step). For those, this class holds each step's delta until `interval` tokens have
gathered, merging them into one delta; a request's first tokens, its end (finish or error) and
tokens held longer than `max_hold_s` go at once. Plain Python over SequenceDelta: no gRPC.
"""

from __future__ import annotations

import dataclasses

from services.engine.outputs import SequenceDelta

DEFAULT_MAX_HOLD_S = 0.1


@dataclasses.dataclass
class _Held:
    delta: SequenceDelta  # the merged delta so far (its own lists)
    since: float  # when its oldest token came (time.monotonic())


class TokenCoalescer:
    """One session's held tokens, keyed by the request ids the router sent."""

    def __init__(self) -> None:
        self.interval = 1
        self.max_hold_s = DEFAULT_MAX_HOLD_S
        self._may_hold: set[str] = set()
        self._held: dict[str, _Held] = {}

    def set_pacing(self, tokens_per_update: int, max_hold_ms: int) -> None:
        """The router's pacing (EngineRequest.pacing); 0 tokens per update counts as 1."""
        self.interval = max(1, tokens_per_update)
        if max_hold_ms > 0:
            self.max_hold_s = max_hold_ms / 1e3

    def allow(self, request_id: str) -> None:
        """The request's tokens may be held (SubmitRequest.hold_tokens)."""
        self._may_hold.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request is over (finished, aborted): drop whatever it held."""
        self._may_hold.discard(request_id)
        self._held.pop(request_id, None)

    def take(self, request_id: str, delta: SequenceDelta, now: float) -> SequenceDelta | None:
        """What to send for this step's `delta` of `request_id` now (merged with the tokens it
        held), or None when it is held for a later update."""
        held = self._held.get(request_id)
        if held is not None:
            _absorb(held.delta, delta)
            delta = held.delta
        if request_id not in self._may_hold or self.interval <= 1 or _due(delta, self.interval):
            if held is not None:
                del self._held[request_id]
            if delta.finished or delta.error:
                self.forget(request_id)
            return delta
        if held is None:  # the held delta is its own: the engine's objects are not kept
            self._held[request_id] = _Held(_copy(delta), now)
        return None

    def overdue(self, now: float) -> list[tuple[str, SequenceDelta]]:
        """Take the deltas held since before `now - max_hold_s`."""
        limit = now - self.max_hold_s
        late = [rid for rid, held in self._held.items() if held.since <= limit]
        return [(rid, self._held.pop(rid).delta) for rid in late]

    @property
    def holding(self) -> int:
        """Requests with tokens held now."""
        return len(self._held)


def _due(delta: SequenceDelta, interval: int) -> bool:
    """Sent at once: the end, an error, the first tokens, or a full update's worth."""
    if delta.finished or delta.error or delta.finish_reason is not None:
        return True
    first = delta.num_output_tokens <= len(delta.new_token_ids)
    return first or len(delta.new_token_ids) >= interval


# SequenceDelta's fields besides its two lists, copied as they are (see _absorb).
_SCALAR_FIELDS = tuple(
    field.name
    for field in dataclasses.fields(SequenceDelta)
    if field.name not in ("new_token_ids", "logprobs")
)


def _copy(delta: SequenceDelta) -> SequenceDelta:
    """`delta` with lists of its own (cheaper than dataclasses.replace, once per held step)."""
    clone = SequenceDelta(
        delta.request_id,
        list(delta.new_token_ids),
        list(delta.logprobs) if delta.logprobs else None,
    )
    for name in _SCALAR_FIELDS:
        setattr(clone, name, getattr(delta, name))
    return clone


def _absorb(held: SequenceDelta, new: SequenceDelta) -> None:
    """`held` followed by `new`, in place: tokens and logprobs joined, the rest as of `new`."""
    held.new_token_ids.extend(new.new_token_ids)
    if new.logprobs:
        held.logprobs = (held.logprobs or []) + list(new.logprobs)
    for name in _SCALAR_FIELDS:
        setattr(held, name, getattr(new, name))
