"""Tensor parallelism on CPU: TP=2 over gloo in two processes gives TP=1's logits and tokens.

The group is started as `sluice serve engine --tensor-parallel-size 2` starts it (LLMEngine
builds its runner; rank 1 is a child process running rank_main), on dummy:tiny in float32.
A TP=4 split with KV heads shared by two ranks each, and TP=2 on a Hugging Face checkpoint
with biases, run in threads of this process over the same runner and rank loop code, with a
barrier standing in for the collectives.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles, resolve_model
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.cpu_runner import CpuModelRunner
from services.engine.llm_engine import LLMEngine
from services.engine.parallel import guard, launch
from services.engine.parallel.channel import StepChannel
from services.engine.parallel.group import TensorParallelRank
from services.engine.parallel.launch import create_parallel_runner
from services.engine.parallel.rank_main import serve_steps
from tests.unit.engine.models.helpers import (
    BlockAllocator,
    files_for,
    hf_config,
    save_random_model,
    step,
)

BLOCK_SIZE = 16
SETTINGS = dict(
    model="dummy:tiny",
    device="cpu",
    dtype="float32",
    block_size=BLOCK_SIZE,
    kv_cache_bytes=1 << 20,
    cpu_kernels=False,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    warm_up=False,
)
PROMPTS = [list(range(5, 45)), [7, 8, 9], [300, 301, 302, 303, 304, 305, 306]]


@pytest.fixture(scope="module")
def single() -> LLMEngine:
    return LLMEngine(EngineConfig(**SETTINGS))


@pytest.fixture(scope="module")
def pair() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(**SETTINGS, tensor_parallel_size=2))
    tensor_parallel = engine.runner.tensor_parallel
    followers = list(tensor_parallel.followers)
    yield engine
    tensor_parallel.close()
    assert [process.returncode for process in followers] == [0]  # left on rank 0's stop


def run_steps(runner, steps: int, prompts: list[list[int]] = PROMPTS) -> list[torch.Tensor]:
    """A prefill of every prompt, then decode steps of each greedy token; the logits of each."""
    allocator = BlockAllocator(runner.num_blocks // 2, BLOCK_SIZE, seed=1)
    lengths = {seq: len(tokens) for seq, tokens in enumerate(prompts)}
    pieces = [(seq, list(tokens), 0, True) for seq, tokens in enumerate(prompts)]
    results = []
    for _ in range(steps):
        logits = runner.execute(step(allocator, pieces))
        results.append(logits)
        ids = logits.argmax(-1).tolist()
        pieces = [(seq, [ids[seq]], lengths[seq], True) for seq in lengths]
        lengths = {seq: length + 1 for seq, length in lengths.items()}
    return results


def generate(engine: LLMEngine, max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{index}": [] for index in range(len(PROMPTS))}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens[delta.request_id] += delta.new_token_ids
    return tokens


def test_two_ranks_give_the_logits_of_one(single: LLMEngine, pair: LLMEngine):
    assert pair.runner.model_config.num_heads == 2  # rank 0 holds half the heads
    assert pair.runner.model_config.num_kv_heads == 1
    assert pair.runner.model.head_weight.shape[0] == 49152 // 2  # and half the vocabulary
    assert pair.info.execution_path == "torch ops, tensor parallel over 2 ranks (gloo all-reduce)"
    for ours, reference in zip(run_steps(pair.runner, 4), run_steps(single.runner, 4), strict=True):
        assert ours.shape == reference.shape == (3, single.runner.model_config.vocab_size)
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_two_ranks_generate_the_greedy_tokens_of_one(single: LLMEngine, pair: LLMEngine):
    ours = generate(pair, 12)
    assert ours == generate(single, 12)
    assert all(len(tokens) == 12 for tokens in ours.values())


def test_a_size_the_model_cannot_split_is_refused_before_any_rank_starts():
    config = EngineConfig(**SETTINGS, tensor_parallel_size=3)
    with pytest.raises(InvalidArgumentError, match="does not divide the 4 attention heads"):
        create_parallel_runner(config, resolve_model("dummy:tiny"))


def test_exported_graphs_and_lora_are_refused_with_tensor_parallelism():
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size > 1"):
        EngineConfig(**{**SETTINGS, "backend": "onnxruntime"}, tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError, match="LoRA adapters"):
        EngineConfig(**SETTINGS, tensor_parallel_size=2, adapter_root="/tmp")
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(**SETTINGS, tensor_parallel_size=0)


class ThreadGroup:
    """The collectives of TensorParallelGroup between threads of this process."""

    def __init__(self, rank: int, world_size: int, shared: dict, barrier: threading.Barrier):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self._shared, self._barrier = shared, barrier

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._shared[self.rank] = tensor.clone()
        self._barrier.wait()
        values = [self._shared[rank] for rank in range(self.world_size)]
        self._barrier.wait()
        return values

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        values = self._exchange(tensor)
        total = values[0].clone()
        for value in values[1:]:
            total += value
        return tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor))

    def min_int(self, value: int) -> int:
        return min(int(v) for v in self._exchange(torch.tensor([value])))

    def close(self) -> None:
        pass


def logits_over_threads(files: ModelFiles, world_size: int, prompts: list[list[int]]) -> list:
    """run_steps' logits on rank 0 of `world_size` ranks in threads of this process."""
    barrier, shared = threading.Barrier(world_size), {}
    writer = StepChannel.create(readers=world_size - 1)
    channels = [writer] + [
        StepChannel.attach(writer.path, rank, world_size - 1) for rank in range(1, world_size)
    ]
    writer.unlink()
    ranks = [
        TensorParallelRank(ThreadGroup(rank, world_size, shared, barrier), channels[rank])
        for rank in range(world_size)
    ]
    runners: dict[int, CpuModelRunner] = {}
    errors: list[BaseException] = []

    def build_and_serve(rank: int) -> None:
        try:
            runners[rank] = tiny_cpu_runner(files, ranks[rank])
            if rank > 0:
                serve_steps(runners[rank], ranks[rank])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=build_and_serve, args=(r,)) for r in range(1, world_size)]
    for thread in threads:
        thread.start()
    build_and_serve(0)
    try:
        assert not errors
        assert runners[0].model_config.num_heads * world_size == 4
        return run_steps(runners[0], 3, prompts)
    finally:
        if not errors:
            ranks[0].send_stop()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors


