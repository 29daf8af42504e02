"""`sluice up --tensor-parallel-size 2` on CPU: one engine over two rank processes (gloo), served
through the router, its greedy tokens equal to a single-rank engine's; SIGTERM takes every
process down, the rank processes included."""

from __future__ import annotations

import signal
import sys

import pytest

from services.client import SluiceClient
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from tests.integration.processes import cmdline, descendants, start_sluice_up, wait_until_gone

PROMPT_IDS = [1, 17, 300, 4096, 77, 9]
MAX_TOKENS = 12


def single_rank_tokens() -> list[int]:
    engine = LLMEngine(
        EngineConfig(model="dummy:tiny", device="cpu", dtype="float32", kv_cache_bytes=8 << 20)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("r", PROMPT_IDS, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens += delta.new_token_ids
    return tokens


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sluice_up_serves_one_engine_split_over_two_ranks() -> None:
    process, port = start_sluice_up(
        *("--no-ray", "--no-redis", "--device", "cpu", "--engines", "1"),
        *("--tensor-parallel-size", "2", "--startup-timeout-s", "300"),
        "--engine-args=--dtype float32 --shutdown-grace-s 2",
    )
    try:
        ready = process.stdout.readline()
        assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
        family = descendants(process.pid)
        ranks = [pid for pid in family if "services.engine.parallel.rank_main" in cmdline(pid)]
        assert len(ranks) == 1  # rank 1, a child of the engine (rank 0)
        with SluiceClient(f"127.0.0.1:{port}", timeout_s=120.0) as client:
            completion = client.complete(
                token_ids=PROMPT_IDS,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            )
            info = client.list_models()[0]
        assert completion.token_ids == single_rank_tokens()
        assert info.name == "dummy:tiny"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        assert not wait_until_gone(family, timeout_s=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
