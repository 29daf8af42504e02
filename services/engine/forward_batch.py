"""The contract between the scheduler (plain Python) and the model runner (tensors).

The scheduler decides, each step, which sequences run and which of their tokens are computed;
the model runner turns that into flat tensors, runs the model over the paged KV cache and
returns the logits of the sequences that sample this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledSequence:
    """One sequence's share of a forward step."""

    seq_id: int
    token_ids: list[int]  # tokens computed this step: a prefill chunk, or 1 token for decode
    start_position: int  # tokens of this sequence already in the KV cache before this step
    block_table: list[int]  # physical KV blocks, in order, covering start_position + len(token_ids)
    needs_logits: bool  # last chunk of the prompt, or a decode step: the runner returns its logits
    adapter_slot: int = -1  # LoRA slot, -1 for the base model

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class ScheduledBatch:
    """All sequences of one step, decodes first (the runner may rely on that order)."""

    sequences: list[ScheduledSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    @property
    def is_pure_decode(self) -> bool:
        return all(len(seq.token_ids) == 1 and seq.start_position > 0 for seq in self.sequences)

    @property
    def num_logits(self) -> int:
        return sum(1 for seq in self.sequences if seq.needs_logits)
