"""A rank's share of the weights: full tensors cut into shards, and the rank's model built.

Each rank builds the model of its local shape (ModelConfig with its own head and MLP counts,
`local_model_config`), so the layers, the attention backend and the KV cache need nothing
tensor-parallel of their own. Checkpoint tensors are cut as they stream from the safetensors
files (`shard_checkpoint_tensor`, Hugging Face names); dummy weights are drawn at full size in
the same order and from the same seeded generator as a single-rank model, one tensor at a time,
then cut (`shard_parameter`), so a TP=N model is the TP=1 model split, and greedy output is
comparable across sizes. After filling, o_proj and down_proj are wrapped in RowParallel, which
sums the ranks' partial outputs (the one collective per projection pair), and the LM head keeps
only the rank's rows of the vocabulary (`shard_lm_head`): each rank reads 1/N of it per step,
and one all-gather joins the logits (`VocabGather`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from services.common.errors import FailedPreconditionError
from services.engine.layers.norm import InputSum, RMSNorm
from services.engine.loader.weights import DUMMY_STD, iterate_safetensors
from services.engine.models.config import ModelConfig
from services.engine.models.registry import model_class
from services.engine.parallel.sharding import ShardLayout

ROW_PARALLEL = ("o_proj", "down_proj")


def shard_layout(config: ModelConfig, world_size: int, rank: int) -> ShardLayout:
    """The layout of `rank` for the full model `config`."""
    return ShardLayout(
        world_size=world_size,
        rank=rank,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
    )


def local_model_config(config: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """The shape one rank builds: its own heads, KV heads and MLP width; the rest unchanged."""
    return dataclasses.replace(
        config,
        num_heads=layout.local_heads,
        num_kv_heads=layout.local_kv_heads,
        intermediate_size=layout.local_intermediate_size,
    )


def shard_parameter(name: str, tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's part of the engine's (fused) parameter `name` of full value `tensor`."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    q_size = layout.num_heads * layout.head_dim
    kv_size = layout.num_kv_heads * layout.head_dim
    if module == "qkv_proj":
        query, key, value = tensor.split([q_size, kv_size, kv_size], dim=0)
        return torch.cat(
            [
                _rows(query, layout.query_rows()),
                _rows(key, layout.kv_rows()),
                _rows(value, layout.kv_rows()),
            ]
        )
    if module == "gate_up_proj":
        gate, up = tensor.chunk(2, dim=0)
        rows = layout.intermediate_rows()
        return torch.cat([_rows(gate, rows), _rows(up, rows)])
    if module in ROW_PARALLEL:
        if kind == "bias":  # added once, by rank 0, to the summed output
            return tensor if layout.rank == 0 else torch.zeros_like(tensor)
        span = layout.query_rows() if module == "o_proj" else layout.intermediate_rows()
        return tensor[:, span[0] : span[1]]
    return tensor


def shard_checkpoint_tensor(name: str, tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's part of the Hugging Face checkpoint tensor `name`."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module == "q_proj":
        return _rows(tensor, layout.query_rows())
    if module in ("k_proj", "v_proj"):
        return _rows(tensor, layout.kv_rows())
    if module in ("gate_proj", "up_proj"):
        return _rows(tensor, layout.intermediate_rows())
    if module in ROW_PARALLEL:
        return shard_parameter(name, tensor, layout)
    return tensor


def _rows(tensor: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return tensor[span[0] : span[1]]


AllReduce = Callable[[torch.Tensor, int], torch.Tensor]
# A tensor of every rank, stacked in rank order: [world_size, *tensor.shape].
AllGather = Callable[[torch.Tensor], torch.Tensor]


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product, then the sum over all ranks.

    `turn` (0 for o_proj, 1 for down_proj: the sums of a forward alternate) lets an all-reduce
    that stages through its own buffers use them in turn. `deferred`: the partial product is
    returned unsummed, for the norm that reads it to sum (`defer_row_sums`).
    """

    def __init__(self, inner: nn.Module, all_reduce: AllReduce, turn: int = 0):
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce
        self.turn = turn
        self.deferred = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.inner(x)
        return partial if self.deferred else self.all_reduce(partial, self.turn)


