"""LoRA adapters as OpenAI models on the HTTP front, against the in-process fakes.

An adapter registered through the router's AddAdapter RPC (the fake engine's InspectAdapter
describes it) is listed by `GET /v1/models` with the served model as its parent, and
`"model": "<adapter>"` sends the request to the engine with that adapter and its stored spec;
the served model's name and `base` send it without one; an unknown or removed adapter is 404.
"""

from __future__ import annotations

import grpc
import pytest

from protos.sluice.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.unit.router.openai_http.test_http_front import Front, chat, completion, run_front
from tests.unit.router.router_fakes import FakeEngine

SHA = "0123456789abcdef" * 4
SPEC = common_pb2.AdapterSpec(path="support/v1", sha256=SHA, rank=16, target_modules=["q_proj"])


def engine_with_adapter() -> FakeEngine:
    engine = FakeEngine()
    engine.adapter_dirs = {"support/v1": SPEC}
    return engine


async def admin(front: Front, method: str, request: object) -> router_pb2.AdapterInfo:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.grpc_port}") as channel:
        return await getattr(router_pb2_grpc.RouterStub(channel), method)(request)


async def models(front: Front) -> list[dict]:
    async with front.session.get(front.base + "/v1/models") as response:
        assert response.status == 200
        return (await response.json())["data"]


def last_submit_adapter(front: Front) -> tuple[str, common_pb2.AdapterSpec | None]:
    """The adapter of the engine's latest submit and the spec it came with ("" and None: none)."""
    submit = front.engine.submitted_specs.get(front.engine.submitted[-1])
    return ("", None) if submit is None else (submit.adapter, submit.adapter_spec)


def test_a_registered_adapter_is_a_model_that_selects_it() -> None:
    async def check(front: Front) -> None:
        await admin(
            front, "AddAdapter", router_pb2.AddAdapterRequest(name="support", path="support/v1")
        )
        listed = await models(front)
        assert [(m["id"], m["object"], m["parent"]) for m in listed] == [
            ("fake", "model", None),
            ("support", "model", "fake"),
        ]
        assert listed[1]["root"] == "support/v1" and listed[1]["max_model_len"] == 128

        status, body, _ = await front.post(
            "/v1/completions", completion(model="support", max_tokens=3)
        )
        assert status == 200 and body["model"] == "support"
        assert body["choices"][0]["text"] == "abc"
        adapter, spec = last_submit_adapter(front)
        assert adapter == "support"
        assert (spec.name, spec.path, spec.sha256, spec.rank) == ("support", "support/v1", SHA, 16)

        events = await front.events(
            "/v1/chat/completions", chat(model="support", max_tokens=2, stream=True)
        )
        assert all(e["model"] == "support" for e in events[:-1])
        assert last_submit_adapter(front)[0] == "support"

        for base in ("fake", "base"):
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                status, answer, _ = await front.post(path, body(model=base, max_tokens=2))
                assert status == 200 and answer["model"] == base, (path, base)
                assert last_submit_adapter(front) == ("", None), (path, base)
        assert len(front.engine.submitted) == 6 and len(front.engine.submitted_specs) == 2

    run_front(check, engine=engine_with_adapter())


def test_unknown_and_removed_adapters_are_404_in_openai_shape() -> None:
    async def check(front: Front) -> None:
        await admin(
            front, "AddAdapter", router_pb2.AddAdapterRequest(name="support", path="support/v1")
        )
        status, _, _ = await front.post("/v1/completions", completion(model="support"))
        assert status == 200
        await admin(front, "RemoveAdapter", router_pb2.RemoveAdapterRequest(name="support"))
        assert [m["id"] for m in await models(front)] == ["fake"]
        submitted = len(front.engine.submitted)
        for model in ("support", "never-registered"):
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                status, answer, _ = await front.post(path, body(model=model))
                assert status == 404, (path, model)
                assert answer["error"] == {
                    "message": f"The model '{model}' does not exist",
                    "type": "not_found_error",
                    "param": "model",
                    "code": "model_not_found",
                }
        assert len(front.engine.submitted) == submitted  # refused before the engine
        status, _, _ = await front.post("/v1/completions", completion(model="base", max_tokens=1))
        assert status == 200

    run_front(check, engine=engine_with_adapter())


@pytest.mark.parametrize("name", ["base", "fake"])
def test_the_served_models_names_cannot_be_adapter_names(name: str) -> None:
    async def check(front: Front) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin(
                front, "AddAdapter", router_pb2.AddAdapterRequest(name=name, path="support/v1")
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "reserved" in info.value.details()
        assert front.engine.inspected == []
        assert [m["id"] for m in await models(front)] == ["fake"]

    run_front(check, engine=engine_with_adapter())
