"""Correctness checks and timings of benchmarks.gpu_bench on one built fast-path model.

Decode timing runs the engine's loop shape: inputs from pinned host memory, a captured graph
per step, and a host read of the sampled tokens each step (the one sync a step may have).
"""

from __future__ import annotations

from typing import Any

import torch

DECODE_CHECK_STEPS = 4
BLOCK_TABLE_WIDTH = 640


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def _sequential_tables(lengths: list[int], block_size: int, first: int = 0) -> list[list[int]]:
    tables, block = [], first
    for length in lengths:
        count = -(-length // block_size)
        tables.append(list(range(block, block + count)))
        block += count
    return tables


def check_correctness(fast, config, prompts, hf_last, entry: dict[str, Any], reference) -> None:
    """Relative logit errors: fast path and transformers (bf16) against the fp32 reference."""
    from services.engine.backends.cuda_fast_path import prefill_metadata

    block_size = fast.block_size
    lengths = [len(p) + DECODE_CHECK_STEPS + 1 for p in prompts]
    tables = _sequential_tables(lengths, block_size)
    positions, metadata = prefill_metadata(
        [len(p) for p in prompts], [0] * len(prompts), tables, block_size, "cuda"
    )
    logits = fast.forward(torch.tensor(sum(prompts, []), device="cuda"), positions, metadata)
    ref32 = [reference(fast.model, fast.cos, fast.sin, p)[-1] for p in prompts]
    result: dict[str, Any] = {
        "prefill_vs_fp32": [_relative_error(logits[i], ref32[i]) for i in range(len(prompts))],
        "transformers_bf16_vs_fp32": [
            _relative_error(h, r) for h, r in zip(hf_last, ref32, strict=True)
        ],
        "prefill_vs_transformers": [
            _relative_error(logits[i], hf_last[i]) for i in range(len(prompts))
        ],  # fmt: skip
    }
    # Chunked prefill over a cached prefix: the longest prompt again, in fresh blocks.
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    prompt = prompts[longest]
    table = _sequential_tables([len(prompt)], block_size, first=sum(len(t) for t in tables))[0]
    split = len(prompt) // 2
    for context_len, query_len in ((0, split), (split, len(prompt) - split)):
        chunk_positions, chunk_metadata = prefill_metadata(
            [query_len], [context_len], [table], block_size, "cuda"
        )
        chunk = torch.tensor(prompt[context_len : context_len + query_len], device="cuda")
        chunk_logits = fast.forward(chunk, chunk_positions, chunk_metadata)
    result["chunked_prefill_vs_fp32"] = _relative_error(chunk_logits[0], ref32[longest])
    # Greedy decode through the captured graphs, then the last step against the reference.
    sequences = [p + [int(t)] for p, t in zip(prompts, logits.argmax(-1).tolist(), strict=True)]
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    for _ in range(DECODE_CHECK_STEPS):
        ids = torch.tensor([s[-1] for s in sequences])
        step_positions = torch.tensor([len(s) - 1 for s in sequences])
        step_logits, next_tokens = fast.decode(ids, step_positions, table_tensor)
        last = [row.clone() for row in step_logits]
        sequences = [s + [int(t)] for s, t in zip(sequences, next_tokens.tolist(), strict=True)]
    result["graph_decode_vs_fp32"] = [
        _relative_error(last[i], reference(fast.model, fast.cos, fast.sin, sequences[i][:-1])[-1])
        for i in range(len(prompts))
    ]  # fmt: skip
    fast_errors = (result["prefill_vs_fp32"] + result["graph_decode_vs_fp32"]
                   + [result["chunked_prefill_vs_fp32"]])  # fmt: skip
    entry["correctness"] = result
    entry["max_rel_error_vs_fp32"] = max(fast_errors)
    entry["transformers_max_rel_error_vs_fp32"] = max(result["transformers_bf16_vs_fp32"])
    bound = max(2e-2, 2 * entry["transformers_max_rel_error_vs_fp32"])
    entry["correct"] = bool(all(error <= bound for error in fast_errors))
    print("correctness", entry["correct"], result, flush=True)


def _decode_loop(fast, batch: int, context: int, steps: int) -> dict[str, float] | None:
    """ms per step of `steps` greedy decode steps at `context` cached tokens, host loop."""
    block_size = fast.block_size
    per_seq = -(-(context + steps + 8) // block_size)
    if batch * per_seq > fast.num_blocks or per_seq > BLOCK_TABLE_WIDTH:
        return None
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq).pin_memory()
    ids = torch.randint(0, 1000, (batch,)).pin_memory()
    positions = torch.full((batch,), context, dtype=torch.long).pin_memory()
    tokens = torch.empty(batch, dtype=torch.long).pin_memory()
    done = torch.cuda.Event()

    def step() -> None:
        _, next_tokens = fast.decode(ids, positions, tables)
        tokens.copy_(next_tokens, non_blocking=True)
        done.record()
        done.synchronize()
        ids.copy_(tokens)
        positions.add_(1)

    for _ in range(3):
        step()
    positions.fill_(context)
    torch.cuda.synchronize()
    import time

    start = time.perf_counter()
    for _ in range(steps):
        step()
    loop_ms = (time.perf_counter() - start) / steps * 1e3
    overlapped_ms = _overlapped_loop(fast, batch, ids, positions, tables, context, steps)
    # The graph alone, back to back (no host work between replays).
    positions.fill_(context)
    fast.decode(ids, positions, tables)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        fast.graphs.replay(batch)
    end.record()
    end.synchronize()
    return {
        "loop_ms": overlapped_ms,
        "sync_loop_ms": loop_ms,
        "graph_ms": begin.elapsed_time(end) / 20,
    }


def _overlapped_loop(fast, batch, ids, positions, tables, context: int, steps: int) -> float:
    """ms per step when the host enqueues step N+1 (fed on the GPU) before it reads step N's
    sampled tokens: every step's tokens still reach the host, one step stays in flight."""
    import time

    pinned = [torch.empty(batch, dtype=torch.long).pin_memory() for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]
    received = 0
    for timed in (False, True):
        positions.fill_(context)
        _, next_tokens = fast.decode(ids, positions, tables)
        pinned[0].copy_(next_tokens, non_blocking=True)
        events[0].record()
        torch.cuda.synchronize()
        start = time.perf_counter()
        count = steps if timed else 3
        for step in range(1, count + 1):
            _, next_tokens = fast.decode_next(batch)
            pinned[step % 2].copy_(next_tokens, non_blocking=True)
            events[step % 2].record()
            events[(step - 1) % 2].synchronize()
            received += len(pinned[(step - 1) % 2].tolist())
        events[count % 2].synchronize()
        received += len(pinned[count % 2].tolist())
        elapsed = time.perf_counter() - start
    if received < batch * steps:
        raise RuntimeError("overlapped decode lost tokens")
    return elapsed / steps * 1e3


def _profile_decode(fast, entry: dict[str, Any]) -> None:
    """Top CUDA kernels of one eager bs=1 decode step (what a graph replay spends time on)."""
    from torch.profiler import ProfilerActivity, profile

    fast._graph_step(1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(3):
            fast._graph_step(1)
        torch.cuda.synchronize()
    rows = []
    events = profiler.key_averages()
    total = sum(event.device_time_total for event in events) or 1.0
    for event in sorted(events, key=lambda e: e.device_time_total, reverse=True)[:12]:
        rows.append([event.key[:90], round(event.device_time_total / 3, 1),
                     round(100 * event.device_time_total / total, 1)])  # fmt: skip
    entry["decode_bs1_profile_top_us_pct"] = rows


def time_decode(fast, entry, batches: list[int], context: int, steps: int, save) -> None:
    for name, ctx in (("decode_bs1_ms", 128), ("decode_bs1_ctx2048_ms", 2048)):
        timing = _decode_loop(fast, 1, ctx, max(steps, 50))
        entry[name] = round(timing["loop_ms"], 3)
        entry[name.replace("_ms", "_graph_only_ms")] = round(timing["graph_ms"], 3)
        entry[name.replace("_ms", "_sync_loop_ms")] = round(timing["sync_loop_ms"], 3)
        print(name, timing, flush=True)
    save()
    best, best_batch = 0.0, None
    entry["decode_context"] = context
    for batch in batches:
        timing = _decode_loop(fast, batch, context, steps)
        if timing is None:
            entry[f"decode_tok_s_bs{batch}"] = None
            continue
        rate = batch * 1e3 / timing["loop_ms"]
        entry[f"decode_tok_s_bs{batch}"] = round(rate, 1)
        entry[f"decode_step_ms_bs{batch}"] = round(timing["loop_ms"], 3)
        entry[f"decode_graph_only_ms_bs{batch}"] = round(timing["graph_ms"], 3)
        entry[f"decode_sync_loop_ms_bs{batch}"] = round(timing["sync_loop_ms"], 3)
        print("decode batch", batch, round(rate, 1), timing, flush=True)
        if rate > best:
            best, best_batch = rate, batch
        save()
    entry["decode_tok_s_best"] = round(best, 1)
    entry["decode_best_batch"] = best_batch
    try:
        _profile_decode(fast, entry)
    except Exception as error:  # the profile is a diagnosis, not a result
        entry["decode_bs1_profile_error"] = repr(error)


def _prefill_flops(config, lengths: list[int], model) -> float:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = sum(lengths)
    layer_params = sum(
        layer.self_attn.qkv_proj.weight.numel() + layer.self_attn.o_proj.weight.numel()
        + layer.mlp.gate_up_proj.weight.numel() + layer.mlp.down_proj.weight.numel()
        for layer in model.model.layers
    )  # fmt: skip
    linear = 2 * layer_params * tokens + 2 * model.head_weight.numel() * len(lengths)
    causal_pairs = sum(n * (n + 1) / 2 for n in lengths)
    attention = 4 * causal_pairs * config.num_attention_heads * head_dim * config.num_hidden_layers
    return linear + attention


def time_prefill(fast, config, entry, ceilings, batches: tuple[tuple[int, ...], ...]) -> None:
    from services.engine.backends.cuda_fast_path import prefill_metadata

    results = []
    for lengths in batches:
        tables = _sequential_tables(list(lengths), fast.block_size)
        if sum(len(t) for t in tables) > fast.num_blocks:
            continue
        positions, metadata = prefill_metadata(
            list(lengths), [0] * len(lengths), tables, fast.block_size, "cuda"
        )
        ids = torch.randint(0, config.vocab_size, (sum(lengths),), device="cuda")
        fast.forward(ids, positions, metadata)
        times = []
        for _ in range(5):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fast.forward(ids, positions, metadata)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        milliseconds = sorted(times)[len(times) // 2]
        flops = _prefill_flops(config, list(lengths), fast.model)
        rate = flops / (milliseconds * 1e-3) / 1e12
        results.append({
            "lengths": list(lengths), "ms": round(milliseconds, 2),
            "tok_s": round(sum(lengths) / (milliseconds * 1e-3), 1),
            "tflop_s": round(rate, 1),
            "matmul_fraction": round(rate / ceilings["matmul_tflop_s"], 3),
        })  # fmt: skip
        print("prefill", results[-1], flush=True)
    entry["prefill"] = results
    if results:
        entry["prefill_tok_s"] = results[0]["tok_s"]
        entry["prefill_matmul_fraction"] = results[0]["matmul_fraction"]
