"""Base + 4 random PEFT adapters in one flat batch through the engine's model vs transformers+peft.

The engine's CPU runner (fp32, packed projections, paged KV) gets the LoRA runtime attached;
one batch mixes base rows and four adapters of different ranks, targets, rsLoRA and rank
patterns, prefill then decode, and every sequence's logits must equal those of the peft model
carrying only its own adapter (and the base model for base rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.cpu_runner import CpuModelRunner
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.lora.batch import LoRABatch
from services.engine.lora.loader import inspect_adapter, load_registered_adapter
from services.engine.lora.runtime import LoRARuntime
from services.engine.lora.slots import LoRASlots
from services.engine.lora.wrap import attach_lora
from tests.lora_adapters import ALL_MODULES, save_peft_adapter
from tests.unit.engine.models.helpers import BlockAllocator, files_for, hf_config, save_random_model

BLOCK_SIZE = 4
TOLERANCE = {"atol": 2e-4, "rtol": 1e-4}
ADAPTERS = {
    "attn-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "mlp-r8-rs": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
    },
    "all-r2": {"r": 2, "lora_alpha": 3, "target_modules": ALL_MODULES},
    "ko-pattern": {
        "r": 6,
        "lora_alpha": 6,
        "target_modules": ["k_proj", "o_proj"],
        "rank_pattern": {"o_proj": 3},
        "alpha_pattern": {r"layers\.0\.self_attn\.k_proj": 12},
    },
}


def _last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_adapter_batch_matches_peft(tmp_path: Path, max_loras: int) -> None:
    base = save_random_model(hf_config("llama"), tmp_path / "base")
    root = tmp_path / "adapters"
    references = {
        name: save_peft_adapter(base, root / name, seed=index + 1, **options)
        for index, (name, options) in enumerate(ADAPTERS.items())
    }
    runner = CpuModelRunner(
        files_for(tmp_path / "base"),
        dtype=torch.float32,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=1 << 20,
    )
    config = runner.model_config
    slots = LoRASlots(config, max_loras=max_loras, max_rank=8, dtype=torch.float32, device="cpu")
    runtime = LoRARuntime(slots)
    assert attach_lora(runner.model, runtime) == 4 * config.num_layers
    weights = {}
    for name in ADAPTERS:
        record = inspect_adapter(name, name, adapter_root=root, model_config=config, max_rank=8)
        weights[name] = load_registered_adapter(
            name,
            record.path,
            record.sha256,
            adapter_root=root,
            model_config=config,
            max_rank=8,
            dtype=torch.float32,
        )

    generator = torch.Generator().manual_seed(5)
    # (adapter or None for the base model, prompt); two sequences share "all-r2".
    requests = [
        (None, 7),
        ("attn-r4", 5),
        ("mlp-r8-rs", 9),
        ("all-r2", 3),
        ("ko-pattern", 6),
        ("all-r2", 4),
        (None, 2),
    ]
    histories = [
        torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()
        for _, length in requests
    ]
    allocator = BlockAllocator(runner.num_blocks, BLOCK_SIZE)
    computed: dict[int, int] = {}  # tokens of each sequence already in the KV cache
    names = sorted({name for name, _ in requests if name})
    for step in range(4):
        # With fewer slots than adapters, each step serves a subset (as the scheduler would),
        # rewriting slots in between: outputs must not depend on what a slot held before.
        active = names if max_loras >= len(names) else names[step % 2 :: 2]
        slot_of = {name: index for index, name in enumerate(active)}
        for name, slot in slot_of.items():
            slots.write(slot, weights[name])
        chosen = [i for i, (name, _) in enumerate(requests) if name is None or name in slot_of]
        sequences = []
        for seq_id in chosen:
            name, history = requests[seq_id][0], histories[seq_id]
            start = computed.get(seq_id, 0)
            sequences.append(
                ScheduledSequence(
                    seq_id=seq_id,
                    token_ids=history[start:],
                    start_position=start,
                    block_table=allocator.table_for(seq_id, len(history)),
                    needs_logits=True,
                    adapter_slot=-1 if name is None else slot_of[name],
                )
            )
            computed[seq_id] = len(history)
        batch = ScheduledBatch(sequences)
        runtime.set_batch(LoRABatch.from_scheduled(batch))
        logits = runner.execute(batch)
        for row, seq_id in enumerate(chosen):
            name = requests[seq_id][0]
            reference = base if name is None else references[name]
            expected = _last_logits(reference, histories[seq_id])
            torch.testing.assert_close(logits[row], expected, **TOLERANCE)
            if name is not None:  # the adapter really changes this sequence's logits
                base_logits = _last_logits(base, histories[seq_id])
                assert (expected - base_logits).abs().max() > 100 * TOLERANCE["atol"]
            histories[seq_id].append(int(expected.argmax()))
