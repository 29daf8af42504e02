"""LoRA through LLMEngine and the offline `LLM.generate`, on a tiny random Llama in float32.

Every request's greedy tokens must equal transformers + peft with its adapter alone (the base
model for base requests), with all adapters in flight together: four adapters on four slots,
eight adapters on two slots (slots evicted and refilled while requests wait), a name
re-registered with new files (the prefix cache must not serve the old files' KV), a load that
fails its checksum (that request ends with the error, the others go on), and unknown names.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.common.errors import FailedPreconditionError, NotFoundError
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.lora.engine_adapters import TIME_SLICED_INFLIGHT_FACTOR
from services.engine.model_runner import RunnerCapabilities
from services.engine.outputs import FinishReason
from services.engine.sequence import PENDING_TOKEN
from tests.lora_adapters import ALL_MODULES, MIXED_ADAPTERS, write_peft_adapters
from tests.unit.engine.models.helpers import TINY_COMMON, hf_config, save_random_model

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
EIGHT_ADAPTERS = {
    **MIXED_ADAPTERS,
    "q-r3": {"r": 3, "lora_alpha": 3, "target_modules": ["q_proj"]},
    "down-r5": {"r": 5, "lora_alpha": 10, "target_modules": ["down_proj"]},
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES},
    "up-v-r1": {"r": 1, "lora_alpha": 2, "target_modules": ["up_proj", "v_proj"]},
}


class _Tokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(token) for token in token_ids)


def _prompts(count: int, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = TINY_COMMON["vocab_size"]
    # Two prompts share their first 8 tokens (two full blocks): prefix-cache candidates.
    shared = torch.randint(0, vocab, (8,), generator=generator).tolist()
    prompts = []
    for index in range(count):
        tail = torch.randint(0, vocab, (3 + index % 5,), generator=generator).tolist()
        prompts.append(shared + tail if index < 2 else tail + shared[: index % 7])
    return prompts


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory):
    """A tiny base model, eight adapters under one root and every peft reference."""
    directory = tmp_path_factory.mktemp("lora-llm")
    base = save_random_model(hf_config("llama"), directory / "base")
    prompts = _prompts(3)
    references = write_peft_adapters(
        base, directory / "adapters", EIGHT_ADAPTERS, prompts, MAX_TOKENS
    )
    return directory, prompts, references


def _llm(directory: Path, adapter_root: Path | None = None, **lora: object) -> LLM:
    """An offline LLM on the tiny base model; adapters under `adapter_root` (default: all)."""
    return LLM.from_engine(LLMEngine(_config(directory, adapter_root, **lora)), _Tokenizer())


def _config(directory: Path, adapter_root: Path | None = None, **lora: object) -> EngineConfig:
    settings: dict[str, object] = {"kv_cache_bytes": 1 << 20, **lora}
    return EngineConfig(
        model=str(directory / "base"),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_seqs=32,
        max_lora_rank=8,
        adapter_root=str(adapter_root or directory / "adapters"),
        **settings,
    )


def _check_all_in_flight(llm: LLM, names: list[str | None], prompts, references) -> None:
    jobs = [(name, index) for name in names for index in range(len(prompts))]
    outputs = llm.generate(
        [prompts[index] for _, index in jobs], GREEDY, adapters=[name for name, _ in jobs]
    )
    changed = set()
    for (name, index), output in zip(jobs, outputs, strict=True):
        assert output.finish_reason is FinishReason.LENGTH, output.error
        assert output.adapter == name
        assert output.token_ids == references[name][index], (name, index)
        if output.token_ids != references[None][index]:
            changed.add(name)
    assert changed == {name for name in names if name is not None}  # each adapter matters


def test_base_and_four_adapters_in_flight_match_peft(eight) -> None:
    directory, prompts, references = eight
    llm = _llm(directory, max_loras=4, max_cpu_loras=4)
    assert llm.engine.adapters.warm_up([1, 7]) == 0  # the CPU path compiles no kernels
    for name in MIXED_ADAPTERS:
        record = llm.add_adapter(name)
        assert record.rank == MIXED_ADAPTERS[name]["r"] and len(record.sha256) == 64
    engine = llm.engine
    assert engine.info.max_loras == 4 and engine.info.max_lora_rank == 8
    _check_all_in_flight(llm, [None, *MIXED_ADAPTERS], prompts, references)
    load = engine.load()
    assert sorted(load.resident_adapters) == sorted(MIXED_ADAPTERS)
    assert load.lora_slots == 4 and load.loading_adapters == ()
    assert engine.adapters.gate.num_held == 0
    # Again, now resident: same tokens, and the shared prefix comes from each adapter's cache.
    outputs = llm.generate(prompts[:2], GREEDY, adapters="all-r2")
    assert [output.token_ids for output in outputs] == references["all-r2"][:2]
    assert all(output.num_cached_prompt_tokens >= 8 for output in outputs)
    engine.shutdown()


def test_eight_adapters_on_two_slots_stay_correct_under_eviction(eight) -> None:
    directory, prompts, references = eight
    llm = _llm(directory, max_loras=2, max_cpu_loras=3)
    for name in EIGHT_ADAPTERS:
        llm.add_adapter(name)
    manager = llm.engine.adapters.manager
    _check_all_in_flight(llm, [None, *EIGHT_ADAPTERS], prompts, references)
    assert manager.num_slot_writes >= len(EIGHT_ADAPTERS)  # slots were evicted and refilled
    assert manager.num_loads >= len(EIGHT_ADAPTERS)
    assert len(llm.engine.load().resident_adapters) <= 2
    # Twice more in reverse order: adapters evicted from the host cache load again.
    names = [*reversed(EIGHT_ADAPTERS), None]
    _check_all_in_flight(llm, names, prompts, references)
    assert manager.num_loads > len(EIGHT_ADAPTERS)
    llm.engine.shutdown()


@pytest.mark.parametrize("quantum_ms", [0.0, 0.001])
def test_time_sliced_slots_pause_and_resume_without_changing_tokens(eight, quantum_ms) -> None:
    directory, prompts, references = eight
    llm = _llm(directory, max_loras=2, max_cpu_loras=8, lora_slot_quantum_ms=quantum_ms)
    for name in EIGHT_ADAPTERS:
        llm.add_adapter(name)
    engine = llm.engine
    assert engine.load().lora_adapter_capacity == (8 if quantum_ms else 2)
    # Waiting for a turn in a slot takes no place in a step's batch: more in flight than a batch.
    max_num_seqs = engine.info.max_num_seqs
    factor = TIME_SLICED_INFLIGHT_FACTOR if quantum_ms else 1
    assert engine.info.max_inflight == factor * max_num_seqs
    _check_all_in_flight(llm, [None, *EIGHT_ADAPTERS], prompts, references)
    scheduler = engine.scheduler
    if quantum_ms:  # slots changed hands mid-request: paused sequences resumed with their KV
        assert scheduler.num_pauses > 0 and scheduler.num_preemptions == 0
    else:
        assert scheduler.num_pauses == 0
    assert not scheduler.paused and engine.adapters.gate.num_held == 0
    engine.shutdown()


class _LaunchingRunner:
    """A real CPU runner that declares it launches steps without waiting and takes pending
    tokens in any step (as the CUDA fast path does on the device): the engine then plans steps
    ahead across admissions and slot turns. Each launch runs at once, its pending tokens taken
    from the previous launch's ids; everything else is the wrapped runner's."""

    capabilities = RunnerCapabilities(greedy_ids=True, overlap_max_batch=64, overlap_mixed=True)

    def __init__(self, inner) -> None:
        self._inner = inner
        self._previous: dict[int, int] = {}
        self.pending_launches = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def launch_greedy(self, batch: ScheduledBatch) -> SimpleNamespace:
        rows = []
        for seq in batch.sequences:
            if seq.token_ids == [PENDING_TOKEN]:
                seq = dataclasses.replace(seq, token_ids=[self._previous[seq.seq_id]])
                self.pending_launches += 1
            rows.append(seq)
        ids = self._inner.execute_greedy(ScheduledBatch(rows)).tolist()
        sampled = [seq.seq_id for seq in batch.sequences if seq.needs_logits]
        self._previous = dict(zip(sampled, ids, strict=True))
        return SimpleNamespace(result=lambda: list(ids))


def test_slot_turns_planned_ahead_keep_every_token(eight) -> None:
    """Steps planned before the last one's tokens are read pause, resume and admit requests
    of adapters taking turns in two slots: every request's tokens still equal peft's."""
    directory, prompts, references = eight
    config = _config(directory, max_loras=2, max_cpu_loras=8, lora_slot_quantum_ms=0.001)
    config, inner = LLMEngine._build_runner(config)
    runner = _LaunchingRunner(inner)
    llm = LLM.from_engine(LLMEngine(config, model_runner=runner), _Tokenizer())
    for name in EIGHT_ADAPTERS:
        llm.add_adapter(name)
    _check_all_in_flight(llm, [None, *EIGHT_ADAPTERS], prompts, references)
    engine = llm.engine
    assert engine.scheduler.num_pauses > 0 and engine.scheduler.num_preemptions == 0
    assert engine.num_overlapped_steps > 0 and runner.pending_launches > 0
    assert not engine.scheduler.paused and engine.adapters.gate.num_held == 0
    assert engine.block_manager.num_free_blocks == runner.num_blocks
    engine.shutdown()


# A KV block of the tiny model: keys and values, 2 layers, 4 tokens, 2 heads of 16, float32.
TINY_BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


@pytest.mark.parametrize("ahead", [False, True])
def test_paused_sequences_swapped_to_host_memory_keep_every_token(eight, ahead) -> None:
    """A KV cache too small for every paused sequence: with swap space, paused sequences move
    to host memory and back instead of being recomputed, and every request's tokens still
    equal peft's (planned ahead too); without it, the same load preempts."""
    directory, prompts, references = eight
    names = [None, *EIGHT_ADAPTERS]
    counts = {}
    for swap_blocks in (0, 64):
        config = _config(
            directory,
            max_loras=2,
            max_cpu_loras=8,
            lora_slot_quantum_ms=0.001,
            kv_cache_bytes=24 * TINY_BLOCK_BYTES,
            swap_space_gib=swap_blocks * TINY_BLOCK_BYTES / 1024**3,
        )
        config, runner = LLMEngine._build_runner(config)
        if ahead:
            runner = _LaunchingRunner(runner)
        engine = LLMEngine(config, model_runner=runner)
        llm = LLM.from_engine(engine, _Tokenizer())
        for name in EIGHT_ADAPTERS:
            llm.add_adapter(name)
        _check_all_in_flight(llm, names, prompts, references)
        scheduler = engine.scheduler
        counts[swap_blocks] = (scheduler.num_swap_outs, scheduler.num_preemptions)
        assert scheduler.num_swap_ins == scheduler.num_swap_outs
        assert not scheduler.paused and engine.adapters.gate.num_held == 0
        assert engine.block_manager.num_free_blocks == runner.num_blocks
        if swap_blocks:
            assert scheduler.host_blocks.num_free == scheduler.host_blocks.num_blocks == 64
        else:
            assert scheduler.host_blocks is None and engine.kv_swap is None
        engine.shutdown()
    (swaps_off, preempted_off), (swaps_on, preempted_on) = counts[0], counts[64]
    assert swaps_off == 0 and preempted_off > 0  # the cache is short: paused KV is recomputed
    assert swaps_on > 0 and preempted_on < preempted_off


