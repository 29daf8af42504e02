"""The state of one DetokenizeSession stream: many requests decoded side by side.

The router sends one message per engine step with updates for many requests; `handle` applies
them in order and returns one `Delta` per update that produced text, a state change or an error.
A request is created by its first update (the one with options), decoded incrementally
(detokenize.py), filtered for stop strings (stop_strings.py), and freed when it finishes, is
cancelled, or hits a stop. Errors are per update: one bad request never fails the others.
Updates that arrive for a request this session already closed (the engine had generated a few
more tokens before the router's abort landed) are dropped quietly; a bounded memory of recently
closed ids tells them apart from unknown ids (NOT_FOUND). `close()` frees everything when the
stream ends. Plain Python, no gRPC: server.py converts protobuf to and from these objects.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    SluiceError,
)
from services.tokenizer.detokenize import Decode, IncrementalDetokenizer
from services.tokenizer.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """How to decode one request (given with its first update)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_tail_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Update:
    """New tokens (or the end) of one request."""

    request_id: str
    token_ids: Sequence[int] = ()
    options: DecodeOptions | None = None
    finished: bool = False
    cancel: bool = False


@dataclass(slots=True)
class Delta:
    """What one update produced."""

    request_id: str
    text: str = ""
    stop_hit: bool = False
    matched_stop: str = ""
    closed: bool = False
    error_code: str = ""
    error_message: str = ""


@dataclass(slots=True)
class _RequestState:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on what one stream may hold."""

    max_requests: int = 4096
    max_stop_strings: int = 16
    max_stop_length: int = 256


class DetokenizeSession:
    """Per-stream state of many requests (see the module docstring)."""

    def __init__(self, decode: Decode, vocab_size: int, limits: SessionLimits | None = None):
        self._decode = decode
        self._vocab_size = vocab_size
        self._limits = limits or SessionLimits()
        self._requests: dict[str, _RequestState] = {}
        self._recently_closed: OrderedDict[str, None] = OrderedDict()
        self._recently_closed_cap = 4 * self._limits.max_requests

    @property
    def live_requests(self) -> int:
        """Requests holding state right now."""
        return len(self._requests)

    def handle(self, updates: Iterable[Update]) -> list[Delta]:
        """Apply one message's updates in order; return the deltas worth sending."""
        deltas: list[Delta] = []
        for update in updates:
            try:
                delta = self._apply(update)
            except SluiceError as exc:
                delta = Delta(update.request_id, error_code=exc.code, error_message=exc.message)
            except Exception:  # noqa: BLE001 - one broken request must not end the stream
                log.exception("detokenizing request %s failed", update.request_id)
                self._forget(update.request_id)
                delta = Delta(
                    update.request_id,
                    closed=True,
                    error_code="INTERNAL",
                    error_message="internal error while detokenizing",
                )
            if delta is not None:
                deltas.append(delta)
        return deltas

    def close(self) -> None:
        """Free every request (the stream ended)."""
        self._requests.clear()
        self._recently_closed.clear()

    def _apply(self, update: Update) -> Delta | None:
        request_id = update.request_id
        if not request_id:
            raise InvalidArgumentError("an update needs a request_id")
        if update.cancel:
            self._close(request_id)
            return Delta(request_id, closed=True)
        state = self._requests.get(request_id)
        if update.options is not None:
            if state is not None:
                raise AlreadyExistsError(f"request {request_id!r} is already being decoded")
            state = self._create(request_id, update.options)
        elif state is None:
            if request_id in self._recently_closed:
                return None  # tokens generated after a stop hit, before the abort landed
            raise NotFoundError(f"unknown request {request_id!r} (no options on its first update)")
        text = state.detokenizer.add(update.token_ids) if update.token_ids else ""
        emitted, matched = state.stops.feed(text)
        if matched is None and update.finished:
            rest, matched = state.stops.feed(state.detokenizer.flush())
            emitted += rest
            if matched is None:
                emitted += state.stops.flush()
        if matched is not None:
            self._close(request_id)
            return Delta(request_id, emitted, stop_hit=True, matched_stop=matched, closed=True)
        if update.finished:
            self._close(request_id)
            return Delta(request_id, emitted, closed=True)
        if emitted:
            return Delta(request_id, emitted)
        return None

    def _create(self, request_id: str, options: DecodeOptions) -> _RequestState:
        if len(self._requests) >= self._limits.max_requests:
            raise ResourceExhaustedError(
                f"this session already decodes {len(self._requests)} requests "
                f"(limit {self._limits.max_requests})"
            )
        stops = StopStringMatcher(
            options.stop,
            include_stop_str_in_output=options.include_stop_str_in_output,
            max_stops=self._limits.max_stop_strings,
            max_length=self._limits.max_stop_length,
        )
        detokenizer = IncrementalDetokenizer(
            self._decode,
            self._vocab_size,
            skip_special_tokens=options.skip_special_tokens,
            prompt_tail_ids=options.prompt_tail_ids,
        )
        state = _RequestState(detokenizer, stops)
        self._requests[request_id] = state
        self._recently_closed.pop(request_id, None)
        return state

    def _close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        closed = self._recently_closed
        closed[request_id] = None
        closed.move_to_end(request_id)
        while len(closed) > self._recently_closed_cap:
            closed.popitem(last=False)

    def _forget(self, request_id: str) -> None:
        # After an unexpected failure the request's state is dropped, not remembered as closed.
        self._requests.pop(request_id, None)
