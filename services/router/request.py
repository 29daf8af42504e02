"""One request's life inside the router: state machine, deadline, and its own output channel.

States: QUEUED (admitted, waiting for an engine) → RUNNING (submitted to an engine) →
FINISHED (the last response is in the channel, or an error). Any state may go to FINISHED;
nothing leaves FINISHED. The servicer awaits only this request's channel; the engine pool and
detokenizer push into it from their reader tasks, so no servicer ever waits on another request.

The channel is a list plus one future (cheaper than asyncio.Queue on the per-token path). When
the client reads slower than engine steps arrive, pending pieces are merged (`absorb`) into
the one response that goes next.
After the first response, pieces are held until the router's pacing (pacing.py: a fixed
`--stream-interval` N, or N adapted to the router's token rate) has N new tokens pending; the
end, an error, the deadline and the pacing's hold limit (`flush_held`) always flush. So each
response carries about N tokens: fewer gRPC messages per token for the router and its
clients, at the price of burstier streaming. The same holds before the text exists: a step's
tokens that would only be held wait as ids (`hold_undecoded`) and go to the detokenizer
together once the response they belong to is due (streaming.py).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from services.common.errors import SluiceError
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.sampling_params import SamplingParams
from services.router.pacing import StreamPacing

ONE_TOKEN_PER_RESPONSE = StreamPacing.fixed(1)


class RequestState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


_ALLOWED = {
    RequestState.QUEUED: {RequestState.RUNNING, RequestState.FINISHED},
    RequestState.RUNNING: {RequestState.FINISHED},
    RequestState.FINISHED: set(),
}


class IllegalTransitionError(RuntimeError):
    """A bug: the router tried to move a request along an edge the state machine lacks."""


@dataclass(slots=True)
class OutputPiece:
    """What one engine step (or several merged) produced for this request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # protobuf TokenLogprob messages
    finish_reason: int = 0  # sluice.v1.FinishReason value; 0 while running
    matched_stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


_TIMED_OUT = object()  # a waiter's result when next_piece's timeout passed


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(_TIMED_OUT)


