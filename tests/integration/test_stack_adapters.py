"""LoRA adapters through a real stack on the default model (float32, CPU): registered with
`sluice adapters add`, served all in flight together with the base model (2 device slots for 4
adapters, so they are evicted and reloaded), each request's greedy tokens equal to transformers +
peft with that adapter alone; the adapters as models of the OpenAI front (the `openai` package's
greedy text equal to the gRPC path's); and the refusals (path traversal, symlink escape, URL,
unknown name, bad safetensors, wrong shapes) each with its status while the stack keeps serving.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from services.adapters_cli import main as adapters_cli
from services.common.ports import free_port
from tests.integration.conftest import SMALL_KV_CACHE_BYTES

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

MAX_TOKENS = 6
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1204, 6203, 30, 2683, 359, 253]]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Four random PEFT adapters of the default model and the refused directories beside them;
    returns the root and the transformers + peft greedy tokens of each adapter."""
    from transformers import AutoModelForCausalLM

    from services.common.model_files import resolve_model
    from tests.lora_adapters import (
        MIXED_ADAPTERS,
        peft_config,
        write_adapter,
        write_peft_adapters,
    )

    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(
        resolve_model(None).weights_dir, dtype=torch.float32
    ).eval()
    references = write_peft_adapters(base, root, MIXED_ADAPTERS, PROMPTS, MAX_TOKENS)
    hidden = base.config.hidden_size
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    write_adapter(
        root / "wrong-shapes",
        peft_config(["q_proj"], 4),
        {
            f"{prefix}.lora_A.weight": torch.randn(4, hidden + 3),
            f"{prefix}.lora_B.weight": torch.randn(hidden, 4),
        },
    )
    broken = root / "bad-safetensors"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(
        (root / "attn-r4" / "adapter_config.json").read_text()
    )
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(outside / "elsewhere", peft_config(["q_proj"], 4), {})
    (root / "escape").symlink_to(outside / "elsewhere", target_is_directory=True)
    return root, references


def run_cli(*argv: str) -> int:
    return adapters_cli(list(argv))


def test_adapters_in_flight_together_match_peft_and_refusals(
    adapter_root: tuple[Path, dict],
    stack_factory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import grpc
    import openai

    from protos.sluice.v1 import router_pb2, router_pb2_grpc
    from services.client import SluiceClient

    root, references = adapter_root
    http_port = free_port()
    stack = stack_factory(
        router_args=("--http-port", str(http_port)),
        engine_args=(
            "--kv-cache-bytes",
            str(SMALL_KV_CACHE_BYTES),
            "--max-num-seqs",
            "64",
            "--dtype",
            "float32",
            "--adapter-root",
            str(root),
            "--max-loras",
            "2",
        ),
    )
    target = stack.router_address
    names = [name for name in references if name is not None]
    for name in names:
        assert run_cli("add", name, name, "--target", target) == 0, capsys.readouterr().err
    assert run_cli("list", "--target", target) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in names)

    results: dict[tuple[str | None, int], list[int]] = {}
    texts: dict[tuple[str | None, int], str] = {}

    def generate(adapter: str | None, index: int) -> None:
        with SluiceClient(target, timeout_s=300.0) as client:
            ids: list[int] = []
            text = ""
            for response in client.generate(
                token_ids=PROMPTS[index],
                adapter=adapter or "",
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            ):
                ids.extend(response.token_ids)
                text += response.text
            results[(adapter, index)] = ids
            texts[(adapter, index)] = text

    jobs = [(adapter, i) for adapter in [None, *names] for i in range(len(PROMPTS))]
    threads = [threading.Thread(target=generate, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    for adapter, index in jobs:
        assert results[(adapter, index)] == references[adapter][index], (adapter, index)
    assert references["attn-r4"][0] != references[None][0]  # the adapters change the output
    with grpc.insecure_channel(target) as channel:
        listed = router_pb2_grpc.RouterStub(channel).ListAdapters(router_pb2.ListAdaptersRequest())
    assert sorted(a.name for a in listed.adapters) == sorted(names)
    assert {a.sha256 for a in listed.adapters} and all(len(a.sha256) == 64 for a in listed.adapters)
    assert sum(bool(a.resident_on) for a in listed.adapters) <= 2  # 2 slots: some were evicted

    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=300
    )
    base_model, *adapter_models = http.models.list().data
    assert base_model.parent is None
    assert {m.id: m.parent for m in adapter_models} == {name: base_model.id for name in names}
    for model, adapter in (("attn-r4", "attn-r4"), ("base", None)):
        whole = http.completions.create(
            model=model,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        ids = [int(t.removeprefix("token_id:")) for t in whole.choices[0].logprobs.tokens]
        assert ids == references[adapter][0], model
        assert whole.choices[0].text == texts[(adapter, 0)], model

    refusals = [
        ("traversal", "../escape", "INVALID_ARGUMENT", 2),
        ("url", "https://example.com/adapter", "INVALID_ARGUMENT", 2),
        ("symlink", "escape", "INVALID_ARGUMENT", 2),
        ("broken", "bad-safetensors", "INVALID_ARGUMENT", 2),
        ("shapes", "wrong-shapes", "INVALID_ARGUMENT", 2),
        ("missing", "no-such-dir", "NOT_FOUND", 1),
        ("attn-r4", "attn-r4", "ALREADY_EXISTS", 1),
    ]
    for name, path, status, exit_code in refusals:
        capsys.readouterr()
        assert run_cli("add", name, path, "--target", target) == exit_code, (name, path)
        assert capsys.readouterr().err.startswith(f"error: {status}:"), (name, path)

    with SluiceClient(target, timeout_s=120.0) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.complete("hi", adapter="never-registered", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert run_cli("remove", "mlp-r8-rs", "--target", target) == 0
        with pytest.raises(grpc.RpcError) as info:
            client.complete("hi", adapter="mlp-r8-rs", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(openai.NotFoundError):
            http.completions.create(model="mlp-r8-rs", prompt="hi", max_tokens=2)
        # The stack keeps serving, the base model and the remaining adapters alike.
        assert client.complete("hi", max_tokens=2).finish_reason
        assert client.complete("hi", adapter="all-r2", max_tokens=2).finish_reason
