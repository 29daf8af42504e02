"""LoRA through LLMEngine on CUDA: the fast path, its decode graphs and the Triton kernels.

A tiny random Llama in float32 with four hand-written PEFT adapters (different ranks and
modules) on two device slots. Requests of every adapter and the base model in flight together
must give exactly the tokens each gives alone on the same engine (graph replays read the slot
layout as inputs: a new mix needs no recapture; slots are evicted and refilled), and their
log-probabilities must agree with the CPU engine's (itself checked against transformers + peft
in tests/unit/engine/lora) while their tokens agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.model_files import ModelFiles
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.runner_factory import create_model_runner
from tests.lora_adapters import lora_tensors, peft_config, tiny_model_config, write_adapter
from tests.unit.engine.models.helpers import hf_config, save_random_model

MAX_TOKENS = 6
ADAPTERS = {
    "qv-r4": (["q_proj", "v_proj"], 4),
    "mlp-r8": (["gate_proj", "up_proj", "down_proj"], 8),
    "all-r2": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
    "ko-r6": (["k_proj", "o_proj"], 6),
}
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [2, 71, 82, 81, 82]]


class _Tokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, token_ids))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("lora-cuda")
    save_random_model(hf_config("llama"), directory / "base")
    config = tiny_model_config()
    for seed, (name, (modules, rank)) in enumerate(ADAPTERS.items()):
        tensors = {
            key: value * 0.1
            for key, value in lora_tensors(config, modules, rank, seed=seed).items()
        }
        write_adapter(directory / "adapters" / name, peft_config(modules, rank), tensors)
    return directory


def _llm(
    directory: Path,
    device: str,
    quantum_ms: float | None = None,
    max_loras: int = 2,
    fused_decode: bool = True,
    fused_swiglu: bool = True,
    side_deltas: bool = True,
    kv_cache_bytes: int = 16 << 20,
    swap_space_gib: float | None = None,
) -> LLM:
    slicing = {} if quantum_ms is None else {"lora_slot_quantum_ms": quantum_ms}
    config = EngineConfig(
        **slicing,
        swap_space_gib=swap_space_gib,
        lora_fused_decode=fused_decode,
        lora_fused_swiglu=fused_swiglu,
        lora_side_deltas=side_deltas,
        model=str(directory / "base"),
        device=device,
        dtype="float32",
        block_size=16,
        kv_cache_bytes=kv_cache_bytes,
        max_num_seqs=16,
        max_loras=max_loras,
        max_cpu_loras=4,
        max_lora_rank=8,
        adapter_root=str(directory / "adapters"),
        cpu_kernels=False,
    )
    # The runner from files that name the model's own directory as the tokenizer's: no
    # default-model tokenizer is needed where none is installed (the GPU machine).
    files = ModelFiles("tiny-lora", directory / "base", directory / "base")
    runner = create_model_runner(config, files)
    llm = LLM.from_engine(LLMEngine(config, model_runner=runner), _Tokenizer())
    for name in ADAPTERS:
        llm.add_adapter(name)
    return llm


def test_mixed_adapters_on_cuda_match_alone_and_the_cpu_engine(model_dir: Path) -> None:
    gpu = _llm(model_dir, "cuda")
    assert gpu.engine.runner.fast is not None and gpu.engine.adapters.runtime.kernels == "triton"
    # per row count the shrink and both expands of each projection, and for gate_up the
    # shrink and SwiGLU adding its deltas as it reads them (10,000: max_rows)
    assert gpu.engine.adapters.warm_up([1, 5, 64, 10_000]) == 4 * (4 * 4 + 2)
    cpu = _llm(model_dir, "cpu")
    names = [None, *ADAPTERS]
    jobs = [(name, prompt) for name in names for prompt in PROMPTS]
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [prompt for _, prompt in jobs]
    adapters = [name for name, _ in jobs]
    mixed = gpu.generate(prompts, greedy, adapters=adapters)  # overlapped greedy steps
    graphs_before = gpu.engine.runner.graph_steps
    scored = gpu.generate(prompts, with_logprobs, adapters=adapters)  # logits path
    assert gpu.engine.runner.graph_steps > graphs_before  # decode ran as graph replays
    reference = cpu.generate(prompts, with_logprobs, adapters=adapters)
    agreeing = 0
    for index, (name, prompt) in enumerate(jobs):
        alone = gpu.generate([prompt], greedy, adapters=name)[0]
        assert mixed[index].token_ids == alone.token_ids, (name, prompt)
        assert scored[index].token_ids[:1] == reference[index].token_ids[:1], name
        for fast, slow in zip(scored[index].logprobs, reference[index].logprobs, strict=True):
            if fast.token_id != slow.token_id:
                break  # the sequences diverge from here (a near tie)
            assert abs(fast.logprob - slow.logprob) < 2e-2, (name, fast, slow)
            agreeing += 1
    assert agreeing >= len(jobs) * MAX_TOKENS // 2
    assert gpu.engine.adapters.manager.num_slot_writes > 2  # two slots served four adapters
    graphs = gpu.engine.runner.fast.graphs
    assert graphs.variants == ("base", "lora", "lora-one")  # "lora": LoRA kernels beside
    assert graphs.replays["lora-one"] > 0  # each adapter alone
    lora_replays = graphs.replays["lora"]
    assert lora_replays > 0
    base_replays = graphs.replays["base"]
    gpu.generate(PROMPTS, greedy)  # no adapter rows: the graphs without the LoRA kernels
    assert graphs.replays["base"] > base_replays and graphs.replays["lora"] == lora_replays
    for llm in (gpu, cpu):
        llm.engine.shutdown()
    torch.cuda.synchronize()


def test_steps_of_one_adapter_fold_its_lora_into_the_base_kernels(model_dir: Path) -> None:
    """Decode steps whose adapter rows all use one adapter (beside base rows) replay the
    "lora-one" graphs, the LoRA inside the base matmul and the kernels after it: the same
    tokens and log-probabilities as the LoRA kernels give (--no-lora-fused-decode), for four
    adapters taking turns on two slots (a slot's new contents are copied in again)."""
    fused = _llm(model_dir, "cuda")
    plain = _llm(model_dir, "cuda", fused_decode=False)
    assert "lora-one" not in plain.engine.runner.fast.graphs.variants
    # The room below each weight was given at load and taken as it is: no weight held twice.
    runner, fold = fused.engine.runner, fused.engine.adapters.runtime.fused
    assert runner._fold_weights and not plain.engine.runner._fold_weights
    for key, buffer in runner._fold_weights.items():
        assert fold._weights[key] is buffer
    scored = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in [*ADAPTERS, *reversed(ADAPTERS)]:
        for params in (scored, greedy):
            got = fused.generate(PROMPTS, params, adapters=[name, None])
            want = plain.generate(PROMPTS, params, adapters=[name, None])
            for fast, slow in zip(got, want, strict=True):
                assert fast.token_ids == slow.token_ids, name
                for mine, theirs in zip(fast.logprobs or [], slow.logprobs or [], strict=True):
                    assert abs(mine.logprob - theirs.logprob) < 1e-3, (name, mine, theirs)
    graphs = fused.engine.runner.fast.graphs
    assert graphs.replays["lora-one"] > 0 and graphs.replays["lora"] == 0
    assert fused.engine.adapters.runtime.fused.activations >= 2 * len(ADAPTERS) - 1
    assert plain.engine.runner.fast.graphs.replays["lora"] > 0
    for llm in (fused, plain):
        llm.engine.shutdown()
    torch.cuda.synchronize()


def test_steps_of_many_adapters_replay_their_own_graphs_and_keep_every_token(
    model_dir: Path,
) -> None:
    """Four adapters resident at once, the LoRA kernels in line (--no-lora-side-deltas):
    decode steps of all four replay the graphs whose deltas go before the base matmul
    ("lora-many", the base model's rows and the bucket's padding written as zeros); each
    request's tokens stay those it gets alone."""
    gpu = _llm(model_dir, "cuda", max_loras=4, side_deltas=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Every adapter read from disk and in a slot first: loads run beside the steps, so a
    # request whose adapter is still loading would start steps later than the others.
    gpu.generate([PROMPTS[0]] * len(ADAPTERS), greedy, adapters=list(ADAPTERS))
    jobs = [(name, prompt) for name in [None, *ADAPTERS] for prompt in PROMPTS[:1]]
    jobs += [(name, PROMPTS[1]) for name in ADAPTERS]  # 9 rows: padded to a bucket of 16
    graphs = gpu.engine.runner.fast.graphs
    mixed = gpu.generate(
        [prompt for _, prompt in jobs], greedy, adapters=[name for name, _ in jobs]
    )
    assert graphs.replays["lora-many"] > 0
    for (name, prompt), output in zip(jobs, mixed, strict=True):
        assert output.token_ids == gpu.generate([prompt], greedy, adapters=name)[0].token_ids
    gpu.engine.shutdown()
    torch.cuda.synchronize()


def test_time_sliced_slots_with_steps_planned_ahead_keep_every_token(model_dir: Path) -> None:
    """Slots that change hands every millisecond: requests pause and resume while the engine
    plans steps ahead between the turns; each request's tokens stay those it gets alone."""
    gpu = _llm(model_dir, "cuda", quantum_ms=1.0)
    greedy = SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
    names = [name for name in ADAPTERS for _ in range(3)]
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(len(names))]
    mixed = gpu.generate(prompts, greedy, adapters=names)
    engine = gpu.engine
    assert engine.scheduler.num_pauses > 0 and engine.num_overlapped_steps > 0
    for name, prompt, output in zip(names, prompts, mixed, strict=True):
        alone = gpu.generate([prompt], greedy, adapters=name)[0]
        assert output.token_ids == alone.token_ids, (name, prompt)
    engine.shutdown()


# A KV block of the tiny model here: keys and values, 2 layers, 16 tokens, 2 heads of 16, float32.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def test_paused_sequences_swapped_to_pinned_host_memory_keep_every_token(model_dir: Path) -> None:
    """A KV cache too small for the paused sequences of slots changing hands every
    millisecond: with swap space (pinned host memory, copies on the step's stream) they move
    out and back with steps planned ahead, and each request's tokens stay those it gets alone
    on an engine with room; without swap space the same load preempts."""
    greedy = SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
    names = [name for name in ADAPTERS for _ in range(4)]
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(len(names))]
    roomy = _llm(model_dir, "cuda", quantum_ms=1.0)
    expected = [
        roomy.generate([prompt], greedy, adapters=name)[0].token_ids
        for name, prompt in zip(names, prompts, strict=True)
    ]
    roomy.engine.shutdown()
    counts = []
    for swap_blocks in (0, 64):
        gpu = _llm(
            model_dir,
            "cuda",
            quantum_ms=1.0,
            kv_cache_bytes=12 * BLOCK_BYTES,
            swap_space_gib=swap_blocks * BLOCK_BYTES / 1024**3,
        )
        mixed = gpu.generate(prompts, greedy, adapters=names)
        assert [output.token_ids for output in mixed] == expected
        scheduler = gpu.engine.scheduler
        counts.append((scheduler.num_swap_outs, scheduler.num_preemptions))
        assert scheduler.num_swap_ins == scheduler.num_swap_outs and not scheduler.paused
        assert gpu.engine.block_manager.num_free_blocks == gpu.engine.block_manager.num_blocks
        gpu.engine.shutdown()
    assert counts[0][0] == 0 and counts[0][1] > 0, counts
    assert counts[1][0] > 0 and counts[1][1] < counts[0][1], counts


