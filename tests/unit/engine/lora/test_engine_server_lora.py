"""LoRA on the engine's gRPC service: InspectAdapter statuses, submits carrying adapter_spec.

A tiny random Llama (float32) served in-process with --adapter-root: InspectAdapter describes a
good adapter and refuses, with the right status, path traversal, a symlink escaping the root, a
URL, broken safetensors, tensors of the wrong shape and a missing directory. Submits that carry
their adapter's spec generate exactly transformers + peft's tokens, all in flight together with
a base request; an unknown adapter and files changed since registration end only their own
request, with their status, and the load report lists the resident adapters and the slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.grpc_server import start_server
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.server import SERVICE_NAME, EngineServicer
from tests.lora_adapters import (
    MIXED_ADAPTERS,
    lora_tensors,
    peft_config,
    tiny_model_config,
    write_adapter,
    write_peft_adapters,
)
from tests.unit.engine.models.helpers import hf_config, save_random_model
from tests.unit.engine.test_engine_server import Session, submit

MAX_TOKENS = 5
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("lora-server")
    base = save_random_model(hf_config("llama"), directory / "base")
    root = directory / "adapters"
    references = write_peft_adapters(base, root, MIXED_ADAPTERS, PROMPTS, MAX_TOKENS)
    outside = directory / "outside"
    shutil.copytree(root / "attn-r4", outside)
    (root / "escape").symlink_to(outside)
    bad = root / "bad-safetensors"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((root / "attn-r4" / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    wide = tiny_model_config(hidden_size=96)  # q_proj A of the wrong input width
    write_adapter(
        root / "wrong-shapes", peft_config(["q_proj"], 2), lora_tensors(wide, ["q_proj"], 2)
    )
    shutil.copytree(root / "mlp-r8-rs", root / "changed")
    return directory, references


@contextlib.asynccontextmanager
async def lora_server(directory: Path) -> AsyncIterator[engine_pb2_grpc.EngineStub]:
    config = EngineConfig(
        model=str(directory / "base"),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_loras=2,
        max_cpu_loras=3,
        max_lora_rank=8,
        adapter_root=str(directory / "adapters"),
    )
    servicer = EngineServicer(load_report_interval_s=0.2)
    running = await start_server(
        "127.0.0.1:0",
        lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    engine = await asyncio.to_thread(LLMEngine, config)
    engine_loop = servicer.attach(engine, asyncio.get_running_loop())
    await running.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield engine_pb2_grpc.EngineStub(channel)
    finally:
        await channel.close()
        await running.stop(0)
        await asyncio.to_thread(engine_loop.stop)
        engine.shutdown()


@pytest.mark.parametrize(
    ("path", "code", "reason"),
    [
        ("../outside", grpc.StatusCode.INVALID_ARGUMENT, "'..'"),
        ("escape", grpc.StatusCode.INVALID_ARGUMENT, "outside the adapter root"),
        ("https://example.com/attn-r4", grpc.StatusCode.INVALID_ARGUMENT, "URL"),
        ("bad-safetensors", grpc.StatusCode.INVALID_ARGUMENT, "safetensors"),
        ("wrong-shapes", grpc.StatusCode.INVALID_ARGUMENT, "do not fit the base model"),
        ("missing", grpc.StatusCode.NOT_FOUND, "does not exist"),
    ],
)
def test_inspect_adapter_refusals(served, path: str, code: grpc.StatusCode, reason: str) -> None:
    directory, _ = served

    async def scenario() -> None:
        async with lora_server(directory) as stub:
            request = engine_pb2.InspectAdapterRequest(name="x", path=path)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.InspectAdapter(request)
            assert caught.value.code() == code
            assert reason in caught.value.details()
            good = await stub.InspectAdapter(
                engine_pb2.InspectAdapterRequest(name="a", path="attn-r4")
            )
            assert good.rank == 4 and list(good.target_modules) == ["q_proj", "v_proj"]

    asyncio.run(scenario())


def test_submits_with_adapter_specs_match_peft(served) -> None:
    directory, references = served

    async def scenario() -> None:
        async with lora_server(directory) as stub:
            info = await stub.Info(engine_pb2.EngineInfoRequest())
            assert info.max_loras == 2 and info.max_lora_rank == 8
            specs = {
                name: await stub.InspectAdapter(
                    engine_pb2.InspectAdapterRequest(name=name, path=name)
                )
                for name in [*MIXED_ADAPTERS, "changed"]
            }
            # Files changed after registration: the load's checksum check refuses them.
            shutil.copy(
                directory / "adapters" / "all-r2" / "adapter_model.safetensors",
                directory / "adapters" / "changed" / "adapter_model.safetensors",
            )
            session = Session(stub)
            items, expected = [], {}
            for name in [None, *MIXED_ADAPTERS]:
                for index, prompt in enumerate(PROMPTS):
                    request_id = f"{name}-{index}"
                    item = submit(
                        request_id, prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                        ignore_eos=True,
                    )  # fmt: skip
                    if name is not None:
                        item.adapter = name
                        item.adapter_spec.CopyFrom(specs[name])
                    items.append(item)
                    expected[request_id] = references[name][index]
            unknown = submit("unknown", PROMPTS[0], max_tokens=2)
            unknown.adapter = "nobody"
            changed = submit("changed", PROMPTS[0], max_tokens=2)
            changed.adapter = "changed"
            changed.adapter_spec.CopyFrom(specs["changed"])
            session.send(submits=[*items, unknown, changed])
            await session.until(lambda: len(session.finished) == len(items) + 2)
            for request_id, tokens in expected.items():
                update = session.finished[request_id]
                assert update.finish_reason == common_pb2.FINISH_REASON_LENGTH, update.error
                assert session.tokens[request_id] == tokens, request_id
            assert session.finished["unknown"].error.code == "NOT_FOUND"
            failed = session.finished["changed"]
            assert failed.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert failed.error.code not in ("", "INTERNAL", "UNKNOWN")
            assert "changed" in failed.error.message
            load = session.steps[-1].load
            assert load.lora_slots == 2 and 1 <= len(load.resident_adapters) <= 2
            assert set(load.resident_adapters) <= set(MIXED_ADAPTERS)
            session.outbox.put_nowait(None)

    asyncio.run(scenario())
