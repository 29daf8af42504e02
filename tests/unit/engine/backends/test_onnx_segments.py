"""The batchful segments exported to ONNX: values against torch, the cache, and its errors."""

from __future__ import annotations

import dataclasses
import json

import onnx
import pytest
import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.engine.backends import onnx_export, segments
from services.engine.backends.onnx_cache import MANIFEST, verify
from services.engine.backends.onnx_export import load_or_export
from services.engine.backends.onnxruntime_segments import OnnxRuntimeSegments, providers_for
from tests.unit.engine.backends.segment_models import family_model

TOKEN_COUNTS = (1, 7, 33)


def export(tmp_path, family, dtype=torch.float32, **kwargs):
    config, model, files = family_model(family, dtype, tie=kwargs.pop("tie", False))
    graphs = load_or_export(
        model, config, files, dtype=dtype, root=tmp_path, progress=False, **kwargs
    )
    return config, model, files, graphs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_segment_matches_torch_in_float32(tmp_path, family):
    config, model, _, graphs = export(tmp_path, family, tie=family == "llama")
    runtime = OnnxRuntimeSegments(graphs, config, torch.device("cpu"))
    for spec in segments.SEGMENTS:
        for layer in range(config.num_layers if spec.per_layer else 1):
            module = segments.segment_module(model, spec.kind, layer)
            for tokens in TOKEN_COUNTS:
                inputs = segments.segment_inputs(config, spec.kind, tokens)
                expected = module(*inputs)
                got = runtime.run(spec.kind, layer, inputs)
                assert got.shape == expected.shape and got.dtype == torch.float32
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_segments_reproduce_the_model_layer(tmp_path):
    """attn_in's q/k-normed qkv and attn_out_mlp's residual are the model's own values."""
    config, model, _, _ = export(tmp_path, "qwen3")
    layer = model.model.layers[0]
    hidden = torch.randn(5, config.hidden_size)
    normed, _ = layer.input_layernorm(hidden, None)
    qkv = layer.self_attn.qkv_proj(normed)
    attention = layer.self_attn
    query, key, _ = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
    query = attention.q_norm.normalize(query.reshape(5, -1, attention.head_dim))
    got = segments.segment_module(model, "attn_in", 0)(hidden)
    torch.testing.assert_close(got[:, : attention.q_size], query.reshape(5, -1))
    attn_out = torch.randn(5, attention.q_size)
    residual = layer.self_attn.o_proj(attn_out) + hidden
    normed, residual = layer.post_attention_layernorm(residual, None)
    expected = layer.mlp(normed) + residual
    got = segments.segment_module(model, "attn_out_mlp", 0)(attn_out, hidden)
    torch.testing.assert_close(got, expected)


def test_one_graph_per_kind_with_each_layers_weights_outside(tmp_path):
    config, _, _, graphs = export(tmp_path, "llama")
    assert sorted(graphs.graphs) == ["attn_in", "attn_out_mlp", "head"]
    assert [len(graphs.graphs[kind]) for kind in ("attn_in", "attn_out_mlp", "head")] == [2, 2, 1]
    protos = [onnx.load(str(path), load_external_data=False) for path in graphs.graphs["attn_in"]]
    nodes = [[(node.op_type, list(node.input)) for node in p.graph.node] for p in protos]
    assert nodes[0] == nodes[1]  # the same traced graph, other weights
    for proto, path in zip(protos, graphs.graphs["attn_in"], strict=True):
        weight = next(t for t in proto.graph.initializer if t.name == "qkv_proj.weight")
        assert weight.data_location == onnx.TensorProto.EXTERNAL
        assert (path.parent / f"{path.stem}.data").is_file()
        dims = [
            dim.dim_param or dim.dim_value
            for dim in proto.graph.input[0].type.tensor_type.shape.dim
        ]
        assert isinstance(dims[0], str) and dims[1] == config.hidden_size  # dynamic tokens


def test_reduced_precision_on_the_cpu_provider(tmp_path):
    """float16 runs on onnxruntime's CPU provider; bfloat16 has no CPU kernels there, which
    the executor reports at start-up (FailedPreconditionError naming float32)."""
    config, model, _, graphs = export(tmp_path, "llama", torch.float16)
    runtime = OnnxRuntimeSegments(graphs, config, torch.device("cpu"))
    module = segments.segment_module(model.float(), "attn_out_mlp", 1)
    inputs = segments.segment_inputs(config, "attn_out_mlp", 9, dtype=torch.float16)
    expected = module(*(tensor.float() for tensor in inputs))
    got = runtime.run("attn_out_mlp", 1, inputs)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    config, _, _, graphs = export(tmp_path, "llama", torch.bfloat16)
    with pytest.raises(FailedPreconditionError, match="float32"):
        OnnxRuntimeSegments(graphs, config, torch.device("cpu"))


def test_cache_is_reused_and_keyed_by_dtype(tmp_path, monkeypatch):
    _, _, _, first = export(tmp_path, "llama")
    calls = []
    monkeypatch.setattr(onnx_export, "export_segments", lambda *a, **k: calls.append(1))
    _, _, _, again = export(tmp_path, "llama")
    assert again.directory == first.directory and not calls
    monkeypatch.undo()
    _, _, _, half = export(tmp_path, "llama", torch.float16)
    assert half.directory != first.directory


def test_corrupt_cache_is_exported_again_or_reported(tmp_path):
    _, _, _, graphs = export(tmp_path, "llama")
    data = graphs.directory / "attn_out_mlp.001.data"
    original = data.read_bytes()
    data.write_bytes(original[:-8])  # truncated
    assert "attn_out_mlp.001.data" in verify(graphs.directory)
    with pytest.raises(FailedPreconditionError, match="attn_out_mlp.001.data"):
        export(tmp_path, "llama", repair=False)
    data.write_bytes(original[:-8] + b"\0" * 8)  # same size, other bytes
    assert "sha256" in verify(graphs.directory)
    _, _, _, repaired = export(tmp_path, "llama")
    assert verify(repaired.directory) is None
    assert data.read_bytes() == original
    (graphs.directory / MANIFEST).write_text("{not json")
    assert "unreadable" in verify(graphs.directory)
    export(tmp_path, "llama")
    assert json.loads((graphs.directory / MANIFEST).read_text())["graphs"]


def test_uncovered_family_is_a_clear_error(tmp_path):
    config, model, files = family_model("llama")
    other = dataclasses.replace(config, architecture="GemmaForCausalLM")
    with pytest.raises(InvalidArgumentError, match="does not cover architecture 'Gemma"):
        load_or_export(model, other, files, dtype=torch.float32, root=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cuda_provider_is_required_on_a_gpu():
    assert providers_for(torch.device("cpu"), ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    cuda = torch.device("cuda")
    assert providers_for(cuda, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider"
    ]
    with pytest.raises(FailedPreconditionError, match="onnxruntime-gpu"):
        providers_for(cuda, ["CPUExecutionProvider"])