@pytest.mark.parametrize("long_segment_rows", [None, 4])
def test_swiglu_taking_gate_up_deltas_keeps_every_token(
    model_dir: Path, long_segment_rows: int | None
) -> None:
    """SwiGLU taking gate_up's deltas (the default) in steps of several adapters (eager
    prefill and mixed steps, and, the LoRA kernels in line, the graphs of many adapters):
    each request's greedy tokens are those of an engine that writes every delta first
    (--no-lora-fused-swiglu), and the warm-up compiles that kernel too. long_segment_rows 4:
    the prompts are long runs (their u from cuBLAS, SwiGLU walking every row's tiles)."""
    fused = _llm(model_dir, "cuda", max_loras=4, side_deltas=False)
    plain = _llm(model_dir, "cuda", max_loras=4, fused_swiglu=False, side_deltas=False)
    runtime = fused.engine.adapters.runtime
    long_shrinks: list[int] = []
    if long_segment_rows is not None:
        for llm in (fused, plain):
            llm.engine.adapters.runtime.long_segment_rows = long_segment_rows
        shrink_long_runs = runtime._shrink_long_runs

        def counted(*args) -> None:
            long_shrinks.append(1)
            shrink_long_runs(*args)

        runtime._shrink_long_runs = counted
    assert runtime.tile_consumer is not None and plain.engine.adapters.runtime.tile_consumer is None
    # per row count the shrink and both expands of each projection, and for gate_up the
    # shrink and SwiGLU adding its deltas as it reads them
    assert fused.engine.adapters.warm_up([1, 5, 64]) == 3 * (4 * 4 + 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for llm in (fused, plain):  # every adapter in a slot first (as the test above)
        llm.generate([PROMPTS[0]] * len(ADAPTERS), greedy, adapters=list(ADAPTERS))
    names = [None, *ADAPTERS, *ADAPTERS]
    prompts = [PROMPTS[index % 2] for index in range(len(names))]
    got = fused.generate(prompts, greedy, adapters=names)
    want = plain.generate(prompts, greedy, adapters=names)
    for name, fast, slow in zip(names, got, want, strict=True):
        assert fast.token_ids == slow.token_ids, name
    assert runtime._pending is None
    assert bool(long_shrinks) == (long_segment_rows is not None)
    for llm in (fused, plain):
        llm.engine.shutdown()
    torch.cuda.synchronize()


def test_lora_kernels_beside_the_matmuls_keep_every_token(model_dir: Path) -> None:
    """--lora-side-deltas (the default): decode graphs of several adapters run each
    projection's LoRA kernels on a second stream beside its base matmul, and the norm, SwiGLU
    and rotary kernels add the deltas they wrote. Each request's greedy tokens (base rows, a
    bucket's padding and four adapters in one step) are those of the engine running the
    kernels in line, and their log-probabilities agree; no "lora-many" graphs are captured."""
    beside = _llm(model_dir, "cuda", max_loras=4, side_deltas=True)
    inline = _llm(model_dir, "cuda", max_loras=4, side_deltas=False)
    graphs = beside.engine.runner.fast.graphs
    assert "lora" in graphs.variants and "lora-many" not in graphs.variants
    assert "lora-many" in inline.engine.runner.fast.graphs.variants
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for llm in (beside, inline):  # every adapter in a slot first (as the tests above)
        llm.generate([PROMPTS[0]] * len(ADAPTERS), greedy, adapters=list(ADAPTERS))
    names = [None, *ADAPTERS, *ADAPTERS]  # 9 rows: a bucket of 16 with padding
    prompts = [PROMPTS[index % 2] for index in range(len(names))]
    before = graphs.replays["lora"]
    got = beside.generate(prompts, greedy, adapters=names)
    want = inline.generate(prompts, greedy, adapters=names)
    assert graphs.replays["lora"] > before
    for name, side, line in zip(names, got, want, strict=True):
        assert side.token_ids == line.token_ids, name
        for side_step, line_step in zip(side.logprobs, line.logprobs, strict=True):
            assert side_step.logprob == pytest.approx(line_step.logprob, abs=1e-4), name
    assert beside.engine.adapters.runtime._pending is None
    for llm in (beside, inline):
        llm.engine.shutdown()
    torch.cuda.synchronize()
