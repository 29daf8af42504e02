"""The adapter side of the LoRA stack benchmark: random PEFT files, registration, what to watch.

- `write_adapters`: N random rank-r PEFT adapters on the given projections of a model (all seven
  by default; A and B both non-zero, bf16), as `adapter_config.json` +
  `adapter_model.safetensors` with PEFT's tensor names. Fast at real sizes (100 x 84 MB for
  Llama-3-8B at rank 16 in about 10 s): one pool of normal values drawn once from the seed, each
  tensor a copy of the pool at offsets drawn from the seed and the adapter's index, so every
  adapter (and its checksum) differs.
- `register_adapters`: the router's AddAdapter, the call `sluice adapters add` makes, a few at
  once (each has an engine read and check the files).
- `ResidencyPoller`: the router's ListAdapters polled from a thread; every adapter that turns up
  resident on an engine between two polls counts as one slot load (a lower bound: one loaded and
  evicted between polls is missed).
- `queue_wait_window`: what the router's `sluice_router_first_token_phase_seconds{phase="queue"}`
  histogram says about the longest queue wait between two scrapes (bucket bounds only).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POOL_VALUES = 1 << 22
VALUE_STD = 0.01


def model_config_of(model: str) -> Any:
    """The engine's ModelConfig of `model` (a dummy shape needs no files)."""
    from services.common.model_files import resolve_model
    from services.common.protocol.dummy_shapes import dummy_config
    from services.engine.models.config import ModelConfig

    if model.startswith("dummy:"):
        return ModelConfig.from_dict(dummy_config(model.removeprefix("dummy:")), name=model)
    files = resolve_model(model)
    return ModelConfig.from_directory(files.weights_dir, name=model)


def adapter_names(count: int, prefix: str = "adapter") -> list[str]:
    return [f"{prefix}-{index:03d}" for index in range(count)]


def write_adapters(
    root: Path,
    model: str,
    count: int,
    rank: int,
    seed: int = 0,
    progress: Callable = print,
    *,
    modules: tuple[str, ...] = MODULES,
    prefix: str = "adapter",
) -> dict[str, Any]:
    """Write `count` adapters on `modules` under root/<prefix>-NNN; returns their names, bytes
    each and seconds."""
    import torch
    from safetensors.torch import save_file

    from services.engine.lora.projections import MODULE_PARENT, module_shape

    config = model_config_of(model)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL_VALUES, generator=generator) * VALUE_STD).to(torch.bfloat16)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
    }
    names = adapter_names(count, prefix)
    size = 0
    for index, name in enumerate(names):
        rng = np.random.default_rng([seed, index])
        tensors = {}
        for layer in range(config.num_layers):
            for module in modules:
                in_features, out_features = module_shape(config, module)
                prefix = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
                for factor, shape in (("A", (rank, in_features)), ("B", (out_features, rank))):
                    values = shape[0] * shape[1]
                    offset = int(rng.integers(0, POOL_VALUES - values))
                    tensor = pool[offset : offset + values].view(shape).clone()
                    tensors[f"{prefix}.lora_{factor}.weight"] = tensor
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_config.json").write_text(json.dumps(peft_config, indent=1))
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        size = (directory / "adapter_model.safetensors").stat().st_size
        if (index + 1) % 10 == 0 or index + 1 == count:
            elapsed = time.perf_counter() - started
            progress(
                f"wrote {index + 1}/{count} adapters ({size / 1e6:.1f} MB each) in {elapsed:.1f}s"
            )
    return {
        "names": names,
        "bytes_each": size,
        "write_s": round(time.perf_counter() - started, 2),
    }


def register_adapters(target: str, names: list[str], threads: int = 8) -> float:
    """AddAdapter for each name (path = name under the adapter root); returns seconds taken."""
    import grpc

    from protos.sluice.v1 import router_pb2, router_pb2_grpc

    started = time.perf_counter()
    with grpc.insecure_channel(target) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        def add(name: str) -> None:
            stub.AddAdapter(router_pb2.AddAdapterRequest(name=name, path=name), timeout=120.0)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(add, names))  # raises the first refusal
    return time.perf_counter() - started


class ResidencyPoller:
    """Counts adapters arriving in engines' device slots, from the router's ListAdapters."""

    def __init__(self, target: str, interval_s: float = 0.25) -> None:
        self._target = target
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.polls = self.failures = self.slot_loads_seen = self.max_resident = 0
        self.adapters_seen: set[str] = set()

    def start(self) -> ResidencyPoller:
        self._thread = threading.Thread(target=self._loop, name="residency", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return {
            "polls": self.polls,
            "poll_interval_s": self._interval_s,
            "poll_failures": self.failures,
            "slot_loads_seen": self.slot_loads_seen,
            "distinct_adapters_seen_resident": len(self.adapters_seen),
            "max_resident_seen": self.max_resident,
        }

    def _loop(self) -> None:
        import grpc

        from protos.sluice.v1 import router_pb2, router_pb2_grpc

        previous: set[tuple[str, str]] | None = None
        with grpc.insecure_channel(self._target) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while not self._stop.is_set():
                try:
                    reply = stub.ListAdapters(router_pb2.ListAdaptersRequest(), timeout=5.0)
                except grpc.RpcError:
                    self.failures += 1
                else:
                    now = {(a.name, e) for a in reply.adapters for e in a.resident_on}
                    if previous is not None:
                        self.slot_loads_seen += len(now - previous)
                    previous = now
                    self.polls += 1
                    self.max_resident = max(self.max_resident, len(now))
                    self.adapters_seen.update(name for name, _ in now)
                self._stop.wait(self._interval_s)


QUEUE_WAIT_METRIC = "sluice_router_first_token_phase_seconds"


def scrape_queue_buckets(metrics_url: str) -> list[tuple[float, float]]:
    """The cumulative buckets of the router's queue-phase histogram now."""
    from loadtest.scrape import scrape_histogram

    return scrape_histogram(metrics_url, QUEUE_WAIT_METRIC, "phase").get("queue", [])


def queue_wait_window(
    before: list[tuple[float, float]], after: list[tuple[float, float]], bound_s: float
) -> dict[str, Any]:
    """Queue waits observed between two scrapes: count, p99 (interpolated), the bucket the
    longest fell in (`max_s_above` < max <= `max_s_at_most`; None: past the last bound) and how
    many surely (`over_bound_at_least`) or possibly (`over_bound_at_most`) exceeded `bound_s`."""
    from loadtest.scrape import window_quantile

    earlier = dict(before)
    window = [(bound, count - earlier.get(bound, 0.0)) for bound, count in sorted(after)]
    total = window[-1][1] if window else 0.0
    if total <= 0:
        return {"count": 0}
    lower = 0.0
    upper: float | None = None
    for bound, count in window:
        if count >= total:
            upper = None if bound == float("inf") else bound
            break
        lower = bound
    within_sure = max((c for b, c in window if b <= bound_s), default=0.0)
    within_maybe = min((c for b, c in window if b >= bound_s), default=total)
    p99 = window_quantile(before, after, 0.99)
    return {
        "count": int(total),
        "p99_s_interpolated": None if p99 is None else round(p99, 4),
        "max_s_above": lower,
        "max_s_at_most": upper,
        "over_bound_at_least": int(total - within_maybe),
        "over_bound_at_most": int(total - within_sure),
    }
