"""How the CUDA attention backend cuts a mixed step: the leading decodes for the decode
kernel, the rest re-based for the prefill kernel (the kernels: tests/gpu/test_mixed_attention.py).
"""

from __future__ import annotations

import torch

from services.engine.backends.cuda_attention import CudaPagedAttention, leading_decodes
from services.engine.layers.attention_metadata import AttentionMetadata


def metadata(query_lens: list[int], contexts: list[int], *, host: bool = True):
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    seq_lens = [q + c for q, c in zip(query_lens, contexts, strict=True)]
    width = max(-(-length // 16) for length in seq_lens)
    tables = torch.arange(len(seq_lens) * width, dtype=torch.int32).view(len(seq_lens), width)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_pure_decode=False,
        logits_indices=torch.zeros(1, dtype=torch.int64),
        query_start_loc_host=starts if host else [],
        seq_lens_host=seq_lens if host else [],
        context_lens_host=contexts if host else [],
    )


def test_leading_decodes_stop_at_the_first_other_sequence():
    assert leading_decodes([0, 1, 2, 3, 23], [10, 5, 7, 0]) == 3
    assert leading_decodes([0, 1, 21, 22], [10, 0, 7]) == 1  # a decode after a chunk: not led
    assert leading_decodes([0, 1], [0]) == 0  # a one-token prompt is no decode
    assert leading_decodes([0, 30], [0]) == 0


def test_a_mixed_step_is_split_once_and_rebased():
    backend = CudaPagedAttention(num_sms=132)
    step = metadata([1, 1, 20, 33], [39, 17, 50, 0])
    split = backend._mixed_split(step, num_kv_heads=8)
    assert split is backend._mixed_split(step, num_kv_heads=8)  # planned once per step
    assert split.decodes == 2
    assert split.decode_lens.tolist() == [40, 18]
    assert split.rest_lens.tolist() == [70, 33]
    assert split.rest_starts.tolist() == [0, 20, 53]
    assert torch.equal(split.rest_tables, step.block_tables[2:])
    # The rest's tensors are fresh (aligned like any step's), not views at an offset.
    assert split.rest_tables.storage_offset() == 0 and split.rest_lens.storage_offset() == 0
    assert split.num_splits >= 1


def test_steps_without_both_parts_or_host_lengths_are_not_split():
    backend = CudaPagedAttention(num_sms=132)
    assert backend._mixed_split(metadata([5, 7], [0, 0]), 8) is None  # prompts only
    assert backend._mixed_split(metadata([1, 1], [9, 9]), 8) is None  # decodes only
    assert backend._mixed_split(metadata([1, 7], [9, 0], host=False), 8) is None
