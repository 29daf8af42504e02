"""The eager-step host benchmark's step layout (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import lora_eager_host
from benchmarks.lora_bench import Blocks


def test_the_served_step_puts_decodes_first_and_each_prompt_on_its_own_adapter() -> None:
    batch = lora_eager_host.served_step(Blocks(10_000), vocab=1000)
    lengths = [len(seq.token_ids) for seq in batch.sequences]
    decodes, prompts = lora_eager_host.DECODES, lora_eager_host.PROMPTS
    assert lengths == [1] * decodes + [lora_eager_host.PROMPT_TOKENS] * prompts
    assert all(seq.start_position == lora_eager_host.CONTEXT for seq in batch.sequences[:decodes])
    slots = lora_eager_host.adapter_rows(batch)
    assert set(slots[:decodes]) == set(range(lora_eager_host.SLOTS))
    assert len(set(slots[decodes:])) == prompts


def test_without_a_gpu_it_says_so(tmp_path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        lora_eager_host.main(["--out", str(tmp_path / "x.json")])
