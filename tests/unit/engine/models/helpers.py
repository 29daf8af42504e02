"""Shared test helpers: tiny random HF checkpoints and a toy block allocator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.common.model_files import ModelFiles
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence

TINY_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


def hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config of `family` (llama, mistral, qwen2, qwen3)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    settings = {**TINY_COMMON, **overrides}
    if family == "mistral":
        settings.setdefault("sliding_window", None)
    if family == "qwen3":
        settings.setdefault("head_dim", 16)
    return classes[family](**settings)


def save_random_model(config: Any, directory: Path, seed: int = 0) -> Any:
    """Build a random HF model, save it sharded into `directory`, return it in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases/norms so that their loading is actually checked
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(directory, max_shard_size="100KB")
    return model.eval()


def files_for(directory: Path) -> ModelFiles:
    return ModelFiles(name=directory.name, weights_dir=directory, tokenizer_dir=directory)


class BlockAllocator:
    """Hands out fresh physical blocks in scrambled order (so tables are not the identity)."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}

    def table_for(self, seq_id: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < length:
            table.append(self.free.pop())
        return list(table)


def step(
    allocator: BlockAllocator,
    pieces: list[tuple[int, list[int], int, bool]],
) -> ScheduledBatch:
    """A batch of (seq_id, token_ids, start_position, needs_logits) pieces."""
    sequences = [
        ScheduledSequence(
            seq_id=seq_id,
            token_ids=tokens,
            start_position=start,
            block_table=allocator.table_for(seq_id, start + len(tokens)),
            needs_logits=needs_logits,
        )
        for seq_id, tokens, start, needs_logits in pieces
    ]
    return ScheduledBatch(sequences=sequences)
