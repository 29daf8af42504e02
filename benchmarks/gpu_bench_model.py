"""The measurements of benchmarks.gpu_bench for one model shape (split out to keep files short).

Order matters for memory on an 80 GB card: transformers' model is built, randomised, loaded
into the engine's model (fused QKV and gate/up), timed and used as a reference, then freed
before the large KV cache of the throughput runs is allocated; the engine's model then runs on
the CUDA fast path (backends/cuda_fast_path.py), as in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

CORRECTNESS_PROMPTS = (100, 517, 3)  # prompt lengths of the checked batch
DECODE_CHECK_STEPS = 4
PREFILL_BATCHES = ((2048, 2048, 2048, 2048), (8192,))


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (read + write) and the bf16 8192^3 matmul rate."""
    import triton.testing

    source = torch.randn(2**28, device="cuda")  # 1 GiB of float32
    target = torch.empty_like(source)
    copy_ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=50, rep=300,
                                      return_mode="median")  # fmt: skip
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    matmul_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    source = target = a = b = None
    torch.cuda.empty_cache()
    return {
        "copy_gb_s": round(2 * 2**30 / (copy_ms * 1e-3) / 1e9, 1),
        "matmul_tflop_s": round(2 * size**3 / (matmul_ms * 1e-3) / 1e12, 1),
    }


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def _build_transformers(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.common.protocol.dummy_shapes import dummy_config

    fields = dict(dummy_config(shape))
    fields.pop("model_type", None)
    config = LlamaConfig(**fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.1, generator=generator)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    return config, model.eval()


def _engine_model(shape: str, hf_model) -> torch.nn.Module:
    """The engine's LlamaForCausalLM (bf16, on the GPU) holding transformers' weights."""
    from services.common.protocol.dummy_shapes import dummy_config
    from services.engine.models.config import ModelConfig
    from services.engine.models.llama import LlamaForCausalLM

    config = ModelConfig.from_dict(dummy_config(shape), name=f"dummy:{shape}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        model.load_weights(hf_model.state_dict().items())
    return model.eval().requires_grad_(False)


def _transformers_generate_ms(model, vocab: int, new_tokens: int = 32) -> float:
    """Per-token decode time of transformers' generate at bs=1 (prompt 128, greedy)."""
    prompt = torch.randint(0, vocab, (1, 128), device="cuda")

    def run(count: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False,
                           pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4)
    one = min(run(1) for _ in range(2))
    many = min(run(new_tokens + 1) for _ in range(2))
    return (many - one) / new_tokens * 1e3


def bench_shape(
    shape: str,
    entry: dict[str, Any],
    ceilings: dict[str, float],
    batches: list[int],
    decode_context: int,
    decode_steps: int,
    save: Callable[[], None],
) -> None:
    from benchmarks.gpu_bench_reference import llama_reference_logits
    from services.engine.backends.cuda_fast_path import CudaFastPath

    config, hf_model = _build_transformers(shape)
    entry["model"] = f"dummy:{shape}"
    entry["parameters"] = sum(p.numel() for p in hf_model.parameters())
    model = _engine_model(shape, hf_model)
    vocab = config.vocab_size
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist()
               for n in CORRECTNESS_PROMPTS]  # fmt: skip
    with torch.no_grad():
        hf_last = [hf_model(torch.tensor([p], device="cuda")).logits[0, -1].float()
                   for p in prompts]  # fmt: skip
    entry["transformers_bs1_ms"] = round(_transformers_generate_ms(hf_model, vocab), 3)
    print(shape, "transformers bs1 ms", entry["transformers_bs1_ms"], flush=True)
    save()
    del hf_model
    torch.cuda.empty_cache()

    block_size, max_blocks = 16, 640
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_block = (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
                 * head_dim * 2)  # fmt: skip
    needed = max(batches) * -(-(decode_context + decode_steps + 8) // block_size) + 1024
    free, _ = torch.cuda.mem_get_info()
    affordable = int((free - 10 * 2**30) // per_block)
    num_blocks = min(needed, affordable)
    entry["num_blocks"] = num_blocks
    shape_of_cache = (num_blocks, block_size, config.num_key_value_heads, head_dim)
    caches = [(torch.empty(shape_of_cache, dtype=torch.bfloat16, device="cuda"),
               torch.empty(shape_of_cache, dtype=torch.bfloat16, device="cuda"))
              for _ in range(config.num_hidden_layers)]  # fmt: skip
    fast = CudaFastPath(model, caches, block_size=block_size, max_blocks_per_seq=max_blocks,
                        graph_buckets=tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)
                                            if b <= max(batches)))  # fmt: skip
    with torch.no_grad():
        for cache in fast.key_caches + fast.value_caches:
            cache.normal_(0.0, 1.0)
    started = time.perf_counter()
    fast.tune_skinny_matmuls()
    entry["skinny_matmul_s"] = round(time.perf_counter() - started, 1)
    entry["skinny_matmul_choices"] = {
        f"{role}@rows{rows}": list(config) for (role, rows), config in fast.skinny_choices.items()
    }
    print("skinny matmul choices", entry["skinny_matmul_choices"], flush=True)
    started = time.perf_counter()
    fast.capture_graphs()
    entry["graph_capture_s"] = round(time.perf_counter() - started, 1)

    from benchmarks.gpu_bench_timing import check_correctness, time_decode, time_prefill

    with torch.inference_mode():
        check_correctness(fast, config, prompts, hf_last, entry, llama_reference_logits)
        save()
        # The decode floor: every parameter byte over the measured copy bandwidth; the
        # stricter one counts only the bytes a step reads (the embedding table is one row).
        bandwidth = ceilings["copy_gb_s"] * 1e9
        decode_floor_ms = fast.parameter_bytes() / bandwidth * 1e3
        read_floor_ms = fast.decode_bytes() / bandwidth * 1e3
        entry["parameter_bytes"] = fast.parameter_bytes()
        entry["decode_weight_bytes"] = fast.decode_bytes()
        entry["decode_bs1_floor_ms"] = round(decode_floor_ms, 3)
        entry["decode_bs1_floor_read_bytes_ms"] = round(read_floor_ms, 3)
        time_decode(fast, entry, batches, decode_context, decode_steps, save)
        entry["decode_bs1_floor_ratio"] = round(entry["decode_bs1_ms"] / decode_floor_ms, 3)
        entry["decode_bs1_floor_ratio_read_bytes"] = round(
            entry["decode_bs1_ms"] / read_floor_ms, 3
        )
        entry["speedup_vs_transformers_bs1"] = round(
            entry["transformers_bs1_ms"] / entry["decode_bs1_ms"], 2
        )
        save()
        time_prefill(fast, config, entry, ceilings, PREFILL_BATCHES)
        save()
    del fast, model, caches
    torch.cuda.empty_cache()
