"""The load side of the LoRA stack benchmark: its requests, one phase through the harness, and
what a phase's records come to (throughput, TTFT and TPOT percentiles, errors, the saturation
rate of a closed loop, the TTFT of frequent against rare adapters)."""

from __future__ import annotations

from typing import Any

import numpy as np

from loadtest.datasets import RequestSpec

VOCAB_LIMIT = 10_000


def make_specs(count: int, input_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    """`count` prompts of `input_len` random token ids asking for `output_len` tokens."""
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(
            i, input_len, output_len, tuple(rng.integers(100, VOCAB_LIMIT, input_len).tolist())
        )
        for i in range(count)
    ]


def with_adapters(specs: list[RequestSpec], names: list[str]) -> list[RequestSpec]:
    """The same requests, each naming its adapter ("" = the base model)."""
    return [
        RequestSpec(s.index, s.input_tokens, s.output_tokens, s.prompt_token_ids, adapter=name)
        for s, name in zip(specs, names, strict=True)
    ]


def run_phase(
    specs: list[RequestSpec], times: list[float], target: str, *, concurrency: int | None,
    workers: int, timeout_s: float = 300.0,
) -> list:  # fmt: skip
    """The harness's records of one phase (greedy, EOS ignored); a request still running after
    `timeout_s` ends with DEADLINE_EXCEEDED, so a phase never outlasts the budget."""
    from loadtest.runner import run
    from loadtest.schedule import ClientOptions

    options = ClientOptions(target=target, grpc_channels=8, timeout_s=timeout_s, temperature=0.0)
    result = run(
        specs, times, options, max_concurrency=concurrency, workers=workers, emit=lambda m: None
    )
    return result.records


def summarize(records: list) -> dict[str, Any]:
    """A phase in the report: counts, errors, output tokens/s, TTFT and TPOT percentiles."""
    from loadtest.metrics import details, summarize

    summary, info = summarize(records), details(records)
    ok = [r for r in records if r.status == "OK"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(records),
        "completed": info["completed"],
        "errors": info["errors"],
        "duration_s": round(info["duration_s"], 2),
        "output_tok_s": round(summary["output_token_throughput"], 1),
        "request_rate": round(summary["request_throughput"], 3),
        "ttft_ms": {
            "p50": rounded(summary["ttft_ms"]["p50"]),
            "p99": rounded(summary["ttft_ms"]["p99"]),
            "max": rounded(max(ttfts) * 1e3) if ttfts else None,
        },
        "tpot_ms": {k: rounded(summary["tpot_ms"][k]) for k in ("p50", "p99")},
        "max_send_lag_ms": rounded(summary["max_send_lag_ms"]),
    }


def steady_rate(records: list) -> float | None:
    """Output tokens/s of a closed loop between its first finish and its last send (every stream
    busy), over the mean output length: the saturation request rate (None: too short a run)."""
    ok = [r for r in records if r.status == "OK" and r.finished_s is not None]
    if not ok:
        return None
    begin = min(r.finished_s for r in ok)
    end = max(r.sent_s for r in records if r.sent_s is not None)
    if end - begin < 1.0:
        return None
    tokens = sum(
        n
        for r in records
        for t, n in zip(r.chunk_times_s, r.chunk_tokens, strict=True)
        if begin <= t <= end
    )
    return tokens / (end - begin) / float(np.mean([r.expected_output_tokens for r in records]))


def ttft_p99_by_group(records: list, top: set[str]) -> dict[str, float | None]:
    """p99 TTFT (ms) of the requests naming one of the `top` adapters and of the others."""
    groups: dict[str, list[float]] = {"top_adapters": [], "other_adapters": []}
    for r in records:
        if r.status == "OK" and r.ttft_s is not None:
            groups["top_adapters" if r.adapter in top else "other_adapters"].append(r.ttft_s)
    return {
        key: rounded(float(np.percentile(values, 99)) * 1e3) if values else None
        for key, values in groups.items()
    }


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(float(value), digits)
