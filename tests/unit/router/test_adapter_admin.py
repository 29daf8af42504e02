"""AddAdapter/ListAdapters/RemoveAdapter and generating with an adapter, over real gRPC against
the in-process fake engine (whose InspectAdapter answers from a table) and fake tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from protos.sluice.v1 import common_pb2, router_pb2
from tests.unit.router.router_fakes import FakeEngine
from tests.unit.router.test_router_servicer import Stack, eventually, run_stack, text_request

SHA = "0123456789abcdef" * 4


def engine_with_adapters(**kwargs) -> FakeEngine:
    engine = FakeEngine(**kwargs)
    engine.adapter_dirs = {
        "support/v1": common_pb2.AdapterSpec(
            path="support/v1", sha256=SHA, rank=16, target_modules=["q_proj", "v_proj"]
        ),
        "legal": common_pb2.AdapterSpec(path="legal", sha256=SHA[::-1], rank=8),
        "bad-shapes": (
            grpc.StatusCode.INVALID_ARGUMENT,
            "lora_A of q_proj has 512 columns; the model's q_proj takes 576",
        ),
        "escape": (grpc.StatusCode.INVALID_ARGUMENT, "path resolves outside the adapter root"),
    }
    return engine


async def add(stack: Stack, name: str, path: str, **kwargs) -> router_pb2.AdapterInfo:
    return await stack.stub.AddAdapter(router_pb2.AddAdapterRequest(name=name, path=path), **kwargs)


async def expect_status(call, code: grpc.StatusCode, match: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    return info.value.details()


def adapter_request(adapter: str, max_tokens: int = 3) -> router_pb2.GenerateRequest:
    request = text_request("hi", max_tokens=max_tokens)
    request.adapter = adapter
    return request


def test_register_generate_list_and_remove() -> None:
    engine = engine_with_adapters()

    async def check(stack: Stack) -> None:
        info = await add(stack, "support", "support/v1")
        assert (info.name, info.path, info.sha256, info.rank) == ("support", "support/v1", SHA, 16)
        assert list(info.target_modules) == ["q_proj", "v_proj"]
        assert engine.inspected == [("support", "support/v1")]
        listed = await stack.stub.ListAdapters(router_pb2.ListAdaptersRequest())
        assert [a.name for a in listed.adapters] == ["support"]
        models = await stack.stub.ListModels(router_pb2.ListModelsRequest())
        assert [(a.name, a.rank) for a in models.models[0].adapters] == [("support", 16)]

        responses = await stack.collect(adapter_request("support"))
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        (submit,) = engine.submitted_specs.values()
        assert submit.adapter == "support"
        assert (submit.adapter_spec.name, submit.adapter_spec.path) == ("support", "support/v1")
        assert submit.adapter_spec.sha256 == SHA and submit.adapter_spec.rank == 16

        removed = await stack.stub.RemoveAdapter(router_pb2.RemoveAdapterRequest(name="support"))
        assert removed.name == "support"
        await expect_status(stack.collect(adapter_request("support")), grpc.StatusCode.NOT_FOUND)
        await expect_status(
            stack.stub.RemoveAdapter(router_pb2.RemoveAdapterRequest(name="support")),
            grpc.StatusCode.NOT_FOUND,
            "unknown adapter",
        )
        listed = await stack.stub.ListAdapters(router_pb2.ListAdaptersRequest())
        assert list(listed.adapters) == []

    run_stack(check, engine=engine)


@pytest.mark.parametrize(
    ("name", "path", "code", "match", "engine_asked"),
    [
        ("bad name", "legal", grpc.StatusCode.INVALID_ARGUMENT, "letters, digits", False),
        ("x", "https://example.com/lora", grpc.StatusCode.INVALID_ARGUMENT, "URL", False),
        ("x", "../../etc", grpc.StatusCode.INVALID_ARGUMENT, "'..'", False),
        ("x", "/abs/dir", grpc.StatusCode.INVALID_ARGUMENT, "relative", False),
        ("x", "bad-shapes", grpc.StatusCode.INVALID_ARGUMENT, "576", True),
        ("x", "escape", grpc.StatusCode.INVALID_ARGUMENT, "outside the adapter root", True),
        ("x", "missing", grpc.StatusCode.NOT_FOUND, "no adapter", True),
    ],
)
def test_refusals_get_the_right_status_and_the_stack_keeps_serving(
    name: str, path: str, code: grpc.StatusCode, match: str, engine_asked: bool
) -> None:
    engine = engine_with_adapters()

    async def check(stack: Stack) -> None:
        await expect_status(add(stack, name, path), code, match)
        assert bool(engine.inspected) == engine_asked
        listed = await stack.stub.ListAdapters(router_pb2.ListAdaptersRequest())
        assert list(listed.adapters) == []
        ok = await stack.collect(text_request(max_tokens=2))
        assert ok[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run_stack(check, engine=engine)


def test_a_taken_name_is_already_exists_without_asking_the_engine() -> None:
    engine = engine_with_adapters()

    async def check(stack: Stack) -> None:
        await add(stack, "legal", "legal")
        await expect_status(
            add(stack, "legal", "support/v1"), grpc.StatusCode.ALREADY_EXISTS, "already registered"
        )
        assert engine.inspected == [("legal", "legal")]

    run_stack(check, engine=engine)


def test_unknown_adapter_is_not_found_before_anything_is_queued() -> None:
    async def check(stack: Stack) -> None:
        details = await expect_status(
            stack.collect(adapter_request("nobody")), grpc.StatusCode.NOT_FOUND, "nobody"
        )
        assert "sluice adapters list" in details
        assert stack.tokenizer.tokenize_batches == [] and stack.engine.submitted == []
        assert len(stack.core.queue) == 0 and stack.core.active == set()

    run_stack(check, engine=engine_with_adapters())


def test_admin_calls_need_an_api_key_when_keys_are_on(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-admin\n")
    engine = engine_with_adapters()

    async def check(stack: Stack) -> None:
        await expect_status(add(stack, "legal", "legal"), grpc.StatusCode.UNAUTHENTICATED)
        await expect_status(
            stack.stub.ListAdapters(router_pb2.ListAdaptersRequest()),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        await expect_status(
            stack.stub.RemoveAdapter(router_pb2.RemoveAdapterRequest(name="legal")),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        assert engine.inspected == []
        key = (("authorization", "Bearer sk-admin"),)
        await add(stack, "legal", "legal", metadata=key)
        listed = await stack.stub.ListAdapters(router_pb2.ListAdaptersRequest(), metadata=key)
        assert [a.name for a in listed.adapters] == ["legal"]

    run_stack(check, engine=engine, api_keys_file=str(keys))


def test_residency_and_queue_depth_are_listed_and_exported() -> None:
    engine = engine_with_adapters(step_s=0.02, max_num_seqs=1)
    engine.lora_slots = 2

    def gauge(name: str, adapter: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"adapter": adapter})

    async def check(stack: Stack) -> None:
        await add(stack, "legal", "legal")
        await add(stack, "support", "support/v1")
        assert gauge("sluice_router_adapter_queue_depth_requests", "legal") == 0
        first = asyncio.ensure_future(stack.collect(adapter_request("legal", max_tokens=40)))
        second = asyncio.ensure_future(stack.collect(adapter_request("legal", max_tokens=2)))
        address = stack.core.pool.ready_connections()[0].engine_id
        await eventually(
            lambda: gauge("sluice_router_adapter_resident_engines", "legal") == 1, "resident"
        )
        assert gauge("sluice_router_adapter_queue_depth_requests", "legal") == 1
        assert gauge("sluice_router_adapter_resident_engines", "support") == 0
        listed = await stack.stub.ListAdapters(router_pb2.ListAdaptersRequest())
        where = {a.name: list(a.resident_on) for a in listed.adapters}
        assert where == {"legal": [address], "support": []}
        await asyncio.gather(first, second)
        assert gauge("sluice_router_adapter_queue_depth_requests", "legal") == 0

    run_stack(check, engine=engine)


def test_a_time_sliced_engine_takes_adapters_past_its_slots_and_residency_stays_slots() -> None:
    engine = engine_with_adapters(step_s=0.02, max_num_seqs=4)
    engine.lora_slots = 1
    engine.lora_adapter_capacity = 2

    def gauge(name: str, adapter: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"adapter": adapter})

    async def check(stack: Stack) -> None:
        await add(stack, "legal", "legal")
        await add(stack, "support", "support/v1")
        capacity = stack.core.pool.ready_connections()[0].capacity
        await eventually(lambda: capacity.lora_slots == 1, "the first load report")
        assert capacity.adapter_cap == 2
        calls = [
            asyncio.ensure_future(stack.collect(adapter_request(name, max_tokens=40)))
            for name in ("legal", "support")
        ]
        await eventually(lambda: len(capacity.adapters_inflight) == 2, "both in flight")
        await eventually(
            lambda: gauge("sluice_router_adapter_resident_engines", "legal") == 1, "resident"
        )
        # Both adapters are on the engine; only the one in its device slot counts as resident.
        assert gauge("sluice_router_adapter_resident_engines", "support") == 0
        for name in ("legal", "support"):
            assert gauge("sluice_router_adapter_queue_depth_requests", name) == 0
        await asyncio.gather(*calls)

    run_stack(check, engine=engine)