def tiny_cpu_runner(files: ModelFiles, tensor_parallel: TensorParallelRank | None):
    return CpuModelRunner(
        files,
        dtype=torch.float32,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=1 << 20,
        cpu_kernels=False,
        tensor_parallel=tensor_parallel,
    )


def test_four_ranks_with_shared_kv_heads_give_the_logits_of_one(single: LLMEngine):
    files = resolve_model("dummy:tiny")  # 4 query heads, 2 KV heads: each KV head on 2 ranks
    ours = logits_over_threads(files, 4, PROMPTS)
    for mine, reference in zip(ours, run_steps(single.runner, 3), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6)


def test_two_ranks_on_a_checkpoint_with_biases_give_its_logits(tmp_path: Path):
    # q/k/v, o_proj and MLP biases: column shards cut theirs, row-parallel ones add theirs once.
    save_random_model(hf_config("llama", attention_bias=True, mlp_bias=True), tmp_path, seed=5)
    files = files_for(tmp_path)
    prompts = [list(range(3, 40)), [9, 8, 7, 6]]
    ours = logits_over_threads(files, 2, prompts)
    reference = run_steps(tiny_cpu_runner(files, None), 3, prompts)
    for mine, theirs in zip(ours, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_rank_zero_leaves_when_a_rank_process_ends_unasked(monkeypatch):
    exits: list[int] = []
    exited = threading.Event()

    def record_exit(code: int) -> None:
        exits.append(code)
        exited.set()

    monkeypatch.setattr(guard, "leave_process", record_exit)
    monkeypatch.setattr(launch, "RANK_CHECK_S", 0.05)
    stopping = threading.Event()
    lost = subprocess.Popen([sys.executable, "-c", "pass"])
    watcher = launch.exit_when_a_rank_dies([lost], stopping)
    assert exited.wait(10)
    assert exits[:1] == [1]
    stopping.set()
    watcher.join(5)

    asked = subprocess.Popen([sys.executable, "-c", "pass"])
    stopping, exits[:] = threading.Event(), []
    stopping.set()  # the group was stopped: its ranks end on purpose
    launch.exit_when_a_rank_dies([asked], stopping).join(5)
    asked.wait(10)
    assert exits == []


def test_closing_releases_graphs_before_leaving_the_group():
    events: list[str] = []

    class RecordingGroup(ThreadGroup):
        def close(self) -> None:
            events.append("left the group")

    writer = StepChannel.create(readers=1)
    reader = StepChannel.attach(writer.path, 1, 1)
    writer.unlink()
    rank = TensorParallelRank(RecordingGroup(1, 2, {}, threading.Barrier(1)), reader)
    rank.before_leaving.append(lambda: events.append("graphs released"))
    rank.close()
    assert events == ["graphs released", "left the group"]
    assert rank.custom is None and rank.before_leaving == []
    writer.close()


def test_a_failure_after_the_step_was_sent_ends_the_engine(monkeypatch):
    codes: list[int] = []
    monkeypatch.setattr(guard, "leave_process", codes.append)
    writer = StepChannel.create(readers=1)
    writer.unlink()
    rank = TensorParallelRank(ThreadGroup(0, 2, {}, threading.Barrier(1)), writer)
    with guard.after_send(rank):
        pass
    assert codes == []
    with pytest.raises(RuntimeError, match="forward broke"), guard.after_send(rank):
        raise RuntimeError("forward broke")
    assert codes == [1]
    with pytest.raises(RuntimeError), guard.after_send(None):  # no group: just the error
        raise RuntimeError("forward broke")
    assert codes == [1]
    writer.close()
