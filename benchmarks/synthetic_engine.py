"""A model-free engine for the stack benchmark: the real EngineSession protocol, no forward pass.

Every `step_s` each live request gets one token (ids cycling through ordinary vocabulary
entries), the same as a real engine's step message, gathered into fewer updates as the router's
pacing asks (services/engine/coalesce.py, as the real engine does). With it the engine is never
the limit, so `python -m benchmarks.stack_bench --synthetic-step-ms 2` measures what the router
and tokenizer can stream by themselves. `start_synthetic_engine` is a `services.launcher.Stack`
engine starter that runs it as its own process (`python -m benchmarks.synthetic_engine PORT
STEP_MS`).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.coalesce import TokenCoalescer
from services.engine.outputs import FinishReason, SequenceDelta
from services.engine.server_convert import fill_update

FREE_BLOCKS = 1 << 20


class SyntheticEngine(engine_pb2_grpc.EngineServicer):
    """An engine without a model: every `step_s` each live request gets one token."""

    def __init__(self, step_s: float, vocab_size: int = 49152, max_model_len: int = 4096) -> None:
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    async def Info(self, request, context):  # noqa: N802 - gRPC method name
        return engine_pb2.EngineInfo(
            model="synthetic",
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=16,
            num_blocks=FREE_BLOCKS,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            engine_id="synthetic",
            load=engine_pb2.EngineLoad(free_blocks=FREE_BLOCKS),
        )

    async def EngineSession(self, request_iterator, context):  # noqa: N802 - gRPC method name
        live: dict[str, list[int]] = {}  # id -> [generated, max_tokens, prompt_tokens]
        aborted: list[str] = []
        coalescer = TokenCoalescer()  # the router's pacing, as a real engine honours it

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("pacing"):
                    coalescer.set_pacing(
                        message.pacing.tokens_per_update, message.pacing.max_hold_ms
                    )
                for submit in message.submits:
                    max_tokens = submit.params.max_tokens or 16
                    live[submit.request_id] = [0, max_tokens, len(submit.prompt_token_ids)]
                    if submit.hold_tokens:
                        coalescer.allow(submit.request_id)
                for request_id in message.aborts:
                    coalescer.forget(request_id)
                    if live.pop(request_id, None) is not None:
                        aborted.append(request_id)

        reader = asyncio.get_running_loop().create_task(read())
        index = 0
        try:
            while not reader.done():
                await asyncio.sleep(self.step_s)
                index += 1
                now = time.monotonic()
                step = engine_pb2.EngineStep(step_index=index)
                for request_id in aborted:
                    step.updates.add(
                        request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ABORT
                    )
                aborted.clear()
                for request_id, state in list(live.items()):
                    state[0] += 1
                    done = state[0] >= state[1]
                    delta = SequenceDelta(
                        request_id,
                        [1000 + (index * 7 + state[0]) % 4000],
                        finished=done,
                        finish_reason=FinishReason.LENGTH if done else None,
                        num_prompt_tokens=state[2],
                        num_output_tokens=state[0],
                    )
                    if done:
                        del live[request_id]
                    delta = coalescer.take(request_id, delta, now)
                    if delta is not None:
                        fill_update(step.updates.add(), request_id, delta)
                for request_id, delta in coalescer.overdue(now):
                    fill_update(step.updates.add(), request_id, delta)
                step.load.free_blocks = FREE_BLOCKS
                step.load.running = len(live)
                yield step
        finally:
            reader.cancel()


async def serve(port: int, step_s: float) -> None:
    """Serve a SyntheticEngine on loopback `port` until killed."""
    from services.common.grpc_server import start_server

    engine = SyntheticEngine(step_s)
    server = await start_server(
        f"127.0.0.1:{port}",
        lambda s: engine_pb2_grpc.add_EngineServicer_to_server(engine, s),
        ["sluice.v1.Engine"],
    )
    await server.set_serving(True)
    await server.server.wait_for_termination()


def synthetic_engine_starter(step_ms: float) -> Callable:
    """A `Stack(engine_starter=...)` hook that starts one synthetic engine process."""
    from services.common.ports import free_port
    from services.launcher import ChildProcess

    def start(config, model) -> list:
        port = free_port(config.host)
        command = [sys.executable, "-m", "benchmarks.synthetic_engine", str(port), str(step_ms)]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        return [ChildProcess("synthetic-engine", f"{config.host}:{port}", process)]

    return start


def main(argv: list[str]) -> int:
    """`PORT STEP_MS`: serve until killed."""
    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: python -m benchmarks.synthetic_engine PORT STEP_MS", file=sys.stderr)
        return 2
    asyncio.run(serve(int(argv[0]), float(argv[1]) / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