def defer_row_sums(model: nn.Module, input_sum: Callable[[int], InputSum]) -> int:
    """Leave each row-parallel sum to the norm that reads it: a decoder layer's o_proj to its
    post-attention norm, its down_proj to the next layer's input norm (the last one's to the
    final norm), each norm given `input_sum(turn)`. Returns how many sums were deferred (0 where
    the model is not laid out so)."""
    decoder = getattr(model, "model", None)
    layers = list(getattr(decoder, "layers", []))
    pairs = []
    for index, layer in enumerate(layers):
        following = layers[index + 1].input_layernorm if index + 1 < len(layers) else decoder.norm
        pairs.append((layer.self_attn.o_proj, layer.post_attention_layernorm))
        pairs.append((layer.mlp.down_proj, following))
    if not all(
        isinstance(projection, RowParallel) and isinstance(norm, RMSNorm)
        for projection, norm in pairs
    ):
        return 0
    for projection, norm in pairs:
        projection.deferred = True
        norm.input_sum = input_sum(projection.turn)
    return len(pairs)


def wrap_row_parallel(model: nn.Module, all_reduce: AllReduce) -> int:
    """Wrap every o_proj and down_proj of `model` in RowParallel; how many were wrapped."""
    targets = [
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in ROW_PARALLEL and not isinstance(module, RowParallel)
    ]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        turn = ROW_PARALLEL.index(child)
        setattr(parent, child, RowParallel(getattr(parent, child), all_reduce, turn))
    return len(targets)


def build_sharded_model(
    config: ModelConfig,
    layout: ShardLayout,
    *,
    weights_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    all_reduce: AllReduce,
) -> nn.Module:
    """This rank's model of the full model `config`, filled and with its row-parallel sums."""
    cls = model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(local_model_config(config, layout))
            full = cls(config) if weights_dir is None else None
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.model.rotary.reset_cache(device)  # type: ignore[union-attr, operator]
    if full is None:
        loaded = model.load_weights(  # type: ignore[operator]
            _sharded_checkpoint(iterate_safetensors(weights_dir), layout)  # type: ignore[arg-type]
        )
        missing = model.expected_weight_names() - loaded  # type: ignore[operator]
        if missing:
            sample = ", ".join(sorted(missing)[:5])
            raise FailedPreconditionError(
                f"{weights_dir}: {len(missing)} weights missing from the checkpoint ({sample})"
            )
    else:
        fill_dummy_shards(model, full.named_parameters(), layout, seed)
    wrap_row_parallel(model, all_reduce)
    return model.eval()


def _sharded_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]], layout: ShardLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, shard_checkpoint_tensor(name, tensor, layout)


@torch.no_grad()
def fill_dummy_shards(
    model: nn.Module,
    full_parameters: Iterable[tuple[str, nn.Parameter]],
    layout: ShardLayout,
    seed: int,
) -> None:
    """Fill `model` (a rank's) with its shards of the single-rank dummy weights of `seed`.

    Mirrors loader/weights.py's dummy fill: the same parameter order, generator and draws at
    full size (one full tensor in memory at a time), so every rank cuts the same values.
    """
    local = dict(model.named_parameters())
    device = next(iter(local.values())).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, meta in full_parameters:
        param = local[name]
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            full = torch.empty(meta.shape, dtype=param.dtype, device=device)
            full.normal_(0.0, DUMMY_STD, generator=generator)
            param.copy_(shard_parameter(name, full, layout))


class VocabGather:
    """Joins the ranks' logits of their vocabulary slices: [rows, local] -> [rows, vocab]."""

    def __init__(self, all_gather: AllGather, vocab_size: int) -> None:
        self.all_gather = all_gather
        self.vocab_size = vocab_size

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        rows = local.shape[0]
        if rows == 0:  # every rank has the same rows: none of them gathers
            return local.new_empty((0, self.vocab_size))
        parts = self.all_gather(local.contiguous())  # [world, rows, local]
        joined = parts.transpose(0, 1).reshape(rows, -1)
        return joined[:, : self.vocab_size]  # the padding rows of the last slices dropped


@torch.no_grad()
def shard_lm_head(model: nn.Module, layout: ShardLayout, all_gather: AllGather) -> None:
    """Keep only this rank's rows of the LM head (a tied head becomes a head of its own rows;
    the embedding stays whole) and join the ranks' logits with one all-gather. Every rank holds
    layout.local_vocab_size rows; rows past the vocabulary are zero and cut off when joined."""
    weight = model.head_weight
    vocab_size, hidden = weight.shape
    start, stop = layout.vocab_rows(vocab_size)
    local = layout.local_vocab_size(vocab_size)
    head = nn.Linear(hidden, local, bias=False, device=weight.device, dtype=weight.dtype)
    head.weight.zero_()
    head.weight[: stop - start] = weight[start:stop]
    model.lm_head = head  # the full head (when it was not the embedding) is freed here
    model.logits_gather = VocabGather(all_gather, vocab_size)
