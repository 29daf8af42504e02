"""A model runner stand-in that checks the paged KV bookkeeping without a model.

It keeps a "KV cache" of (token, position) per slot, written at each scheduled token's slot, and
computes a sequence's logits only from what its block table points at. The next token is a
deterministic function of the whole history, so any wrong block table, lost block or
mis-shared prefix changes the output compared with `reference_generate`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from services.common.errors import FailedPreconditionError
from services.engine.forward_batch import ScheduledBatch
from services.engine.model_runner import PendingTokens, RunnerCapabilities


def history_logits(history: list[int], vocab_size: int) -> torch.Tensor:
    """Logits that depend on every token of the history (and its length)."""
    key = len(history)
    for token in history:
        key = (key * 1_000_003 + token + 1) % (2**61 - 1)
    generator = torch.Generator().manual_seed(key)
    logits = torch.randn(vocab_size, generator=generator)
    logits[key % vocab_size] += 4.0
    return logits


def reference_generate(
    prompt: list[int], max_tokens: int, vocab_size: int, eos: tuple[int, ...] = ()
) -> list[int]:
    """Greedy generation of one prompt alone, with no cache."""
    history = list(prompt)
    output: list[int] = []
    for _ in range(max_tokens):
        token = int(history_logits(history, vocab_size).argmax())
        output.append(token)
        history.append(token)
        if token in eos:
            break
    return output


class FakeModelRunner:
    """A model_runner.ModelRunner that declares no greedy or overlap capability (the engine
    samples every step from its logits)."""

    capabilities = RunnerCapabilities()

    def __init__(
        self,
        *,
        vocab_size: int = 101,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 512,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model_config = SimpleNamespace(
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            name="fake",
        )
        self.model_files = None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.cache: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.batches: list[ScheduledBatch] = []

    def _slot(self, block_table: list[int], position: int) -> int:
        block = block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.batches.append(batch)
        seen_decode_end = False
        rows = []
        for seq in batch.sequences:
            is_decode = len(seq.token_ids) == 1 and seq.start_position > 0
            if is_decode and seen_decode_end:
                raise AssertionError("decodes must come before prefills in a batch")
            seen_decode_end = seen_decode_end or not is_decode
            for offset, token in enumerate(seq.token_ids):
                position = seq.start_position + offset
                self.cache[self._slot(seq.block_table, position)] = (token, position)
            if seq.needs_logits:
                history = []
                for position in range(seq.end_position):
                    entry = self.cache[self._slot(seq.block_table, position)]
                    if entry is None or entry[1] != position:
                        raise AssertionError(f"slot for position {position} holds {entry}")
                    history.append(entry[0])
                rows.append(history_logits(history, self.model_config.vocab_size))
        if not rows:
            return torch.empty(0, self.model_config.vocab_size)
        return torch.stack(rows)

    def execute_greedy(self, batch: ScheduledBatch) -> torch.Tensor:
        return self.execute(batch).argmax(dim=-1)

    def launch_greedy(self, batch: ScheduledBatch) -> PendingTokens:
        raise FailedPreconditionError("FakeModelRunner cannot launch without waiting")
