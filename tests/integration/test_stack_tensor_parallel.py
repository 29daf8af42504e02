"""`sluice up --tensor-parallel-size 2` on CPU: one engine over two rank processes (gloo), served
through the router, its greedy tokens equal to a single-rank engine's. A crashed rank takes its
engine down and the launcher restarts the whole group; a crashed engine takes its rank along.
SIGTERM takes every process down, the rank processes included."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import grpc
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


def rank_processes(root: int) -> list[int]:
    """The tensor-parallel rank processes under `root`."""
    return [pid for pid in descendants(root) if "parallel.rank_main" in cmdline(pid)]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def complete_when_served(port: int, timeout_s: float) -> list[int]:
    """The greedy tokens of PROMPT_IDS, retrying while the engine restarts."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with SluiceClient(f"127.0.0.1:{port}", timeout_s=60.0) as client:
                return client.complete(
                    token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                ).token_ids
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def replaced(old: list[int], root: int, timeout_s: float) -> list[int]:
    """Wait until `old` rank processes are gone and a new one runs; the new ones."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = rank_processes(root)
        if now and not set(now) & set(old):
            return now
        time.sleep(0.2)
    raise AssertionError(f"no new rank process replaced {old} within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sluice_up_serves_one_engine_split_over_two_ranks_and_survives_crashes() -> None:
    process, port = start_sluice_up(
        *("--no-ray", "--no-redis", "--device", "cpu", "--engines", "1"),
        *("--tensor-parallel-size", "2", "--startup-timeout-s", "300"),
        "--engine-args=--dtype float32 --shutdown-grace-s 2",
    )
    try:
        ready = process.stdout.readline()
        assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
        ranks = rank_processes(process.pid)
        assert len(ranks) == 1  # rank 1, a child of the engine (rank 0)
        engine = parent_of(ranks[0])
        reference = single_rank_tokens()
        with SluiceClient(f"127.0.0.1:{port}", timeout_s=120.0) as client:
            assert client.list_models()[0].name == "dummy:tiny"
        assert complete_when_served(port, 60) == reference

        os.kill(ranks[0], signal.SIGKILL)  # a rank dies: its engine stops, the launcher
        ranks = replaced(ranks, process.pid, 120)  # restarts the whole group
        assert not wait_until_gone([engine], timeout_s=10)
        assert complete_when_served(port, 120) == reference

        engine = parent_of(ranks[0])
        os.kill(engine, signal.SIGKILL)  # the engine dies: its rank leaves with it
        assert not wait_until_gone(ranks, timeout_s=10)
        ranks = replaced(ranks, process.pid, 120)
        assert complete_when_served(port, 120) == reference

        family = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        assert not wait_until_gone(family, timeout_s=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
