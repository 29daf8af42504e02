"""The "cuda" attention backend: paged attention through the Triton kernels in kernels/triton/.

Pure-decode steps use the split-K decode kernel (split count fixed by batch size, so CUDA
graphs stay valid as contexts grow); a step with a prefill chunk uses the varlen causal
prefill kernel. In a mixed step the decode sequences the scheduler put first go through the
decode kernel and the rest through the prefill kernel, each writing its rows of one output:
the prefill kernel's programs are per query head, so for a one-row query it would read each
KV head's cache once per head of its group (4x for Llama-3-8B), where the decode kernel reads
it once (at 360 decodes beside an 8k-token chunk that is ~40 ms of a ~220 ms step). Keys and
values must be in the cache before `forward` (`store_kv`, or the fused rotary + store kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.kernels.triton.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from services.engine.kernels.triton.prefill_attention import paged_prefill_attention
from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store
from services.engine.layers.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class MixedSplit:
    """A mixed step cut in two: its first `decodes` sequences (one row each, over a cached
    context) and the rest, with the rest's metadata re-based to start at row `decodes`."""

    decodes: int
    num_splits: int
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    rest_tables: torch.Tensor
    rest_lens: torch.Tensor
    rest_starts: torch.Tensor


def leading_decodes(starts: list[int], context_lens: list[int]) -> int:
    """How many sequences at the front compute one token each over a cached context."""
    count = 0
    for index, context in enumerate(context_lens):
        if starts[index + 1] - starts[index] != 1 or context <= 0:
            break
        count += 1
    return count


class CudaPagedAttention:
    """Stateless attention over the paged KV cache ([num_blocks, block_size, kv_heads, dim])."""

    name = "cuda"

    def __init__(self, num_sms: int | None = None) -> None:
        if num_sms is None and torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.num_sms = num_sms or 132

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key/value [T, kv_heads, head_dim] at slot_mapping (already rotated)."""
        positions = torch.zeros_like(slot_mapping)
        half = key_cache.shape[-1] // 2
        unit = torch.ones((1, half), dtype=torch.float32, device=key.device)
        rotary_kv_store(
            key, key, value, positions, unit, unit * 0, slot_mapping, key_cache, value_cache,
            rotate=False,
        )  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for query [T, heads, head_dim]."""
        if metadata.is_pure_decode:
            batch = query.shape[0]
            splits = choose_num_splits(batch, key_cache.shape[2], self.num_sms)
            return paged_decode_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                num_splits=splits,
            )
        split = self._mixed_split(metadata, key_cache.shape[2])
        if split is None:
            return paged_prefill_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.max_query_len,
                scale,
            )
        out = torch.empty_like(query)
        rows = split.decodes
        paged_decode_attention(
            query[:rows],
            key_cache,
            value_cache,
            split.decode_tables,
            split.decode_lens,
            scale,
            num_splits=split.num_splits,
            out=out[:rows],
        )
        paged_prefill_attention(
            query[rows:],
            key_cache,
            value_cache,
            split.rest_tables,
            split.rest_starts,
            split.rest_lens,
            metadata.max_query_len,
            scale,
            out=out[rows:],
        )
        return out

    def _mixed_split(self, metadata: AttentionMetadata, num_kv_heads: int) -> MixedSplit | None:
        """The step's split, planned once per step (every layer reads it); None when the step
        has no leading decodes, or nothing after them, or no host-side lengths."""
        state = metadata.backend_state
        if "mixed_split" not in state:
            state["mixed_split"] = self._plan_split(metadata, num_kv_heads)
        return state["mixed_split"]

    def _plan_split(self, metadata: AttentionMetadata, num_kv_heads: int) -> MixedSplit | None:
        starts, contexts = metadata.query_start_loc_host, metadata.context_lens_host
        if not starts or len(contexts) + 1 != len(starts):
            return None
        count = leading_decodes(starts, contexts)
        if count == 0 or count == len(contexts):
            return None
        # Fresh tensors for the rest (not views at an offset), so the kernels see the same
        # pointer alignment as in every other step and compile no new variant.
        return MixedSplit(
            decodes=count,
            num_splits=choose_num_splits(count, num_kv_heads, self.num_sms),
            decode_tables=metadata.block_tables[:count],
            decode_lens=metadata.seq_lens[:count],
            rest_tables=metadata.block_tables[count:].clone(),
            rest_lens=metadata.seq_lens[count:].clone(),
            rest_starts=metadata.query_start_loc[count:] - count,
        )
