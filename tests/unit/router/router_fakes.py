"""In-process fake Engine and Tokenizer gRPC services, so the router is tested in milliseconds.

The fakes follow the real protocol (batched EngineSession, multiplexed DetokenizeSession) with
trivial models: a "token" is one ASCII character; the engine generates 'a', 'b', 'c', ...
cyclically, one token per step for every live request. Both record what the router asked
(submits, aborts, cancels) so tests can assert on resource release.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from protos.sluice.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

VOCAB_SIZE = 256


def char_of(token_id: int) -> str:
    return chr(token_id) if 32 <= token_id < 127 else ""


def generated_text(count: int) -> str:
    return "".join(chr(ord("a") + i % 26) for i in range(count))


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, *, max_model_len: int = 128, max_num_seqs: int = 8, step_s: float = 0.002):
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.live: dict[str, list] = {}  # id -> [generated, max_tokens, prompt_len, session]
        self.sessions = 0
        # LoRA: InspectAdapter answers from `adapter_dirs` (path -> AdapterSpec, or a
        # (StatusCode, details) refusal); submits' adapter specs are kept; the load reports
        # `lora_slots`, `lora_adapter_capacity`, and the adapters of live requests as resident
        # (the first `lora_slots` of them by name: the others wait for a slot, time-sliced).
        self.adapter_dirs: dict[str, object] = {}
        self.inspected: list[tuple[str, str]] = []
        self.submitted_specs: dict[str, engine_pb2.SubmitRequest] = {}
        self.lora_slots = 0
        self.lora_adapter_capacity = 0

    async def Info(self, request, context):  # noqa: N802
        return engine_pb2.EngineInfo(
            model="fake",
            max_model_len=self.max_model_len,
            vocab_size=VOCAB_SIZE,
            block_size=16,
            num_blocks=1000,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=4096,
            engine_id="fake-engine",
            load=engine_pb2.EngineLoad(free_blocks=1000, total_blocks=1000),
        )

    async def InspectAdapter(self, request, context):  # noqa: N802
        self.inspected.append((request.name, request.path))
        answer = self.adapter_dirs.get(request.path)
        if answer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter at {request.path!r}")
        if isinstance(answer, tuple):
            await context.abort(*answer)
        spec = common_pb2.AdapterSpec()
        spec.CopyFrom(answer)
        spec.name = request.name
        return spec

    async def EngineSession(self, request_iterator, context):  # noqa: N802
        self.sessions += 1
        session = self.sessions
        outbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for message in request_iterator:
                for submit in message.submits:
                    self.submitted.append(submit.request_id)
                    if submit.adapter:
                        self.submitted_specs[submit.request_id] = submit
                    self.live[submit.request_id] = [
                        0,
                        submit.params.max_tokens,
                        len(submit.prompt_token_ids),
                        session,
                        submit.params.HasField("logprobs"),
                    ]
                for request_id in message.aborts:
                    self.aborted.append(request_id)
                    if self.live.pop(request_id, None) is not None:
                        outbox.put_nowait(
                            engine_pb2.SequenceUpdate(
                                request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
                            )
                        )

        reader = asyncio.get_running_loop().create_task(read())
        step_index = 0
        try:
            while not reader.done():
                await asyncio.sleep(self.step_s)
                step = engine_pb2.EngineStep(step_index=step_index)
                step_index += 1
                while not outbox.empty():
                    step.updates.append(outbox.get_nowait())
                for request_id, state in list(self.live.items()):
                    if state[3] != session:
                        continue
                    token = ord("a") + state[0] % 26
                    state[0] += 1
                    update = step.updates.add(request_id=request_id, token_ids=[token])
                    if state[4]:
                        update.logprobs.add(token_id=token, logprob=-0.5)
                    if state[0] >= state[1]:
                        update.finish_reason = common_pb2.FINISH_REASON_LENGTH
                        update.usage.prompt_tokens = state[2]
                        update.usage.completion_tokens = state[0]
                        del self.live[request_id]
                step.load.free_blocks = 1000 - len(self.live)
                step.load.total_blocks = 1000
                step.load.running = len(self.live)
                if self.lora_slots:
                    step.load.lora_slots = self.lora_slots
                    step.load.lora_adapter_capacity = self.lora_adapter_capacity
                    specs = self.submitted_specs
                    resident = {specs[r].adapter for r in self.live if r in specs}
                    step.load.resident_adapters.extend(sorted(resident)[: self.lora_slots])
                yield step
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            for request_id in [r for r, s in self.live.items() if s[3] == session]:
                del self.live[request_id]


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Characters as token ids. With `sessions=False` it lacks TokenizeSession (UNIMPLEMENTED,
    and its Info says so), like a tokenizer from before it, so the router's Tokenize calls are
    tested."""

    def __init__(self, *, sessions: bool = True) -> None:
        self.sessions = sessions
        self.cancelled: list[str] = []
        self.state: dict[str, dict] = {}
        self.tokenize_batches: list[int] = []  # items per batch, either way
        self.tokenize_calls = 0  # batches that came as unary Tokenize calls
        if not sessions:
            self.TokenizeSession = super().TokenizeSession

    async def Info(self, request, context):  # noqa: N802
        return tokenizer_pb2.TokenizerInfo(
            model="fake", vocab_size=VOCAB_SIZE, tokenize_session=self.sessions
        )

    async def Tokenize(self, request, context):  # noqa: N802
        self.tokenize_calls += 1
        response = self._encode(request)
        if response is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "batch rejected")
        return response

    async def TokenizeSession(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            response = self._encode(request)
            if response is None:
                response = tokenizer_pb2.TokenizeResponse()
                response.error.code = "INVALID_ARGUMENT"
                response.error.message = "batch rejected"
            response.sequence_number = request.sequence_number
            yield response

    def _encode(self, request) -> tokenizer_pb2.TokenizeResponse | None:
        """The answer to one batch, or None when it is rejected as a whole."""
        self.tokenize_batches.append(len(request.items))
        if any(item.text == "REJECT-BATCH" for item in request.items):
            return None
        response = tokenizer_pb2.TokenizeResponse()
        for item in request.items:
            if item.WhichOneof("input") == "chat":
                text = "".join(m.content for m in item.chat.messages)
            else:
                text = item.text
            ids = [ord(c) % VOCAB_SIZE for c in text]
            result = response.results.add()
            if item.max_prompt_tokens and len(ids) > item.max_prompt_tokens:
                result.error.code = "INVALID_ARGUMENT"
                result.error.message = f"prompt is {len(ids)} tokens, over {item.max_prompt_tokens}"
            else:
                result.token_ids.extend(ids)
        return response

    async def DetokenizeSession(self, request_iterator, context):  # noqa: N802
        async for message in request_iterator:
            response = tokenizer_pb2.DetokenizeResponse(sequence_number=message.sequence_number)
            for update in message.updates:
                if update.cancel:
                    self.cancelled.append(update.request_id)
                    self.state.pop(update.request_id, None)
                    continue
                if update.HasField("options"):
                    self.state[update.request_id] = {"stop": list(update.options.stop), "text": ""}
                state = self.state.get(update.request_id)
                delta = response.deltas.add(request_id=update.request_id)
                if state is None:
                    delta.error.code = "NOT_FOUND"
                    delta.error.message = "unknown request"
                    continue
                state["text"] += "".join(char_of(t) for t in update.token_ids)
                text, emitted = state["text"], state.get("emitted", 0)
                for stop in state["stop"]:
                    at = text.find(stop)
                    if at >= 0:
                        delta.text = text[emitted:at]
                        delta.stop_hit = True
                        delta.matched_stop = stop
                        delta.closed = True
                        del self.state[update.request_id]
                        break
                else:
                    # Hold back what could still become a stop string.
                    hold = max((len(stop) - 1 for stop in state["stop"]), default=0)
                    safe = len(text) if update.finished else max(len(text) - hold, emitted)
                    delta.text = text[emitted:safe]
                    state["emitted"] = safe
                    if update.finished:
                        delta.closed = True
                        del self.state[update.request_id]
            yield response


async def start_fake(servicer, add) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
