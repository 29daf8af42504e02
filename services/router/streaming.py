"""The per-token path: engine steps → detokenize messages → each request's channel.

For every `EngineStep` (all sequences of one engine, one forward step) the streamer sends one
`DetokenizeRequest` carrying the live requests' new token ids, and remembers which tokens,
logprobs and finish reasons went with each. The matching `DetokenizeResponse` (paired by
sequence number) turns into one `OutputPiece` per request, pushed into that request's own
channel (first tokens first), and reports the step's tokens to the router's pacing (pacing.py).

Engines gather the tokens of requests submitted with `hold_tokens` into updates of the pacing's
interval themselves (engine/coalesce.py): an update of several tokens is due at once. Tokens
whose text the pacing would only hold back (the response they belong to is not due yet: a
single-token update) stay in their request as ids instead, and go in the message of the step
that makes the response due, all together: at N tokens per response the tokenizer decodes each
request once per N steps, not every step, and the router handles 1/N of the deltas. First
tokens, the end, and requests with stop strings (a stop must be seen at the step that completes
it) always go at once; the pacing's hold limit sends overdue ones (`flush_undecoded`).

A request's first text also records where its time to first token went
(`sluice_router_first_token_phase_seconds`: tokenize, queue, engine, detokenize). A stop-string
hit ends the request (FINISH_REASON_STOP_STRING) and aborts it on the engine. Resource release
(engine slot, engine abort, detokenizer cancel) goes through `RequestReleaser`, which the
router core implements.
"""

from __future__ import annotations

import time
from typing import Protocol

from protos.sluice.v1 import common_pb2, engine_pb2, tokenizer_pb2
from services.common.errors import SluiceError
from services.router import metrics
from services.router.convert import detokenize_options
from services.router.pacing import StreamPacing
from services.router.request import OutputPiece, RouterRequest
from services.router.tokenizer_client import TokenizerClient, error_from_item

STOP_STRING = common_pb2.FINISH_REASON_STOP_STRING


def observe_first_token_phases(request: RouterRequest, text_at: float) -> None:
    """Record where the request's time to first token went (its first text is ready now)."""
    phase = metrics.ROUTER_FIRST_TOKEN_PHASE
    if request.tokenized_at:
        phase.labels(phase="tokenize").observe(request.tokenized_at - request.arrival)
    if request.placed_at:
        phase.labels(phase="queue").observe(
            request.placed_at - (request.tokenized_at or request.arrival)
        )
        if request.first_step_at:
            phase.labels(phase="engine").observe(request.first_step_at - request.placed_at)
    if request.first_step_at:
        phase.labels(phase="detokenize").observe(text_at - request.first_step_at)


class RequestReleaser(Protocol):
    def engine_finished(self, request: RouterRequest) -> None:
        """The engine is done with the request: give its slot back."""

    def end_request(self, request: RouterRequest, error: SluiceError | None) -> None:
        """Finish a request early: abort on the engine, cancel detokenizer state, fail it."""

    def capacity_changed(self) -> None:
        """Engine load changed: try to dispatch."""