def test_new_files_under_a_name_never_reuse_the_old_kv(eight, tmp_path: Path) -> None:
    directory, prompts, references = eight
    root = tmp_path / "adapters"
    shutil.copytree(directory / "adapters" / "attn-r4", root / "swap")
    llm = _llm(directory, root)
    first = llm.add_adapter("swap")
    outputs = llm.generate(prompts[:2], GREEDY, adapters="swap")
    assert [output.token_ids for output in outputs] == references["attn-r4"][:2]
    shutil.rmtree(root / "swap")
    shutil.copytree(directory / "adapters" / "all-r8", root / "swap")
    second = llm.add_adapter("swap")
    assert second.sha256 != first.sha256
    outputs = llm.generate(prompts[:2], GREEDY, adapters="swap")
    assert [output.token_ids for output in outputs] == references["all-r8"][:2]
    llm.engine.shutdown()


def test_failed_load_ends_only_its_requests(eight, tmp_path: Path) -> None:
    directory, prompts, references = eight
    root = tmp_path / "adapters"
    shutil.copytree(directory / "adapters" / "q-r3", root / "changed")
    llm = _llm(directory, root)
    llm.add_adapter("changed")
    # The files change after registration: the load's checksum check refuses them.
    shutil.copy(
        directory / "adapters" / "down-r5" / "adapter_model.safetensors",
        root / "changed" / "adapter_model.safetensors",
    )
    outputs = llm.generate(prompts[:2], GREEDY, adapters=["changed", None])
    assert outputs[0].finish_reason is FinishReason.ERROR
    assert "checksum" in outputs[0].error or "sha256" in outputs[0].error
    assert outputs[1].token_ids == references[None][1]
    assert llm.engine.adapters.gate.num_held == 0
    llm.engine.shutdown()


