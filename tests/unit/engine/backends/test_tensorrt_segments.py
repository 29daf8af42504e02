"""The TensorRT backend's builder and runtime logic, against a fake `tensorrt` module.

TensorRT itself cannot be installed here; FakeTensorRT (fake_tensorrt.py) has its API and
really computes each "engine" from its ONNX graph through the pointers it is bound to.
"""

from __future__ import annotations

import sys

import pytest
import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.engine.backends import segments
from services.engine.backends.onnx_export import load_or_export
from services.engine.backends.tensorrt_build import (
    EngineBuilder,
    GpuIdentity,
    engine_key,
    import_tensorrt,
    install_hint,
    key_digest,
    profile_for,
)
from services.engine.backends.tensorrt_segments import TensorRTSegments, create_executor
from tests.unit.engine.backends.fake_tensorrt import FakeTensorRT, RecordingCapture
from tests.unit.engine.backends.segment_models import family_model

H100 = GpuIdentity("NVIDIA H100 80GB HBM3", (9, 0))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx")
    config, model, files = family_model("qwen2")
    graphs = load_or_export(model, config, files, dtype=torch.float32, root=root, progress=False)
    return config, model, graphs


def test_missing_module_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    with pytest.raises(FailedPreconditionError, match="pip install tensorrt"):
        import_tensorrt()
    assert (
        install_hint("12.8") == "pip install tensorrt-cu12 (TensorRT for CUDA 12.8, torch's CUDA)"
    )
    assert "pip install tensorrt" in install_hint("")


def test_engine_needs_tensorrt_before_loading_weights(monkeypatch):
    from services.engine.llm import LLM

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(FailedPreconditionError, match="pip install tensorrt"):
        LLM("dummy:tiny", backend="tensorrt", device="cpu")


def test_tensorrt_runs_only_on_cuda(exported):
    config, _, graphs = exported
    with pytest.raises(FailedPreconditionError, match="CUDA device"):
        create_executor(
            graphs, config, torch.device("cpu"), max_tokens=8, max_rows=4, trt=FakeTensorRT()
        )


def test_profiles_cover_the_step_budget(exported):
    config, _, _ = exported
    attn_in = profile_for("attn_in", config, max_tokens=2048, max_rows=256)
    assert attn_in.as_dict() == {"residual": [[1, 64], [64, 64], [2048, 64]]}
    attn_out = profile_for("attn_out_mlp", config, max_tokens=8, max_rows=4)
    assert attn_out.as_dict() == {
        "attention": [[1, 64], [8, 64], [8, 64]],
        "residual": [[1, 64], [8, 64], [8, 64]],
    }
    assert profile_for("head", config, max_tokens=2048, max_rows=32).max_rows == 32


def test_cache_key_changes_with_gpu_version_profile_dtype_and_graph(exported):
    config, _, _ = exported
    trt = FakeTensorRT()
    profile = profile_for("attn_in", config, 64, 8)
    base = key_digest(engine_key(trt, H100, profile, torch.bfloat16, "abc"))
    assert base == key_digest(engine_key(trt, H100, profile, torch.bfloat16, "abc"))
    others = [
        engine_key(trt, GpuIdentity("NVIDIA H200", (9, 0)), profile, torch.bfloat16, "abc"),
        engine_key(trt, GpuIdentity(H100.name, (8, 9)), profile, torch.bfloat16, "abc"),
        engine_key(trt, H100, profile_for("attn_in", config, 128, 8), torch.bfloat16, "abc"),
        engine_key(trt, H100, profile, torch.float16, "abc"),
        engine_key(trt, H100, profile, torch.bfloat16, "abd"),
    ]
    newer = FakeTensorRT()
    newer.__version__ = "11.0.0"
    others.append(engine_key(newer, H100, profile, torch.bfloat16, "abc"))
    assert len({base, *map(key_digest, others)}) == len(others) + 1


@pytest.mark.parametrize(
    ("dtype", "flags"), [(torch.bfloat16, ["BF16"]), (torch.float16, ["FP16"]), (torch.float32, [])]
)
def test_builder_flags_profile_timing_cache_and_engine_cache(exported, tmp_path, dtype, flags):
    config, _, graphs = exported
    trt = FakeTensorRT()
    builder = EngineBuilder(trt, H100, dtype, cache_root=tmp_path)
    profile = profile_for("attn_out_mlp", config, 32, 4)
    path = graphs.path("attn_out_mlp", 1)
    engine = builder.load_or_build(path, graphs.digests[path.name], profile)
    (build,) = trt.builds
    assert build["flags"] == flags
    assert build["profiles"] == [profile.as_dict()]
    assert build["graph"] == str(path) and build["inputs"] == ["attention", "residual"]
    assert engine.record == build
    assert builder.timing_cache_path.read_bytes() == b"timing;"
    # Same graph and profile: the serialized engine comes from the cache, no second build.
    again = EngineBuilder(trt, H100, dtype, cache_root=tmp_path)
    again.load_or_build(path, graphs.digests[path.name], profile)
    assert len(trt.builds) == 1 and again.loaded == 1
    # Another profile builds again, starting from the saved timing cache.
    again.load_or_build(path, graphs.digests[path.name], profile_for("attn_out_mlp", config, 64, 4))
    assert len(trt.builds) == 2 and trt.timing_caches_seen[-1] == b"timing;"
    assert again.timing_cache_path.read_bytes() == b"timing;timing;"


