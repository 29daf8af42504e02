"""The bounded admission queue: requests admitted but not yet placed on an engine.

Bounded twice, by request count and by queued prompt tokens, so a burst of long prompts cannot
hold the router's memory hostage. A request over either bound is rejected at once with
RESOURCE_EXHAUSTED and a retry-after hint (the time the queue needs to drain at its recent
dispatch rate, never below the configured floor). Order: lower priority value first, then
arrival. Removal of a cancelled or expired request is O(1) (lazy deletion in the heap).
Beside the one order, each LoRA adapter (and the base model, adapter "") has its own queue in
the same order: `heads()` gives each adapter's first request and `take` removes any request, so
the LoRA batcher (lora_batcher.py) serves adapters without one blocking another.
Plain Python: no gRPC, no torch, so the policy is unit-tested in milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from typing import Protocol

from services.common.errors import InvalidArgumentError, ResourceExhaustedError

MAX_RETRY_AFTER_S = 60.0


class Queueable(Protocol):
    """What the queue needs of a request."""

    priority: int
    num_prompt_tokens: int

    def expired(self, now: float | None = None) -> bool: ...


class AdmissionQueue:
    """Priority-then-FIFO queue bounded by request count and by prompt tokens."""

    def __init__(
        self, max_requests: int, max_tokens: int, *, min_retry_after_s: float = 1.0
    ) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise InvalidArgumentError("queue bounds must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.min_retry_after_s = min_retry_after_s
        self._heap: list[tuple[int, int, Queueable]] = []
        self._groups: dict[str, list[tuple[int, int, Queueable]]] = {}  # adapter -> its heap
        self._group_sizes: dict[str, int] = {}
        self._live: dict[int, Queueable] = {}  # id(request) -> request
        self._counter = itertools.count()
        self._tokens = 0
        self._dispatch_rate = 0.0  # requests per second, exponentially averaged
        self._last_pop: float | None = None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: object) -> bool:
        return id(request) in self._live

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    def ahead_of(self, priority: int) -> tuple[int, int]:
        """(requests, prompt tokens) queued that go before a new request of `priority`."""
        if not self._live:
            return 0, 0
        count = tokens = 0
        for request in self._live.values():
            if request.priority <= priority:
                count += 1
                tokens += request.num_prompt_tokens
        return count, tokens

    def retry_after_s(self) -> float:
        """How long a rejected client should wait before trying again."""
        if self._dispatch_rate <= 0.0:
            return self.min_retry_after_s
        drain = len(self) / self._dispatch_rate
        return min(max(self.min_retry_after_s, drain), MAX_RETRY_AFTER_S)

    def check_room(self, num_tokens: int = 0) -> None:
        """Raise ResourceExhaustedError when one more request of `num_tokens` would not fit."""
        if len(self) + 1 > self.max_requests:
            raise ResourceExhaustedError(
                f"the router's queue is full ({self.max_requests} requests waiting); retry later",
                retry_after_s=self.retry_after_s(),
            )
        if num_tokens > self.max_tokens:
            raise ResourceExhaustedError(
                f"the prompt has {num_tokens} tokens; the router queues at most "
                f"{self.max_tokens} prompt tokens",
                retry_after_s=self.retry_after_s(),
            )
        if self._tokens + num_tokens > self.max_tokens:
            raise ResourceExhaustedError(
                f"the router's queue is full ({self._tokens} prompt tokens waiting); retry later",
                retry_after_s=self.retry_after_s(),
            )

    def admit(self, request: Queueable) -> None:
        """Add a request or raise ResourceExhaustedError (the queue is unchanged then)."""
        if id(request) in self._live:
            raise InvalidArgumentError("request already queued")
        self.check_room(request.num_prompt_tokens)
        self._live[id(request)] = request
        self._tokens += request.num_prompt_tokens
        entry = (request.priority, next(self._counter), request)
        heapq.heappush(self._heap, entry)
        adapter = _adapter_of(request)
        heapq.heappush(self._groups.setdefault(adapter, []), entry)
        self._group_sizes[adapter] = self._group_sizes.get(adapter, 0) + 1

    def remove(self, request: Queueable) -> bool:
        """Take a request out (cancelled, expired); False when it was not queued."""
        if self._live.pop(id(request), None) is None:
            return False
        self._tokens -= request.num_prompt_tokens
        self._shrink_group(request)
        self._trim()
        return True

    def take(self, request: Queueable) -> None:
        """Take out a request being dispatched, wherever it is in the order."""
        if self.remove(request):
            self._note_dispatch()

    def heads(self) -> list[tuple[tuple[int, int], Queueable]]:
        """Each adapter's first request with its order key (priority, arrival), in order."""
        heads = []
        for adapter in list(self._groups):
            head = self.head(adapter)
            if head is not None:
                heads.append(head)
        heads.sort(key=lambda item: item[0])
        return heads

    def head(self, adapter: str) -> tuple[tuple[int, int], Queueable] | None:
        """The adapter's first request with its order key, or None when none is queued."""
        group = self._groups.get(adapter)
        while group and id(group[0][2]) not in self._live:
            heapq.heappop(group)
        if not group:
            self._groups.pop(adapter, None)
            return None
        priority, sequence, request = group[0]
        return (priority, sequence), request

    def depth_by_adapter(self) -> dict[str, int]:
        """Queued requests per adapter ("" for the base model)."""
        return dict(self._group_sizes)

    def peek(self) -> Queueable | None:
        self._trim()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Queueable:
        """The next request in order (raises IndexError when empty)."""
        self._trim()
        _, _, request = heapq.heappop(self._heap)
        del self._live[id(request)]
        self._tokens -= request.num_prompt_tokens
        self._shrink_group(request)
        self._note_dispatch()
        return request

    def ordered(self) -> Iterator[Queueable]:
        """The queued requests in dispatch order (a snapshot)."""
        return iter([entry[2] for entry in sorted(self._heap) if id(entry[2]) in self._live])

    def drop_expired(self, now: float | None = None) -> list[Queueable]:
        """Remove and return every queued request whose deadline has passed."""
        now = time.monotonic() if now is None else now
        expired = [r for r in self._live.values() if r.expired(now)]
        for request in expired:
            self.remove(request)
        return expired

    def _shrink_group(self, request: Queueable) -> None:
        adapter = _adapter_of(request)
        left = self._group_sizes.get(adapter, 0) - 1
        if left > 0:
            self._group_sizes[adapter] = left
        else:
            self._group_sizes.pop(adapter, None)
            self._groups.pop(adapter, None)

    def _trim(self) -> None:
        heap = self._heap
        while heap and id(heap[0][2]) not in self._live:
            heapq.heappop(heap)
        if not self._live and heap:
            heap.clear()

    def _note_dispatch(self) -> None:
        now = time.monotonic()
        if self._last_pop is not None:
            interval = max(now - self._last_pop, 1e-4)
            rate = 1.0 / interval
            self._dispatch_rate = 0.9 * self._dispatch_rate + 0.1 * rate
        self._last_pop = now


def _adapter_of(request: Queueable) -> str:
    """The request's LoRA adapter ("" for the base model, or for items that name none)."""
    return getattr(request, "adapter", "") or ""
