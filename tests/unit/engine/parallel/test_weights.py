"""Weight splitting: a rank's shards, put back together, are the single-rank model's weights.

Dummy weights (drawn at full size, then cut) and Hugging Face checkpoints (cut as they stream)
both; biases of the row-parallel projections are added by rank 0 alone; KV heads shared by
several ranks are copied whole to each; the LM head keeps a rank's vocabulary rows and the
joined logits are the single-rank model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.model_files import resolve_model
from services.engine.loader.weights import build_model
from services.engine.model_runner import load_model_config
from services.engine.models.config import ModelConfig
from services.engine.parallel.sharding import ShardLayout
from services.engine.parallel.weights import (
    RowParallel,
    build_sharded_model,
    local_model_config,
    shard_layout,
    shard_lm_head,
)
from tests.unit.engine.models.helpers import hf_config, save_random_model

CPU = torch.device("cpu")


def _identity(tensor: torch.Tensor, turn: int) -> torch.Tensor:
    assert turn in (0, 1)
    return tensor


def rank_models(config: ModelConfig, world_size: int, weights_dir: Path | None) -> list:
    return [
        build_sharded_model(
            config,
            shard_layout(config, world_size, rank),
            weights_dir=weights_dir,
            device=CPU,
            dtype=torch.float32,
            seed=7,
            all_reduce=_identity,
        )
        for rank in range(world_size)
    ]


def unwrapped(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name.replace(".inner.", "."): p for name, p in model.named_parameters()}


def reassemble(name: str, shards: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The full parameter from the shards of a split with no replicated KV heads."""
    world = len(shards)
    q = config.num_heads * config.head_dim // world
    kv = config.num_kv_heads * config.head_dim // world
    if ".qkv_proj." in name:
        parts = [s.split([q, kv, kv]) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    if ".gate_up_proj." in name:
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.cat(shards, dim=1)
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        assert all(torch.count_nonzero(s) == 0 for s in shards[1:])
        return shards[0]
    assert all(torch.equal(shards[0], s) for s in shards[1:]), name  # replicated
    return shards[0]


def assert_split_of(full: torch.nn.Module, ranks: list, config: ModelConfig) -> None:
    pieces = [unwrapped(model) for model in ranks]
    for name, param in full.named_parameters():
        rebuilt = reassemble(name, [p[name] for p in pieces], config)
        assert torch.equal(rebuilt, param), name


def test_dummy_shards_are_the_single_rank_dummy_weights_cut():
    files = resolve_model("dummy:tiny")
    config = load_model_config(files, None)
    full = build_model(config, weights_dir=None, device=CPU, dtype=torch.float32, seed=7)
    ranks = rank_models(config, 2, None)
    assert_split_of(full, ranks, config)
    attention = ranks[1].model.layers[0].self_attn
    assert isinstance(attention.o_proj, RowParallel)
    assert isinstance(ranks[1].model.layers[0].mlp.down_proj, RowParallel)
    assert attention.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 16)  # 2 heads, 1 KV head


def test_checkpoint_shards_with_biases_are_the_checkpoint_cut(tmp_path: Path):
    hf = hf_config("llama", attention_bias=True, mlp_bias=True)
    save_random_model(hf, tmp_path, seed=3)
    config = ModelConfig.from_directory(tmp_path, name="tiny-llama")
    assert config.output_bias and config.mlp_bias
    full = build_model(config, weights_dir=tmp_path, device=CPU, dtype=torch.float32)
    assert_split_of(full, rank_models(config, 2, tmp_path), config)


def test_kv_heads_shared_by_ranks_are_copied_whole():
    files = resolve_model("dummy:tiny")  # 4 query heads over 2 KV heads of 16
    config = load_model_config(files, None)
    full = build_model(config, weights_dir=None, device=CPU, dtype=torch.float32, seed=7)
    full_qkv = full.model.layers[1].self_attn.qkv_proj.weight
    ranks = rank_models(config, 4, None)
    for rank, model in enumerate(ranks):
        qkv = model.model.layers[1].self_attn.qkv_proj.weight
        assert qkv.shape == (3 * 16, 16)  # one query head, one KV head
        kv_head = rank // 2
        assert torch.equal(qkv[:16], full_qkv[rank * 16 : (rank + 1) * 16])
        key_rows = slice(64 + kv_head * 16, 64 + (kv_head + 1) * 16)
        value_rows = slice(96 + kv_head * 16, 96 + (kv_head + 1) * 16)
        assert torch.equal(qkv[16:32], full_qkv[key_rows])
        assert torch.equal(qkv[32:], full_qkv[value_rows])


def test_local_config_holds_the_ranks_share():
    config = load_model_config(resolve_model("dummy:llama-3-70b"), None)
    local = local_model_config(config, shard_layout(config, 2, 1))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (32, 4, 14336)
    assert (local.hidden_size, local.head_dim, local.vocab_size) == (8192, 128, 128256)
    assert isinstance(shard_layout(config, 8, 7), ShardLayout)


def test_a_model_that_does_not_split_is_refused_before_any_weight():
    config = load_model_config(resolve_model("dummy:smollm2-135m"), None)
    with pytest.raises(Exception, match="9 attention heads"):
        shard_layout(config, 2, 0)


@pytest.mark.parametrize("tied", [False, True])
def test_vocabulary_slices_joined_are_the_whole_heads_logits(tmp_path: Path, tied: bool):
    # 1,001 tokens over 4 ranks: 251 rows each, the last rank's last three rows padding.
    hf = hf_config("llama", vocab_size=1001, tie_word_embeddings=tied)
    save_random_model(hf, tmp_path, seed=5)
    config = ModelConfig.from_directory(tmp_path, name="tiny-llama")
    full = build_model(config, weights_dir=tmp_path, device=CPU, dtype=torch.float32)
    ranks = rank_models(config, 4, tmp_path)
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(1))
    locals_ = [model.compute_logits(hidden) for model in ranks]  # each its own slice, unjoined
    assert [part.shape for part in locals_] == [(3, 1001)] * 4  # not sharded yet

    def gather_of(heads: list[torch.Tensor]):
        return lambda local: torch.stack([hidden @ head.t() for head in heads])

    for rank, model in enumerate(ranks):
        shard_lm_head(model, shard_layout(config, 4, rank), lambda t: t)
    heads = [model.head_weight for model in ranks]
    assert [head.shape[0] for head in heads] == [251] * 4
    assert torch.count_nonzero(heads[3][-3:]) == 0  # padding rows past the vocabulary
    assert torch.equal(heads[1], full.head_weight[251:502])
    if tied:  # the embedding stays whole for the token lookup
        assert ranks[2].model.embed_tokens.weight.shape[0] == 1001
    for model in ranks:
        model.logits_gather.all_gather = gather_of(heads)
        torch.testing.assert_close(model.compute_logits(hidden), full.compute_logits(hidden))
        assert torch.equal(model.compute_greedy(hidden), full.compute_logits(hidden).argmax(-1))