class OutputStreamer:
    """Pairs engine steps with detokenizer responses; see the module docstring."""

    def __init__(
        self,
        running: dict[str, RouterRequest],
        tokenizer: TokenizerClient,
        releaser: RequestReleaser,
        pacing: StreamPacing | None = None,
    ) -> None:
        self._running = running
        self._tokenizer = tokenizer
        self._releaser = releaser
        self._pacing = pacing
        # sequence number -> [(request, token ids, logprobs, finish reason, usage or None)]
        self._pending: dict[int, list[tuple]] = {}

    def on_step(self, engine_id: str, step: engine_pb2.EngineStep) -> None:
        running = self._running
        now = time.monotonic()
        # One message for the step, first tokens or not: with most tokens held as ids the
        # tokenizer's work per message is small, and a message of their own for first tokens
        # cost more than it saved (A/B runs of benchmarks/stack_bench.py). Their pieces are
        # still pushed (and their servicers woken) before the others.
        message = tokenizer_pb2.DetokenizeRequest()
        first: list[tuple] = []
        rest: list[tuple] = []
        for update in step.updates:
            request = running.get(update.request_id)
            if request is None or request.finished or request.engine_done:
                continue
            if update.HasField("error") and update.error.code:
                request.engine_done = True
                self._releaser.engine_finished(request)
                error = error_from_item(update.error.code, update.error.message)
                self._releaser.end_request(request, error)
                continue
            is_first = not request.completion_tokens
            finish_reason = update.finish_reason
            token_ids = update.token_ids
            # Several tokens in one update: the engine held them by this router's pacing
            # (SubmitRequest.hold_tokens), so they are due now, not held a second time.
            count = len(token_ids)
            if not (
                is_first
                or finish_reason
                or request.params.stop
                or count > 1
                or request.text_due(count)
            ):
                request.hold_undecoded(token_ids, update.logprobs, now)
                continue
            ids, logprobs = request.take_undecoded(token_ids, update.logprobs)
            self._add(message, request, ids, finish_reason)
            if finish_reason:
                request.engine_done = True
                self._releaser.engine_finished(request)
            entry = (request, ids, logprobs, finish_reason, update.usage)
            if is_first:
                first.append(entry)
                request.first_step_at = request.first_step_at or now
            else:
                rest.append(entry)
        self._send(message, first + rest)
        self._releaser.capacity_changed()

    def flush_undecoded(self, held_before: float) -> None:
        """Send the tokens held as ids since before `held_before` (time.monotonic()) to the
        detokenizer in one message; their text goes to the client as soon as it is back."""
        message = tokenizer_pb2.DetokenizeRequest()
        record: list[tuple] = []
        for request in self._running.values():
            if request.undecoded_ids and request.undecoded_since < held_before:
                if request.finished:
                    request.take_undecoded()
                    continue
                ids, logprobs = request.take_undecoded()
                self._add(message, request, ids, 0)
                request.send_next_at_once()
                record.append((request, ids, logprobs, 0, None))
        self._send(message, record)

    @staticmethod
    def _add(
        message: tokenizer_pb2.DetokenizeRequest,
        request: RouterRequest,
        token_ids: list[int],
        finish_reason: int,
    ) -> None:
        item = message.updates.add(
            request_id=request.request_id, token_ids=token_ids, finished=bool(finish_reason)
        )
        if not request.detokenizer_open:
            item.options.CopyFrom(detokenize_options(request))
            request.detokenizer_open = True

    def _send(self, message: tokenizer_pb2.DetokenizeRequest, record: list[tuple]) -> None:
        """Send one detokenize message; `record` pairs its updates with their requests."""
        if record:
            message.sequence_number = self._tokenizer.next_sequence_number()
            self._pending[message.sequence_number] = record
            self._tokenizer.send(message)

    def on_detokenized(self, response: tokenizer_pb2.DetokenizeResponse) -> None:
        record = self._pending.pop(response.sequence_number, None)
        if record is None:
            return
        deltas = {delta.request_id: delta for delta in response.deltas}
        tokens = 0
        now = time.monotonic()
        for request, token_ids, logprobs, finish_reason, usage in record:
            if request.finished:
                continue
            if not request.completion_tokens:
                observe_first_token_phases(request, now)
            delta = deltas.get(request.request_id)
            if finish_reason:
                request.detokenizer_open = False  # told `finished`: it freed the state
            piece = OutputPiece(token_ids=token_ids)
            tokens += len(token_ids)
            if request.params.logprobs is not None:
                piece.logprobs = logprobs
            if delta is not None:
                if delta.HasField("error") and delta.error.code:
                    if delta.closed:
                        request.detokenizer_open = False
                    error = error_from_item(delta.error.code, delta.error.message)
                    self._releaser.end_request(request, error)
                    continue
                piece.text = delta.text
                if delta.closed:
                    request.detokenizer_open = False
                if delta.stop_hit:
                    finish_reason = STOP_STRING
                    piece.matched_stop = delta.matched_stop
            if finish_reason:
                piece.finish_reason = finish_reason
                piece.prompt_tokens = request.num_prompt_tokens
                if usage is not None:  # None: a hold-limit flush, not an engine step
                    piece.prompt_tokens = usage.prompt_tokens or piece.prompt_tokens
                    piece.cached_prompt_tokens = usage.cached_prompt_tokens
                piece.completion_tokens = request.completion_tokens + len(piece.token_ids)
                request.push(piece)
                # Stop string: the engine may still be generating; free everything now.
                self._releaser.end_request(request, None)
            else:
                request.push(piece)
        if self._pacing is not None:
            self._pacing.observe(tokens, now)

    def forget_pending(self, sequence_numbers: set[int]) -> list[RouterRequest]:
        """A detokenize session dropped: these unanswered messages will never come back. The
        requests they carried text for (a request's last message unpins it from its replica
        when sent, so only this says that its text is lost too)."""
        lost: dict[str, RouterRequest] = {}
        for sequence_number in sequence_numbers:
            for entry in self._pending.pop(sequence_number, ()):
                lost.setdefault(entry[0].request_id, entry[0])
        return list(lost.values())