def test_unknown_adapters_are_refused_before_queueing(eight) -> None:
    directory, prompts, _ = eight
    llm = _llm(directory)
    with pytest.raises(NotFoundError, match="nope"):
        llm.generate(prompts[:1], GREEDY, adapters="nope")
    assert not llm.engine.has_unfinished()
    llm.engine.shutdown()
    base_only = LLM.from_engine(
        LLMEngine(
            EngineConfig(model=str(directory / "base"), device="cpu", kv_cache_bytes=1 << 20)
        ),
        _Tokenizer(),
    )
    assert base_only.engine.info.max_loras == 0
    with pytest.raises(NotFoundError, match="LoRA adapters are off"):
        base_only.generate(prompts[:1], GREEDY, adapters="attn-r4")
    with pytest.raises(FailedPreconditionError):
        base_only.add_adapter("attn-r4")


def test_step_loop_sleeps_while_only_adapter_loads_are_pending(eight) -> None:
    import threading
    import time

    from services.engine.engine_loop import EngineLoop, Submit

    directory, prompts, references = eight
    llm = _llm(directory, max_loras=2, max_cpu_loras=2)
    llm.add_adapter("q-r3")
    engine = llm.engine
    manager = engine.adapters.manager
    load = manager._load

    def slow_load(record):  # noqa: ANN001, ANN202 - a disk that takes its time
        time.sleep(0.6)
        return load(record)

    manager._load = slow_load
    steps = 0
    step = engine.step

    def counted_step():  # noqa: ANN202
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    done = threading.Event()
    tokens: list[int] = []

    def on_output(output) -> None:  # noqa: ANN001
        for delta in output.deltas:
            tokens.extend(delta.new_token_ids)
            if delta.finished:
                done.set()

    loop = EngineLoop(engine, on_output, load_report_interval_s=5.0)
    loop.start()
    loop.submit([Submit("r", prompts[0], GREEDY, adapter="q-r3")])
    assert done.wait(30)
    loop.stop()
    engine.shutdown()
    assert tokens == references["q-r3"][0]
    # One step finds the adapter loading, the loop sleeps until the load ends, then the
    # request's steps run: no busy stepping through the 0.6 s load.
    assert steps <= MAX_TOKENS + 4, steps


@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])
def test_lora_is_refused_where_the_forward_would_not_apply_it(backend: str) -> None:
    config = EngineConfig(
        model="dummy:tiny", device="cpu", backend=backend, adapter_root="/srv/adapters"
    )
    with pytest.raises(FailedPreconditionError, match=f"{backend} backend"):
        LLMEngine(config)