@dataclass(eq=False)
class RouterRequest:
    """A request admitted by the router. `request_id` is the router's own unique id."""

    request_id: str
    client_request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str = ""
    adapter_record: AdapterRecord | None = None  # the registered adapter, as of admission
    priority: int = 0
    deadline: float | None = None  # time.monotonic() seconds
    arrival: float = field(default_factory=time.monotonic)
    # When it got its prompt ids (0: it came with them), its engine, its first engine step
    # (time.monotonic()): the phases of its time to first token.
    tokenized_at: float = 0.0
    placed_at: float = 0.0
    first_step_at: float = 0.0
    state: RequestState = RequestState.QUEUED
    engine_id: str | None = None
    completion_tokens: int = 0
    # Where the request's resources live, so cleanup releases each exactly once.
    holds_engine_slot: bool = False  # counted in its engine's inflight
    engine_done: bool = False  # the engine has finished or dropped it (no abort needed)
    detokenizer_open: bool = False  # the detokenizer holds state for it
    pacing: StreamPacing = ONE_TOKEN_PER_RESPONSE  # tokens a response gathers (the first: 1)
    # Tokens of engine steps not yet sent to the detokenizer, their logprobs, and when the
    # oldest came (time.monotonic()): held while the pacing would hold their text anyway
    # (streaming.py), so each is decoded in a batch of about a response's worth.
    undecoded_ids: list[int] = field(default_factory=list)
    undecoded_logprobs: list = field(default_factory=list)
    undecoded_since: float = 0.0
    _pending: OutputPiece | None = None  # what the next response carries (pieces merged)
    _pending_tokens: int = 0  # tokens in _pending
    _send_at: int = 1  # pending tokens that make the next response due
    _held_since: float | None = None  # when the oldest held-back piece arrived
    _error: SluiceError | None = None
    _waiter: asyncio.Future | None = None
    _loop: asyncio.AbstractEventLoop | None = None  # the consumer's (asked once, not per piece)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def expired(self, now: float | None = None) -> bool:
        if self.deadline is None:
            return False
        return (time.monotonic() if now is None else now) >= self.deadline

    def remaining(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.monotonic() if now is None else now)

    def transition(self, new_state: RequestState) -> None:
        if new_state not in _ALLOWED[self.state]:
            raise IllegalTransitionError(
                f"request {self.request_id}: {self.state.value} -> {new_state.value}"
            )
        self.state = new_state

    def mark_running(self, engine_id: str) -> None:
        self.transition(RequestState.RUNNING)
        self.engine_id = engine_id

    # ---- producers (engine pool / detokenizer reader tasks) ----------------------------------
    def push(self, piece: OutputPiece) -> None:
        """Add a piece; a piece with a finish reason ends the request."""
        if self.finished:
            return
        tokens = len(piece.token_ids)
        self.completion_tokens += tokens
        self._pending_tokens += tokens
        if self._pending is None:
            self._pending = piece
        else:
            absorb(self._pending, piece)
        if piece.finish_reason:
            self.state = RequestState.FINISHED
        elif self._pending_tokens < self._send_at:
            if self._held_since is None:
                self._held_since = time.monotonic()
            return  # held back (pacing): no need to wake the reader yet
        self._wake()

    def text_due(self, new_tokens: int) -> bool:
        """Would `new_tokens` more (after those held undecoded) make the next response due?"""
        return self._pending_tokens + len(self.undecoded_ids) + new_tokens >= self._send_at

    def hold_undecoded(self, token_ids, logprobs, now: float) -> None:
        """Keep a step's tokens (and logprobs) for a later detokenize message."""
        if not self.undecoded_ids:
            self.undecoded_since = now
        self.undecoded_ids += token_ids
        if logprobs:
            self.undecoded_logprobs += logprobs

    def take_undecoded(self, token_ids=(), logprobs=()) -> tuple[list[int], list]:
        """The held tokens and logprobs followed by `token_ids`/`logprobs`; nothing stays held."""
        ids = self.undecoded_ids + list(token_ids)
        probs = self.undecoded_logprobs + list(logprobs)
        self.undecoded_ids = []
        self.undecoded_logprobs = []
        return ids, probs

    def send_next_at_once(self) -> None:
        """The next piece pushed goes out at once, whatever the pacing says."""
        self._send_at = 0

    def flush_held(self, held_before: float) -> None:
        """Send held-back pieces now if the oldest arrived before `held_before` (monotonic s)."""
        since = self._held_since
        if since is not None and since < held_before and self._pending is not None:
            self._send_at = 0
            self._wake()

    def fail(self, error: SluiceError) -> bool:
        """End the request with an error; False when it had already finished."""
        if self.finished:
            return False
        self.state = RequestState.FINISHED
        self._error = error
        self._wake()
        return True

    def close(self) -> None:
        """End the request without a further piece (cancelled: nobody reads it any more)."""
        if not self.finished:
            self.state = RequestState.FINISHED
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- consumer (the servicer) ------------------------------------------------------------
    async def next_piece(self, timeout_s: float | None = None) -> OutputPiece | None:
        """The next output (merged if several are pending); None once everything was read.

        Raises the request's error once its pieces before it are read, and TimeoutError when
        `timeout_s` passes with nothing new.
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        while self._pending is None or (
            self._pending_tokens < self._send_at and self.state is not RequestState.FINISHED
        ):
            if self._pending is None:
                if self._error is not None:
                    raise self._error
                if self.finished:
                    return None
            waiter = self._waiter = loop.create_future()
            # A timer on the loop, not asyncio.wait_for (a future, a callback and a timer more
            # per piece): it resolves the waiter with _TIMED_OUT when the time is up.
            timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if waiter.result() is _TIMED_OUT:
                if self._pending is None:
                    raise TimeoutError
                break  # the deadline: send what is held back first
        piece = self._pending
        self._pending = None
        self._pending_tokens = 0
        self._send_at = self.pacing.interval
        self._held_since = None
        return piece


def absorb(into: OutputPiece, piece: OutputPiece) -> None:
    """Append `piece` to `into` in place: text, tokens and logprobs after its own; its ending."""
    into.text += piece.text
    into.token_ids += piece.token_ids
    if piece.logprobs:
        into.logprobs += piece.logprobs
    into.finish_reason = piece.finish_reason
    into.matched_stop = piece.matched_stop
    into.prompt_tokens = piece.prompt_tokens
    into.completion_tokens = piece.completion_tokens
    into.cached_prompt_tokens = piece.cached_prompt_tokens
