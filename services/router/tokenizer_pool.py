"""The router's tokenizer replicas: prompts spread over them, each request's text on one.

`--tokenizer a,b,c` names several tokenizer processes; one Python process must not be the
ceiling of a GPU host's token rate, and one crashed process must not stop the router. The pool
offers the router the interface of one `TokenizerClient` and keeps a client per replica:

- `tokenize` goes to the next ready replica (round robin); with none ready, to the first, whose
  client answers UNAVAILABLE;
- detokenize state is per stream, so each request is pinned to the replica that first receives
  its text options (round robin over ready replicas) until it finishes or is cancelled. The
  router still builds ONE `DetokenizeRequest` per engine step; `send` splits it by replica
  (unchanged when all its requests share one, the common case) and `on_response` is given one
  merged `DetokenizeResponse` per message, under the message's own sequence number;
- when a replica is lost, `on_lost(request_ids, sequence_numbers)` names only the requests
  pinned to it and the messages whose answers will never come; the other replicas' requests go
  on. The pool is ready (the router SERVING) while any replica is.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protos.sluice.v1 import tokenizer_pb2
from services.router.tokenizer_client import TokenizerClient

LostHandler = Callable[[set[str], set[int]], None]


@dataclass
class _Split:
    """A message sent in parts to several replicas; answered once every part is back."""

    response: tokenizer_pb2.DetokenizeResponse
    remaining: int


@dataclass
class _Replica:
    client: TokenizerClient
    requests: set[str] = field(default_factory=set)  # pinned here
    unanswered: set[int] = field(default_factory=set)  # sequence numbers sent, not answered


class TokenizerPool:
    """See the module docstring."""

    def __init__(
        self,
        addresses: Sequence[str],
        on_response: Callable[[tokenizer_pb2.DetokenizeResponse], None],
        on_lost: LostHandler,
        **client_options: float,
    ) -> None:
        if not addresses:
            raise ValueError("a tokenizer pool needs at least one address")
        self._on_response = on_response
        self._on_lost = on_lost
        self._replicas = [
            _Replica(
                TokenizerClient(
                    address,
                    lambda response, index=index: self._answered(index, response),
                    lambda index=index: self._lost(index),
                    **client_options,
                )
            )
            for index, address in enumerate(addresses)
        ]
        for replica in self._replicas:
            replica.client.ready_changed = self._ready_changed
        self._owner: dict[str, int] = {}  # request id -> replica index
        self._parent: dict[int, int] = {}  # part's sequence number -> the split message's
        self._splits: dict[int, _Split] = {}
        self._sequence_number = 0
        self._tokenize_turn = itertools.count()  # separate turns: pins alternate exactly
        self._pin_turn = itertools.count()
        self.ready_changed: Callable[[], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for replica in self._replicas:
            replica.client.start()

    async def close(self) -> None:
        for replica in self._replicas:
            await replica.client.close()

    @property
    def ready(self) -> bool:
        return any(replica.client.ready for replica in self._replicas)

    @property
    def clients(self) -> list[TokenizerClient]:
        return [replica.client for replica in self._replicas]

    def _ready_changed(self) -> None:
        if self.ready_changed is not None:
            self.ready_changed()

    def _next_ready(self, turn: itertools.count) -> int:
        count = len(self._replicas)
        start = next(turn)
        for offset in range(count):
            index = (start + offset) % count
            if self._replicas[index].client.ready:
                return index
        return start % count

    # ---- tokenize -----------------------------------------------------------------------------
    async def tokenize(self, item: tokenizer_pb2.TokenizeItem, *args, **kwargs) -> list[int]:
        """Encode one prompt on the next ready replica (see TokenizerClient.tokenize)."""
        client = self._replicas[self._next_ready(self._tokenize_turn)].client
        return await client.tokenize(item, *args, **kwargs)

    # ---- detokenize ---------------------------------------------------------------------------
    def next_sequence_number(self) -> int:
        self._sequence_number += 1
        return self._sequence_number

    def send(self, message: tokenizer_pb2.DetokenizeRequest) -> None:
        """Send one batched detokenize message, split by the replica each request is on."""
        parts: dict[int, list[tokenizer_pb2.DetokenizeUpdate]] = {}
        for update in message.updates:
            index = self._owner.get(update.request_id)
            if index is None:
                if update.cancel:
                    continue  # never reached a replica: nothing to free
                index = self._next_ready(self._pin_turn)
                self._owner[update.request_id] = index
                self._replicas[index].requests.add(update.request_id)
            if update.finished or update.cancel:
                self._unpin(update.request_id)
            parts.setdefault(index, []).append(update)
        if len(parts) == 1:
            (index,) = parts
            self._send_to(index, message)
            return
        if not parts:
            self._on_response(
                tokenizer_pb2.DetokenizeResponse(sequence_number=message.sequence_number)
            )
            return
        self._splits[message.sequence_number] = _Split(
            tokenizer_pb2.DetokenizeResponse(sequence_number=message.sequence_number), len(parts)
        )
        for index, updates in parts.items():
            part = tokenizer_pb2.DetokenizeRequest(
                updates=updates, sequence_number=self.next_sequence_number()
            )
            self._parent[part.sequence_number] = message.sequence_number
            self._send_to(index, part)

    def _send_to(self, index: int, message: tokenizer_pb2.DetokenizeRequest) -> None:
        replica = self._replicas[index]
        replica.unanswered.add(message.sequence_number)
        replica.client.send(message)

    def _unpin(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._replicas[index].requests.discard(request_id)

    def _answered(self, index: int, response: tokenizer_pb2.DetokenizeResponse) -> None:
        self._replicas[index].unanswered.discard(response.sequence_number)
        parent = self._parent.pop(response.sequence_number, None)
        if parent is None:
            self._on_response(response)
            return
        split = self._splits[parent]
        split.response.deltas.extend(response.deltas)
        self._part_done(parent, split)

    def _part_done(self, parent: int, split: _Split) -> None:
        split.remaining -= 1
        if split.remaining == 0:
            del self._splits[parent]
            self._on_response(split.response)

    def _lost(self, index: int) -> None:
        """Replica `index` went away: its requests fail; split messages finish without it."""
        replica = self._replicas[index]
        lost_requests, replica.requests = replica.requests, set()
        for request_id in lost_requests:
            self._owner.pop(request_id, None)
        lost_messages: set[int] = set()
        for sequence_number in replica.unanswered:
            parent = self._parent.pop(sequence_number, None)
            if parent is None:
                lost_messages.add(sequence_number)
            else:
                self._part_done(parent, self._splits[parent])
        replica.unanswered = set()
        self._on_lost(lost_requests, lost_messages)
