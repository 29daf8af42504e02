"""LoRA on the default model (SmolLM2-135M, float32, CPU) through the offline `LLM.generate`.

The base model and four random PEFT adapters (different ranks, target modules and scalings,
non-zero B) all in flight together: each request's greedy tokens must equal transformers + peft
with that adapter alone; then eight adapters on two device slots of one engine (slots evicted
and refilled while requests wait) must give the same tokens again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.protocol.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.lora_adapters import ALL_MODULES, MIXED_ADAPTERS, write_peft_adapters

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 7092, 30], [1, 1204, 6203, 30, 2683, 359, 253]]
MORE_ADAPTERS = {
    "q-r3": {"r": 3, "lora_alpha": 3, "target_modules": ["q_proj"]},
    "down-r5": {"r": 5, "lora_alpha": 10, "target_modules": ["down_proj"]},
    "all-r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES},
    "up-v-r1": {"r": 1, "lora_alpha": 2, "target_modules": ["up_proj", "v_proj"]},
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    from transformers import AutoModelForCausalLM

    from services.common.model_files import resolve_model

    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(
        resolve_model(None).weights_dir, dtype=torch.float32
    ).eval()
    everything = {**MIXED_ADAPTERS, **MORE_ADAPTERS}
    references = write_peft_adapters(base, root, everything, PROMPTS, MAX_TOKENS)
    return root, references


def _generate(llm: LLM, names: list[str | None], references: dict) -> None:
    jobs = [(name, index) for name in names for index in range(len(PROMPTS))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [PROMPTS[index] for _, index in jobs], params, adapters=[name for name, _ in jobs]
    )
    changed = set()
    for (name, index), output in zip(jobs, outputs, strict=True):
        assert output.error is None
        assert output.token_ids == references[name][index], (name, index)
        if output.token_ids != references[None][index]:
            changed.add(name)
    assert changed == set(names) - {None}  # every adapter changes some answer


def test_default_model_with_adapters_matches_peft(adapters) -> None:
    root, references = adapters
    llm = LLM(dtype="float32", adapter_root=str(root), max_loras=4, max_lora_rank=8)
    for name in MIXED_ADAPTERS:
        llm.add_adapter(name)
    _generate(llm, [None, *MIXED_ADAPTERS], references)
    llm.engine.shutdown()

    eight = LLM(
        dtype="float32", adapter_root=str(root), max_loras=2, max_cpu_loras=3, max_lora_rank=8
    )
    for name in {**MIXED_ADAPTERS, **MORE_ADAPTERS}:
        eight.add_adapter(name)
    _generate(eight, [*MIXED_ADAPTERS, None, *MORE_ADAPTERS], references)
    manager = eight.engine.adapters.manager
    assert manager.num_slot_writes >= 8 and len(eight.engine.load().resident_adapters) <= 2
    eight.engine.shutdown()
