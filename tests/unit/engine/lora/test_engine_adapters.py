"""Base + 6 random PEFT adapters in flight together on 2 device slots: greedy tokens equal
transformers + peft with each adapter alone, through the scheduler, the background loader,
slot eviction and the CPU runner (the engine's loop, minus sampling options)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.cpu_runner import CpuModelRunner
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence
from tests.lora_adapters import ALL_MODULES, save_peft_adapter
from tests.unit.engine.models.helpers import files_for, hf_config, save_random_model

MAX_TOKENS = 6
ADAPTERS = {
    "q-v-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "mlp-r8-rs": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
    },
    "all-r2": {"r": 2, "lora_alpha": 3, "target_modules": ALL_MODULES},
    "k-o-pattern": {
        "r": 6,
        "lora_alpha": 6,
        "target_modules": ["k_proj", "o_proj"],
        "rank_pattern": {"o_proj": 3},
    },
    "o-r1": {"r": 1, "lora_alpha": 2, "target_modules": ["o_proj"]},
    "last-layer-all": {
        "r": 5,
        "lora_alpha": 10,
        "target_modules": ALL_MODULES,
        "layers_to_transform": [1],
    },
}


def _greedy(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_adapters_in_flight_on_two_slots_match_peft(tmp_path: Path) -> None:
    base = save_random_model(hf_config("llama"), tmp_path / "base")
    root = tmp_path / "adapters"
    references = {
        name: save_peft_adapter(base, root / name, seed=index + 1, **options)
        for index, (name, options) in enumerate(ADAPTERS.items())
    }
    runner = CpuModelRunner(
        files_for(tmp_path / "base"), dtype=torch.float32, block_size=4, kv_cache_bytes=1 << 20
    )
    config = LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=8, adapter_root=str(root))
    load_done = threading.Event()
    adapters = EngineAdapters(
        config,
        runner.model_config,
        dtype=torch.float32,
        device="cpu",
        on_load_done=load_done.set,
    )
    for name in ADAPTERS:
        adapters.register(adapters.inspect(name, name))
    adapters.attach(runner.model)
    block_manager = BlockManager(runner.num_blocks, 4, True)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        block_manager,
        adapter_slots=adapters.gate,
    )
    generator = torch.Generator().manual_seed(3)
    names = [None, *ADAPTERS, "q-v-r4", None]
    sequences = []
    for seq_id, name in enumerate(names):
        prompt = torch.randint(0, 128, (3 + seq_id % 4,), generator=generator).tolist()
        seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=16), adapter=name)
        adapters.gate.hold(seq)
        scheduler.add(seq)
        sequences.append(seq)

    live = set(range(len(sequences)))
    deadline = time.monotonic() + 60
    most_slots = 0
    while live and time.monotonic() < deadline:
        load_done.clear()
        assert adapters.gate.poll() == []
        output = scheduler.schedule()
        if output.is_empty:  # only loads in flight: sleep until one ends
            assert adapters.manager.num_loading > 0
            load_done.wait(5)
            continue
        slots_in_use = {item.adapter_slot for item in output.batch.sequences} - {-1}
        most_slots = max(most_slots, len(slots_in_use))
        adapters.begin_step(output.batch)
        logits = runner.execute(output.batch)
        row = 0
        for seq, count in output.scheduled:
            seq.num_computed_tokens += count
            block_manager.register_computed_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.append_token(int(logits[row].argmax()))
            row += 1
            if seq.num_output_tokens == MAX_TOKENS:
                scheduler.finish(seq)
                adapters.gate.drop(seq)
                live.discard(seq.seq_id)
    adapters.shutdown()
    assert not live, "sequences still unfinished"
    assert most_slots == 2 and adapters.manager.num_slot_writes >= len(ADAPTERS)
    assert adapters.manager.num_loads >= len(ADAPTERS)
    changed = 0  # sequences whose adapter changes the greedy answer (so a mix-up would show)
    for seq in sequences:
        model = base if seq.adapter is None else references[seq.adapter]
        expected = _greedy(model, seq.prompt_token_ids, MAX_TOKENS)
        assert seq.output_token_ids == expected, (seq.adapter, seq.seq_id)
        changed += expected != _greedy(base, seq.prompt_token_ids, MAX_TOKENS)
    assert changed >= 4
    assert adapters.gate.num_held == 0 and len(adapters.resident()) <= 2


def test_adapters_not_in_memory_load_side_by_side(tmp_path: Path, monkeypatch) -> None:
    """With `load_workers` 3, three adapters wanted at once are read on three threads at the
    same time: each load waits at a barrier for the other two (one loader thread would leave
    the barrier broken and the loads failed), and all three reach the host cache."""
    from services.engine.lora import engine_adapters
    from services.engine.metrics import ENGINE_ADAPTER_LOAD_TIME

    base = save_random_model(hf_config("llama"), tmp_path / "base")
    root = tmp_path / "adapters"
    names = ["q-v-r4", "all-r2", "o-r1"]
    for index, name in enumerate(names):
        save_peft_adapter(base, root / name, seed=index + 1, **ADAPTERS[name])
    barrier = threading.Barrier(len(names), timeout=10)
    real_load = engine_adapters.load_registered_adapter

    def load_when_all_are_loading(*args, **kwargs):
        barrier.wait()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_adapters, "load_registered_adapter", load_when_all_are_loading)
    runner = CpuModelRunner(
        files_for(tmp_path / "base"), dtype=torch.float32, block_size=4, kv_cache_bytes=1 << 20
    )
    config = LoRAConfig(
        max_loras=1, max_cpu_loras=4, max_lora_rank=8, adapter_root=str(root), load_workers=3
    )
    adapters = EngineAdapters(config, runner.model_config, dtype=torch.float32, device="cpu")
    observed_before = _histogram_count(ENGINE_ADAPTER_LOAD_TIME)
    records = []
    for name in names:
        record = adapters.inspect(name, name)
        adapters.register(record)
        records.append(adapters.manager.hold(name))
    try:
        assert adapters.manager.poll() == []
        assert adapters.manager.num_loading == len(names)
        deadline = time.monotonic() + 30
        while adapters.manager.num_loading and time.monotonic() < deadline:
            assert adapters.manager.poll() == []
            time.sleep(0.01)
        assert all(adapters.manager.ready(record) for record in records)
        assert adapters.manager.num_loads == len(names)
        assert _histogram_count(ENGINE_ADAPTER_LOAD_TIME) == observed_before + len(names)
    finally:
        adapters.shutdown()


def _histogram_count(histogram) -> float:
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0
