"""dummy:llama-3-70b served at TP=2 (2+ GPUs of 80 GB): its half of the layers is ~68.5 GB,
plus the replicated embedding and its half of the LM head, so it needs the GPUs to itself: run
this file in a pytest process of its own (benchmarks/multi_gpu_run.sh does)."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.gpu.test_tensor_parallel import SETTINGS, generate


@pytest.mark.skipif(
    torch.cuda.device_count() < 2
    or min(torch.cuda.get_device_properties(i).total_memory for i in range(2)) < 79 << 30,
    reason="dummy:llama-3-70b at TP=2 needs an 80 GB GPU per rank",
)
def test_llama_3_70b_serves_at_tp2() -> None:
    settings = {**SETTINGS, "dtype": "bfloat16", "kv_cache_bytes": 1 << 30}
    engine = LLMEngine(EngineConfig(model="dummy:llama-3-70b", tensor_parallel_size=2, **settings))
    try:
        tokens = generate(engine, 8)
        assert [len(row) for row in tokens] == [8, 8, 8]
        assert engine.runner.model_config.num_heads == 32
    finally:
        engine.runner.tensor_parallel.close()
