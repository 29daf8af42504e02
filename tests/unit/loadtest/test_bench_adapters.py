"""`sluice bench --adapters a,b,c --adapter-dist zipf` through the router: every request names
its adapter, the router sends each with its registered spec, and the mix is skewed."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from loadtest.datasets import RequestSpec, choose_adapters
from loadtest.grpc_client import GrpcClient
from loadtest.schedule import run_schedule
from protos.sluice.v1 import common_pb2, router_pb2
from tests.unit.router.router_fakes import FakeEngine
from tests.unit.router.test_router_servicer import Stack, run_stack

NAMES = ("alpha", "beta", "gamma")


def test_zipf_adapter_mix_reaches_the_engines_with_specs() -> None:
    engine = FakeEngine(max_num_seqs=16, step_s=0.001)
    engine.lora_slots = 2
    engine.adapter_dirs = {
        name: common_pb2.AdapterSpec(path=name, sha256="ef" * 32, rank=8) for name in NAMES
    }
    adapters = choose_adapters(np.random.default_rng(3), NAMES, "zipf", 1.5, 60)
    specs = [
        RequestSpec(
            index=i, input_tokens=3, output_tokens=4, prompt_token_ids=(70, 71, 72), adapter=a
        )
        for i, a in enumerate(adapters)
    ]
    records: list = []

    async def check(stack: Stack) -> None:
        for name in NAMES:
            await stack.stub.AddAdapter(router_pb2.AddAdapterRequest(name=name, path=name))
        client = GrpcClient(f"127.0.0.1:{stack.server.port}", channels=2, timeout_s=20.0)
        await client.start()
        try:
            times = [i * 0.002 for i in range(len(specs))]
            records.extend(
                await run_schedule(specs, times, client, start_epoch_s=time.time() + 0.05)
            )
        finally:
            await client.close()

    run_stack(check, engine=engine)
    assert [r.status for r in records] == ["OK"] * len(specs)
    sent = Counter(submit.adapter for submit in engine.submitted_specs.values())
    assert sent == Counter(adapters)
    assert sent["alpha"] > sent["gamma"]  # Zipf: the first name is the most frequent
    assert all(s.adapter_spec.name == s.adapter for s in engine.submitted_specs.values())
    assert {s.adapter_spec.path for s in engine.submitted_specs.values()} <= set(NAMES)


def test_an_unregistered_adapter_is_recorded_not_found() -> None:
    spec = RequestSpec(
        index=0, input_tokens=1, output_tokens=2, prompt_token_ids=(70,), adapter="ghost"
    )
    records: list = []

    async def check(stack: Stack) -> None:
        client = GrpcClient(f"127.0.0.1:{stack.server.port}", channels=1, timeout_s=10.0)
        await client.start()
        try:
            records.extend(await run_schedule([spec], [0.0], client, start_epoch_s=time.time()))
        finally:
            await client.close()

    run_stack(check)
    assert records[0].status == "NOT_FOUND"
