"""Where a saturated engine's time goes: steps, kernels and the batch cap, on one GPU.

Runs the `fixed` request set of benchmarks.gpu_stack (512 prompt / 256 output tokens, greedy,
EOS ignored) through one warmed LLMEngine, as `LLM.generate` drives it, once per running-batch
cap (`--caps`: the scheduler's max_num_seqs for that pass), and reports per pass the output
tokens/s, every request's time per output token (TPOT: from its first token to its last, over
the tokens between) and the step mix (decode-only steps vs steps that hold prompt tokens). The
first pass also profiles `--profile-steps` steady steps with torch.profiler: GPU time by kernel
family (matmul, attention, norm, ...) against the steps' wall time, so the gaps show. Triton
kernels compiled after the warm-up are listed (a compile on the serving path is a slow first
request).

    python -m benchmarks.gpu_step_profile --requests 600 --caps 512,384,256 --out profile.json

With `--adapters N` the engine serves N random rank-`--rank` PEFT adapters (all seven
projections) in `--max-loras` slots, all loaded into host memory first, and every cap runs
twice on it: the requests on the base model, then each naming an adapter drawn Zipf
(`--zipf-s`) over the N; both profiled, so the LoRA steps' kernels, their share of the wall
time and the host's gaps compare with the base steps' of the same engine.

    python -m benchmarks.gpu_step_profile --adapters 48 --max-loras 16 --caps 256 \
        --low-requests 0 --out lora-profile.json

With `--rate R` the passes are open loop instead, as `benchmarks.lora_stack` loads the stack but
with no router, tokenizer or gRPC: the same requests arrive at the same Poisson times
(`--duration-s` of arrivals) on the base model, then on the adapters, at the engine's own
batch cap; each pass reports TTFT, TPOT, output tokens/s to its last finish, the scheduler's
running, paused and waiting sequences, and profiles `--profile-steps` steps from the middle of
its arrivals; `lora_over_base_output` is the ratio of the two passes' output tokens/s. With
`--py-spy DIR` (py-spy installed) each pass's host is sampled while its arrivals last, and the
pass reports each function's share of the samples under the engine's `step`.

    python -m benchmarks.gpu_step_profile --adapters 100 --max-loras 16 --rate 29 \
        --duration-s 45 --low-requests 0 --profile-steps 60 --out lora-poisson.json
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import py_spy
from benchmarks.gpu_stack import DEFAULT_MODEL, fixed_specs, percentiles_ms
from benchmarks.lora_stack_adapters import write_adapters
from loadtest.datasets import choose_adapters

# Kernel families by substrings of the kernel name, first match wins.
FAMILIES = (
    ("lora", ("lora",)),
    ("attention", ("attention", "attn", "flash", "fmha")),
    ("matmul", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "skinny", "matmul", "sm90")),
    ("norm", ("rms", "norm")),
    ("rotary / kv store", ("rotary", "kv_store", "paged_kv")),
    ("activation", ("swiglu", "silu")),
    ("sampling", ("sort", "argmax", "softmax", "topk", "multinomial", "exponential", "sampl")),
    ("copies", ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter", "cat")),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, needles in FAMILIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def run_pass(
    engine: Any,
    specs: list,
    cap: int,
    profile_steps: int,
    tag: str,
    adapters: list[str] | None = None,
) -> dict[str, Any]:
    """One pass of `specs` under a running-batch cap (each naming `adapters[i]` when given:
    "" is the base model); profiles steady steps if asked."""
    scheduler = engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_seqs=cap)
    for number, spec in enumerate(specs):
        _add(engine, f"{tag}-{spec.index}", spec, adapters[number] if adapters else None)
    tally = StepTally(engine, profile_steps, profile_from=120)
    while engine.has_unfinished():
        tally.step()
    result = {"max_num_seqs": cap, "requests": len(specs), **tally.result(adapters)}
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    return result


ENGINE_STEP_FRAME = "LLMEngine.step (engine/llm_engine.py)"


def poisson_pass(
    engine: Any,
    specs: list,
    times: list[float],
    profile_steps: int,
    tag: str,
    adapters: list[str] | None = None,
    cprofile_to: Path | None = None,
    spy_to: Path | None = None,
) -> dict[str, Any]:
    """`specs[i]` added at `times[i]` s (open loop, as a Poisson load through the stack would
    bring them), stepped until all finish; profiles `profile_steps` steps from the middle of
    the arrivals, and with `spy_to` samples the host with py-spy while arrivals last (raw
    stacks there). Output tokens/s counts to the last finish, as the stack benchmarks do."""
    sampler = py_spy.Sampler(spy_to) if spy_to is not None else None
    if sampler is not None:
        sampler.start()  # on failure: its error in the result
    tally = StepTally(engine, profile_steps, profile_from=None)
    tally.cprofile_to = cprofile_to
    middle = times[-1] / 2 if times else 0.0
    next_index = 0
    while next_index < len(specs) or engine.has_unfinished():
        now = time.perf_counter() - tally.started
        while next_index < len(specs) and times[next_index] <= now:
            spec = specs[next_index]
            adapter = adapters[next_index] if adapters else None
            tally.added[f"{tag}-{spec.index}"] = time.perf_counter()
            _add(engine, f"{tag}-{spec.index}", spec, adapter)
            next_index += 1
            if next_index == len(specs):
                tally.arrivals_end = time.perf_counter() - tally.started
                if sampler is not None:
                    sampler.stop()
        if tally.profile_from is None and now >= middle:
            tally.profile_from = len(tally.steps)
        if not engine.has_unfinished():
            time.sleep(min(0.001, max(times[next_index] - now, 0.0)))
            continue
        tally.step()
    result = {
        "rate": round(len(times) / times[-1], 2) if times else 0.0,
        "requests": len(specs),
        **tally.result(adapters),
    }
    if sampler is not None:
        sampler.stop()
        result["py_spy"] = sampler.error or py_spy.summarize(
            sampler.raw_path, ENGINE_STEP_FRAME, 60
        )
    print(
        json.dumps({k: v for k, v in result.items() if k not in ("profile", "py_spy")}), flush=True
    )
    return result


def _add(engine: Any, request_id: str, spec: Any, adapter: str | None) -> None:
    from services.common.protocol.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, list(spec.prompt_token_ids), params, adapter=adapter or None)


class StepTally:
    """Steps an engine and keeps what a pass reports: each request's first and last token,
    each step's time and rows, the scheduler's state per step, and a torch.profiler window of
    `profile_steps` steps from step `profile_from` (None: not yet known)."""

    def __init__(self, engine: Any, profile_steps: int, profile_from: int | None) -> None:
        self.engine = engine
        self.profile_steps = profile_steps
        self.profile_from = profile_from
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.added: dict[str, float] = {}
        self.tokens: dict[str, int] = defaultdict(int)
        self.steps: list[tuple[float, int, int]] = []  # (seconds, prefill, decoded tokens)
        self.states: list[tuple[int, int, int]] = []  # (running, paused, waiting)
        self.profiled: dict[str, Any] = {}
        self._profiler: Any = None
        self._in_window = False
        self._profile_started = 0.0
        self._host = HostTimers(engine)
        self._pauses = engine.scheduler.num_pauses
        self._reasons = dict(engine.plain_step_reasons)
        self.planned_ahead = 0
        self.call_s = 0.0  # host time inside engine.step()
        self.step_ends: list[float] = []  # seconds since the start, per step
        self.arrivals_end: float | None = None  # the last arrival, open-loop passes
        # per step() call: host s planning and launching the next step while this one ran,
        # and whether that step holds prompt tokens (None: no step launched ahead)
        self.launches: list[tuple[float, bool | None]] = []
        self._launch: tuple[float, bool | None] = (0.0, None)
        self._unwrap = time_method(engine, "_launch_ahead", self._note_launch)
        self.cprofile_to: Path | None = None  # a text file: the window's cProfile
        self._cprofile: cProfile.Profile | None = None
        self._slot_writes = self._slot_write_count()
        self.started = time.perf_counter()

    def _write_cprofile(self) -> None:
        """The profiled window's host functions: the 40 costliest by own and by total time."""
        assert self.cprofile_to is not None and self._cprofile is not None
        text = io.StringIO()
        stats = pstats.Stats(self._cprofile, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        self.cprofile_to.write_text(text.getvalue())

    def _note_launch(self, seconds: float, ahead: Any) -> None:
        """One launch-ahead call of the engine: its host time, and whether the step it
        launched holds prompt tokens (None: it launched none)."""
        prompt = None if ahead is None else ahead.num_tokens > len(ahead.scheduled)
        self._launch = (seconds, prompt)

    def _slot_write_count(self) -> int:
        adapters = self.engine.adapters
        return adapters.manager.num_slot_writes if adapters is not None else 0

    def step(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        index = len(self.steps)
        if self.profile_steps and index == self.profile_from and not self._in_window:
            _sync(torch)
            self._in_window = True
            if self.cprofile_to is not None:  # the host alone: no kernel trace beside it
                self._cprofile = cProfile.Profile()
            else:
                activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
            self._profile_started = time.perf_counter()
            self._host.start()
            if self._cprofile is not None:
                self._cprofile.enable()
        called = time.perf_counter()
        self._launch = (0.0, None)
        output = self.engine.step()
        self.launches.append(self._launch)
        now = time.perf_counter()
        self.call_s += now - called
        self.planned_ahead += bool(output.planned_ahead)
        self.step_ends.append(now - self.started)
        decoded = 0
        for delta in output.deltas:
            count = len(delta.new_token_ids)
            decoded += count
            if count:
                self.first.setdefault(delta.request_id, now)
                self.last[delta.request_id] = now
                self.tokens[delta.request_id] += count
        self.steps.append(
            (output.step_time_s, max(output.num_batched_tokens - decoded, 0), decoded)
        )
        scheduler = self.engine.scheduler
        self.states.append((len(scheduler.running), len(scheduler.paused), scheduler.num_waiting))
        if self._in_window and index == self.profile_from + self.profile_steps - 1:
            self._close_window(index)

    def _close_window(self, index: int) -> None:
        import torch

        if self._cprofile is not None:
            self._cprofile.disable()
        _sync(torch)
        wall = time.perf_counter() - self._profile_started
        window = slice(self.profile_from, index + 1)
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.profiled = kernel_breakdown(self._profiler, wall, self.steps[window])
        else:
            self._write_cprofile()
            self.profiled = {"steps": index + 1 - self.profile_from, "wall_ms": wall * 1e3}
        self.profiled["host_ms"] = self._host.stop()
        self.profiled["running_paused_waiting_mean"] = [
            round(float(v), 1) for v in np.asarray(self.states[window]).mean(axis=0)
        ]
        self._profiler = self._cprofile = None
        self._in_window = False
        self.profile_steps = 0

    def _timing(self, elapsed: float) -> dict[str, Any]:
        """Where the pass's wall time went: the steps' own (device) spans, the host's calls,
        the wall time no step covers (the device idle, or waiting for arrivals), the steps
        planned ahead and why the others were not; for open-loop passes the output and steps
        after the last arrival (the drain)."""
        steps = len(self.steps)
        span_s = sum(s[0] for s in self.steps)
        reasons = {
            key: count - self._reasons.get(key, 0)
            for key, count in self.engine.plain_step_reasons.items()
            if count - self._reasons.get(key, 0)
        }
        timing: dict[str, Any] = {
            "step_span_s": round(span_s, 3),
            "wall_outside_step_spans_s": round(elapsed - span_s, 3),
            "host_s_in_step_calls": round(self.call_s, 3),
            "planned_ahead_share": round(self.planned_ahead / steps, 3) if steps else 0.0,
            "plain_steps_by_reason": reasons,
        }
        timing["launch_ahead_ms"] = self._launch_summary()
        if self.arrivals_end is not None:
            after = [i for i, end in enumerate(self.step_ends) if end > self.arrivals_end]
            timing["drain"] = {
                "seconds": round(elapsed - self.arrivals_end, 3),
                "steps": len(after),
                "decoded_tokens": int(sum(self.steps[i][2] for i in after)),
                "step_span_s": round(sum(self.steps[i][0] for i in after), 3),
            }
        return timing

    def _launch_summary(self) -> dict[str, Any]:
        """Host ms planning and launching each step ahead, by whether it holds prompt tokens,
        and the seconds those launches outlasted the step running meanwhile: device time
        idle waiting for the host (an estimate: that step may have begun before the call)."""
        summary: dict[str, Any] = {}
        for label, kind in (("with_prompt", True), ("decode_only", False)):
            values = [s for s, prompt in self.launches if prompt is kind]
            summary[label] = {"count": len(values), **percentiles_ms(values)}
        summary["outlasting_the_running_step_s"] = round(
            sum(
                max(0.0, launch - step[0])
                for (launch, prompt), step in zip(self.launches, self.steps, strict=True)
                if prompt is not None
            ),
            3,
        )
        return summary

    def result(self, adapters: list[str] | None) -> dict[str, Any]:
        import torch

        self._unwrap()
        _sync(torch)
        elapsed = time.perf_counter() - self.started
        first, last, tokens = self.first, self.last, self.tokens
        tpot_s = [(last[r] - first[r]) / (tokens[r] - 1) for r in first if tokens[r] > 1]
        mixed = [s for s in self.steps if s[1] > 0]
        decode_only = [s for s in self.steps if s[1] == 0]
        states = np.asarray(self.states or [(0, 0, 0)])
        result: dict[str, Any] = {
            "seconds": round(elapsed, 3),
            "output_tok_s": round(sum(tokens.values()) / elapsed, 1),
            "tpot_ms": percentiles_ms(tpot_s),
            "steps": len(self.steps),
            "step_ms": percentiles_ms([s[0] for s in self.steps]),
            "mixed_steps": {"count": len(mixed), **mean_columns(mixed)},
            "decode_steps": {"count": len(decode_only), **mean_columns(decode_only)},
            "running_paused_waiting_max": [int(v) for v in states.max(axis=0)],
            "running_paused_waiting_mean": [round(float(v), 1) for v in states.mean(axis=0)],
            **self._timing(elapsed),
        }
        if self.added:
            result["ttft_ms"] = percentiles_ms(
                [first[r] - self.added[r] for r in self.added if r in first]
            )
        if adapters:
            result["adapter_requests"] = sum(1 for name in adapters if name)
            result["pauses"] = self.engine.scheduler.num_pauses - self._pauses
            result["slot_writes"] = self._slot_write_count() - self._slot_writes
        if self.profiled:
            result["profile"] = self.profiled
        return result


def low_load_pass(engine: Any, specs: list, rate: float, tag: str) -> dict[str, Any]:
    """Requests arriving every 1/rate s on a fresh engine: each one's TTFT, in order."""
    from services.common.protocol.sampling_params import SamplingParams

    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    order: list[str] = []
    started = time.perf_counter()
    next_index = 0
    while next_index < len(specs) or engine.has_unfinished():
        now = time.perf_counter()
        while next_index < len(specs) and now - started >= next_index / rate:
            spec = specs[next_index]
            request_id = f"{tag}-{spec.index}"
            params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(request_id, list(spec.prompt_token_ids), params)
            added[request_id] = time.perf_counter()
            order.append(request_id)
            next_index += 1
        if not engine.has_unfinished():
            time.sleep(0.0005)
            continue
        output = engine.step()
        now = time.perf_counter()
        for delta in output.deltas:
            if delta.new_token_ids and delta.request_id not in ttft:
                ttft[delta.request_id] = now - added[delta.request_id]
    values = [round(ttft[r] * 1e3, 2) for r in order]
    later = percentiles_ms([ttft[r] for r in order[10:]])
    return {"rate": rate, "ttft_ms_in_order": values, "after_first_10_ms": later}


def kernel_breakdown(profiler: Any, wall_s: float, steps: list) -> dict[str, Any]:
    """GPU time by kernel family and the top kernels over the profiled steps."""
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in profiler.events():
        if event.device_type.name != "CUDA":
            continue
        micros = event.device_time
        by_family[family(event.name)] += micros
        entry = by_kernel[event.name]
        entry[0] += micros
        entry[1] += 1
    gpu_us = sum(by_family.values())
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:25]
    return {
        "steps": len(steps),
        "wall_ms": round(wall_s * 1e3, 2),
        "gpu_busy_ms": round(gpu_us / 1e3, 2),
        "prefill_tokens": int(sum(s[1] for s in steps)),
        "decoded_tokens": int(sum(s[2] for s in steps)),
        "family_ms": {
            k: round(v / 1e3, 2) for k, v in sorted(by_family.items(), key=lambda i: -i[1])
        },
        "top_kernels": [
            {"name": name[:120], "ms": round(v[0] / 1e3, 3), "calls": v[1]} for name, v in top
        ],
    }


def mean_columns(steps: list[tuple[float, int, int]]) -> dict[str, float]:
    """Mean step ms, prompt tokens and decoded tokens of some steps."""
    if not steps:
        return {}
    seconds, prefill, decoded = np.asarray(steps, dtype=float).T
    return {
        "step_ms": round(float(seconds.mean() * 1e3), 2),
        "prefill_tokens": round(float(prefill.mean()), 1),
        "decoded_tokens": round(float(decoded.mean()), 1),
    }


def time_method(owner: Any, name: str, record: Callable[[float, Any], None]) -> Callable[[], None]:
    """Wrap `owner.name` (an instance attribute over its method) so that each call's host
    seconds and result go to `record`; returns the undo (the method shows again)."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        result = None
        try:
            result = original(*args, **kwargs)
            return result
        finally:
            record(time.perf_counter() - began, result)

    setattr(owner, name, timed)
    return lambda: delattr(owner, name)


class HostTimers:
    """Host time spent in the scheduler and in the per-step LoRA layout while profiling."""

    def __init__(self, engine: Any) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._targets = [(engine.scheduler, "schedule")]
        if engine.adapters is not None:
            self._targets.append((engine.adapters, "begin_step"))
        self._undo: list[Callable[[], None]] = []

    def start(self) -> None:
        for owner, name in self._targets:
            self._undo.append(time_method(owner, name, partial(self._add, name)))

    def stop(self) -> dict[str, float]:
        for undo in self._undo:
            undo()
        self._undo.clear()
        return {name: round(total * 1e3, 2) for name, total in self.totals.items()}

    def _add(self, name: str, seconds: float, _result: Any) -> None:
        self.totals[name] += seconds


def load_adapters(engine: Any, names: list[str]) -> None:
    """Register the adapters and bring each into host memory (one short request each), so
    the passes measure steps, not disk reads."""
    from services.common.protocol.sampling_params import SamplingParams

    for name in names:
        engine.register_adapter(engine.inspect_adapter(name, name))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(f"load-{name}", [1, 2, 3], params, adapter=name)
    while engine.has_unfinished():
        if engine.waiting_for_adapters():
            engine.wait_for_adapter_load(0.1)
        engine.step()


def _sync(torch: Any) -> None:
    """Wait for the device (nothing to wait for on a CPU engine)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _record(report: dict[str, Any], out: Path, mix: str, run: Any) -> None:
    """Run one pass, note the kernels compiled during it, add it to the report and save."""
    from services.engine import compile_watch

    compiled_before = len(compile_watch.late_compiles())
    result = run()
    result["requests_on"] = mix
    result["compiled_after_warm_up"] = [
        what for _, what in compile_watch.late_compiles()[compiled_before:]
    ]
    report["passes"].append(result)
    out.write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_step_profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=600, help="requests per pass")
    parser.add_argument("--caps", default="512,384,256", help="max_num_seqs of each pass")
    parser.add_argument("--profile-steps", type=int, default=40, help="0: no profile")
    parser.add_argument("--low-requests", type=int, default=30, help="0: no low-load pass")
    parser.add_argument("--low-rate", type=float, default=3.0, help="req/s of the low-load pass")
    parser.add_argument("--target-step-ms", type=float, default=0.0)
    parser.add_argument("--adapters", type=int, default=0, help="random LoRA adapters (0: none)")
    parser.add_argument("--max-loras", type=int, default=16, help="device slots")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the draw")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="requests/s: open-loop Poisson passes at this rate instead of the closed passes of "
        "--caps (the engine's own batch cap), each --duration-s s of arrivals; profiles from the "
        "middle of the arrivals",
    )
    parser.add_argument("--duration-s", type=float, default=45.0, help="arrivals per --rate pass")
    parser.add_argument(
        "--cprofile-dir",
        type=Path,
        default=None,
        help="with --rate: also a cProfile of the host over each pass's profiled steps "
        "(PASS.txt, the costliest functions)",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="with --rate: also sample the host with py-spy while each pass's arrivals last "
        "(raw stacks in DIR/PASS.txt; the report's py_spy: each function's share of the "
        "samples under the engine's step)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    from services.engine import compile_watch
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    lora: dict[str, Any] = {}
    names: list[str] = []
    if args.adapters:
        root = Path(tempfile.mkdtemp(prefix="step-profile-adapters-"))
        written = write_adapters(
            root, args.model, args.adapters, args.rank, progress=lambda *_: None
        )
        names = written.pop("names")
        lora = {
            "adapter_root": str(root),
            "max_loras": args.max_loras,
            "max_cpu_loras": args.adapters,
            "max_lora_rank": args.rank,
        }
    engine = LLMEngine(
        EngineConfig(model=args.model, device="cuda", target_step_ms=args.target_step_ms, **lora)
    )
    warm = engine.warm_up()
    print(warm.summary(), flush=True)  # the warm-up armed the engine's compile watch
    if names:
        load_adapters(engine, names)
    low_started = time.monotonic()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.gpu_step_profile "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "engine": {
            "max_num_seqs": engine.info.max_num_seqs,
            "max_num_batched_tokens": engine.info.max_num_batched_tokens,
            "target_step_ms": args.target_step_ms,
        },
        "passes": [],
    }
    count = round(args.rate * args.duration_s) if args.rate > 0 else args.requests
    specs = fixed_specs(count)
    if args.low_requests:
        compiled_before = len(compile_watch.late_compiles())
        low = low_load_pass(engine, specs[: args.low_requests], args.low_rate, "low")
        low["compiled_after_warm_up"] = [
            {"kernel": what, "s_after_start": round(at - low_started, 3)}
            for at, what in compile_watch.late_compiles()[compiled_before:]
        ]
        print(json.dumps(low), flush=True)
        report["low_load"] = low
    drawn = choose_adapters(np.random.default_rng(4), names, "zipf", args.zipf_s, len(specs))
    report["adapters"] = {"count": args.adapters, "max_loras": args.max_loras, "rank": args.rank}
    mixes = [("base", None), ("lora", drawn)] if names else [("base", None)]
    if args.rate > 0:
        gaps = np.random.default_rng(5).exponential(1.0 / args.rate, len(specs))
        times = np.cumsum(gaps).tolist()
        for mix, adapters in mixes:
            run = partial(poisson_pass, engine, specs, times, args.profile_steps)
            where = None if args.cprofile_dir is None else args.cprofile_dir / f"{mix}.txt"
            spy = None if args.py_spy is None else args.py_spy / f"{mix}.txt"
            _record(report, args.out, mix, partial(run, f"poisson-{mix}", adapters, where, spy))
        if len(report["passes"]) == 2:
            base, lora_pass = (p["output_tok_s"] for p in report["passes"])
            report["lora_over_base_output"] = round(lora_pass / base, 3)
            args.out.write_text(json.dumps(report, indent=1))
        return 0
    for number, cap in enumerate(int(value) for value in args.caps.split(",")):
        profile_steps = args.profile_steps if number == 0 else 0
        for mix, adapters in mixes:
            run = partial(run_pass, engine, specs, cap, profile_steps, f"pass{number}-{mix}")
            _record(report, args.out, mix, partial(run, adapters))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