def test_unreadable_cached_engine_is_rebuilt(exported, tmp_path, caplog):
    config, _, graphs = exported
    trt = FakeTensorRT()
    builder = EngineBuilder(trt, H100, torch.float32, cache_root=tmp_path)
    profile = profile_for("head", config, 16, 4)
    path = graphs.path("head")
    builder.load_or_build(path, "sha", profile)
    (cached,) = tmp_path.glob("*.engine")
    cached.write_bytes(b"\x00garbage")
    builder.load_or_build(path, "sha", profile)
    assert len(trt.builds) == 2 and "rebuilding" in caplog.text
    assert cached.read_bytes().startswith(b"{")


def test_parse_and_build_failures_are_clear(exported, tmp_path):
    config, _, graphs = exported
    trt = FakeTensorRT()
    builder = EngineBuilder(trt, H100, torch.float32, cache_root=tmp_path)
    profile = profile_for("head", config, 16, 4)
    with pytest.raises(FailedPreconditionError, match="cannot parse missing.onnx"):
        builder.load_or_build(tmp_path / "missing.onnx", "sha", profile)
    trt.fail_builds = True
    with pytest.raises(FailedPreconditionError, match="could not build an engine for head.onnx"):
        builder.load_or_build(graphs.path("head"), "sha", profile)


def make_segments(exported, tmp_path, capture=None, **kwargs):
    config, _, graphs = exported
    trt = FakeTensorRT()
    builder = EngineBuilder(trt, H100, torch.float32, cache_root=tmp_path)
    runtime = TensorRTSegments(
        graphs,
        config,
        torch.device("cpu"),
        builder=builder,
        max_tokens=16,
        max_rows=4,
        graph_capture=capture,
        **kwargs,
    )
    return trt, runtime


def test_bound_pointers_give_each_segments_values(exported, tmp_path):
    config, model, _ = exported
    trt, runtime = make_segments(exported, tmp_path)
    assert runtime.graphs_off_reason == "no CUDA graph capture"
    for spec in segments.SEGMENTS:
        for layer in range(config.num_layers if spec.per_layer else 1):
            rows = 3 if spec.kind == "head" else 11
            inputs = segments.segment_inputs(config, spec.kind, rows)
            expected = segments.segment_module(model, spec.kind, layer)(*inputs)
            got = runtime.run(spec.kind, layer, inputs)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert trt.launches == 5
    with pytest.raises(InvalidArgumentError, match="covers 1 to 16"):
        runtime.run("attn_in", 0, segments.segment_inputs(config, "attn_in", 17))
    with pytest.raises(InvalidArgumentError, match="covers 1 to 4"):
        runtime.run("head", 0, segments.segment_inputs(config, "head", 5))


def test_small_token_counts_replay_one_graph_each(exported, tmp_path):
    config, model, _ = exported
    capture = RecordingCapture()
    trt, runtime = make_segments(exported, tmp_path, capture, graph_max_tokens=8)
    module = segments.segment_module(model, "attn_in", 1)
    for rows in (2, 2, 5, 2, 12):
        inputs = segments.segment_inputs(config, "attn_in", rows)
        got = runtime.run("attn_in", 1, inputs)
        torch.testing.assert_close(got, module(*inputs), rtol=1e-4, atol=1e-5)
    assert capture.captures == 2  # 2 and 5 tokens; 12 is past graph_max_tokens
    assert capture.replays == 4  # each of the four graphed calls replays
    # launches: per capture one warm-up and one captured, plus replays, plus one eager call
    assert trt.launches == 2 * 2 + 4 + 1


def test_failed_capture_falls_back_to_eager(exported, tmp_path, caplog):
    config, model, _ = exported

    class BrokenCapture:
        def capture(self, launch):
            raise RuntimeError("operation not permitted when stream is capturing")

    _, runtime = make_segments(exported, tmp_path, BrokenCapture())
    inputs = segments.segment_inputs(config, "head", 2)
    got = runtime.run("head", 0, inputs)
    torch.testing.assert_close(
        got, segments.segment_module(model, "head")(*inputs), rtol=1e-4, atol=1e-5
    )
    assert "capture failed" in runtime.graphs_off_reason and "eagerly" in caplog.text
