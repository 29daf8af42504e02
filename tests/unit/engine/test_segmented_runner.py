"""The engine with exported batchful segments (onnxruntime; tensorrt through a fake module)
gives the torch backend's greedy tokens on a random model, with chunked prefill."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.common.protocol.sampling_params import SamplingParams
from services.engine import segmented_runner
from services.engine.llm import LLM
from services.engine.segmented_runner import SegmentedModelRunner

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3], [40, 41, 42, 43, 44] * 3, [9, 9, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SETTINGS = dict(device="cpu", dtype="float32", cpu_kernels=False, max_num_batched_tokens=8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def torch_tokens(cache):
    llm = LLM("dummy:tiny", backend="torch", **SETTINGS)
    return [output.token_ids for output in llm.generate(PROMPTS, GREEDY)]


def test_onnxruntime_matches_torch(cache, torch_tokens):
    llm = LLM("dummy:tiny", backend="onnxruntime", **SETTINGS)
    runner = llm.engine.runner
    assert isinstance(runner, SegmentedModelRunner)
    assert llm.engine.info.backend == "onnxruntime"
    assert runner.graphs.directory.parent == cache / "onnx"
    # the torch copies of the batchful weights are gone: only the graphs hold them
    assert runner.model.model.layers[0].mlp.gate_up_proj.weight.numel() == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == torch_tokens


def test_tensorrt_through_the_fake_module_matches_torch(cache, torch_tokens, monkeypatch):
    monkeypatch.setitem(
        segmented_runner.SEGMENT_EXECUTORS,
        "tensorrt",
        "tests.unit.engine.backends.fake_tensorrt:create_fake_executor",
    )
    llm = LLM("dummy:tiny", backend="tensorrt", **SETTINGS)
    segments = llm.engine.runner.segments
    assert llm.engine.info.backend == "tensorrt"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == torch_tokens
    profile = segments.engines["attn_in"][0].profile
    assert profile.max_rows == 8  # the step token budget
    assert segments.graph_capture.replays > 0  # decode steps replayed captured graphs
    assert list((cache / "tensorrt").glob("*.engine"))


def test_unknown_segment_backend_is_rejected():
    with pytest.raises(InvalidArgumentError, match="unknown segment backend"):
        SegmentedModelRunner(None, backend="openvino")
