"""The serving-stack benchmark: streamed tokens/s through the router vs the engine alone.

With a `dummy:tiny` model (hidden size 16) the forward pass is cheap, so the numbers measure the
stack (gRPC hops, detokenization, per-request streaming), not the model. It
1. starts a tokenizer, one engine and the router as separate processes on free loopback ports
   (services/launcher.py; or uses `--router/--engine/--tokenizer` of a running stack);
   `--synthetic-step-ms` replaces the engine by a model-free one (benchmarks/synthetic_engine.py);
2. runs the same closed loop (benchmarks/stack_bench_clients.py: `--concurrency` staggered streams,
   counted over `--duration-s` seconds after `--warmup-s`) straight to the engine over one
   EngineSession (the engine alone), then through the router's public Generate with text prompts.
   The load generator is a process of its own (benchmarks/stack_bench_load.py), by default at the
   lowest CPU priority (`--client-priority low`: nice 19, in its own session), so that on a small
   machine it takes only what the stack leaves, as a client on another machine would; the
   stack and the probe keep normal priority;
3. reports streamed tokens/s of both and their ratio, tokens per response message, median and p90
   time to first token under that load and idle (one request at a time), the added median TTFT
   (router minus engine alone, both ways; under load also from a separate probe process,
   benchmarks/stack_bench_probe.py, which the load generator's own event loop cannot delay), and
   each process's CPU microseconds per streamed token (router, engine, tokenizer, and the
   load generator as "bench client"; from /proc through psutil), the engine's mean batch in the
   window (tokens per step, from its /metrics: did the load keep it as full on both sides?), and
   where the router's time to first token went under the load (median per phase: tokenize,
   queue, engine, detokenize; from the router's `sluice_router_first_token_phase_seconds`
   histogram over the same window).

`--cpus 0,1` runs the bench and every process it starts on those CPUs only (as `taskset -c`),
so a bigger machine can show the same stack on 2 cores against more. `--client-cpus 2,3` then
moves the load generator and the probe off them once the stack runs, as clients on other
machines would be.

    python -m benchmarks.stack_bench --model dummy:tiny --concurrency 64 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import grpc
import psutil

from benchmarks import hop_report
from benchmarks.stack_bench_clients import (
    PROMPTS,
    LoadShape,
    RunResult,
    engine_idle_ttft,
    percentile,
    router_idle_ttft,
)
from benchmarks.stack_bench_load import PRIORITIES
from loadtest.scrape import Buckets, scrape_histogram, scrape_samples, window_quantile
from protos.sluice.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import event_loop
from services.router.metrics import FIRST_TOKEN_PHASE_METRIC, FIRST_TOKEN_PHASES


async def _tokenize(address: str) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        response = await stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(
                items=[tokenizer_pb2.TokenizeItem(text=p) for p in PROMPTS]
            )
        )
    return [list(result.token_ids) for result in response.results]


def _find_pid(address: str) -> int | None:
    port = int(address.rpartition(":")[2])
    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN":
            return connection.pid
    return None


def _cpu_sampler(pids: dict[str, int | None]):
    processes = {}
    for name, pid in pids.items():
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                processes[name] = psutil.Process(pid)

    def sample() -> dict[str, float]:
        seconds = {}
        for name, process in processes.items():
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            seconds[name] = times.user + times.system
        return seconds

    return sample


class FirstTokenPhases:
    """Snapshots of the router's first-token phase histogram (its /metrics) at the counting
    window's edges; `medians_ms()` gives each phase's median inside the window."""

    def __init__(self, metrics_url: str) -> None:
        self.url = metrics_url
        self.snapshots: list[dict[str, Buckets]] = []

    def snapshot(self) -> None:
        self.snapshots.append(scrape_histogram(self.url, FIRST_TOKEN_PHASE_METRIC, "phase"))

    def medians_ms(self) -> dict[str, float | None]:
        if len(self.snapshots) < 2:
            return {}
        first, last = self.snapshots[0], self.snapshots[-1]
        medians: dict[str, float | None] = {}
        for phase in FIRST_TOKEN_PHASES:
            median = window_quantile(first.get(phase, []), last.get(phase, []), 0.5)
            medians[phase] = None if median is None else median * 1e3
        return medians


ENGINE_STEPS_METRIC = "sluice_engine_step_time_seconds_count"
ENGINE_TOKENS_METRIC = "sluice_engine_generated_tokens_total"


class EngineBatch:
    """The engine's step and token counters (its /metrics) at the window's edges: its mean
    batch in the window, which says whether the load kept the engine as busy on both sides."""

    def __init__(self, metrics_url: str) -> None:
        self.url = metrics_url
        self.snapshots: list[dict[str, float]] = []

    def snapshot(self) -> None:
        names = {ENGINE_STEPS_METRIC, ENGINE_TOKENS_METRIC}
        try:
            self.snapshots.append(scrape_samples(self.url, names))
        except (OSError, ValueError) as exc:  # a side figure: the run goes on without it
            print(f"warning: no engine metrics from {self.url}: {exc}", file=sys.stderr)
            self.snapshots.append({})

    def tokens_per_step(self) -> float | None:
        """None unless both edges were read and the engine stepped in between."""
        if len(self.snapshots) < 2:
            return None
        first, last = self.snapshots[-2:]
        names = (ENGINE_STEPS_METRIC, ENGINE_TOKENS_METRIC)
        if any(name not in first or name not in last for name in names):
            return None
        steps = last[ENGINE_STEPS_METRIC] - first[ENGINE_STEPS_METRIC]
        tokens = last[ENGINE_TOKENS_METRIC] - first[ENGINE_TOKENS_METRIC]
        return tokens / steps if steps > 0 else None


# Started with the counting window's (start, end) in time.monotonic() seconds; returns the
# probe's times to first token (benchmarks/stack_bench_probe.py), seconds.
Probe = Callable[[float, float], Awaitable[list[float]]]


async def _run_load(
    side: str,
    address: str,
    args: argparse.Namespace,
    pids: dict[str, int | None],
    prompt_ids: list[list[int]],
    probe: Probe | None,
    at_edge: Callable[[], None],
) -> tuple[RunResult, dict]:
    """One side's load in its own process (benchmarks/stack_bench_load.py, at --client-priority):
    CPU of every process sampled here at the window's edges, the probe started inside it."""
    shape = LoadShape(args.concurrency, args.max_tokens, args.duration_s, args.warmup_s)
    argv = [
        sys.executable, "-m", "benchmarks.stack_bench_load", side, address,
        json.dumps(asdict(shape)), args.client_priority,
    ]  # fmt: skip
    if side == "engine":
        argv.append(json.dumps(prompt_ids))
    # In a thread, as the probe (see _prober); in a session (and autogroup) of its own.
    process = await asyncio.to_thread(
        subprocess.Popen, argv, stdout=subprocess.PIPE, start_new_session=True
    )
    probing = None
    try:
        line = await asyncio.to_thread(process.stdout.readline)
        if not line:
            raise RuntimeError(
                f"the {side} load generator ended before its window (exit status "
                f"{await asyncio.to_thread(process.wait)}; its error is above)"
            )
        head = json.loads(line)
        start, end = head["window"]
        cpu = _cpu_sampler({**pids, "bench client": process.pid})
        probing = asyncio.ensure_future(probe(start, end)) if probe else None
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        before = cpu()
        at_edge()
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        after = cpu()
        at_edge()
        rest, _ = await asyncio.to_thread(process.communicate)
        if process.returncode != 0:
            raise RuntimeError(
                f"the {side} load generator failed (exit status {process.returncode}; its "
                "error is above)"
            )
        result = RunResult(**json.loads(rest.splitlines()[-1]))
        result.cpu_seconds = {name: after[name] - before[name] for name in after if name in before}
        if probing is not None:
            result.probe_ttfts_s = await probing
    finally:
        if process.poll() is None:  # this run failed or was interrupted: the load goes too
            process.kill()
            await asyncio.to_thread(process.wait)
        if probing is not None and not probing.done():
            probing.cancel()
    return result, head["priority"]


def _prober(target: str, address: str, prompt_ids: list[list[int]]):
    """A Probe: benchmarks/stack_bench_probe.py running next to the load (normal priority)."""

    async def probe(window_start: float, window_end: float) -> list[float]:
        to_wall = time.time() - time.monotonic()
        argv = [
            sys.executable, "-m", "benchmarks.stack_bench_probe", target, address,
            str(window_start + to_wall), str(window_end + to_wall), json.dumps(prompt_ids),
        ]  # fmt: skip
        # subprocess.run in a thread, not the event loop's subprocess support: uvloop's (libuv)
        # fork()s while this process's gRPC threads run, and that crashed it with SIGSEGV in
        # create_subprocess_exec (1 run in ~70 on a 2-vCPU VM, 1 in 10 on a GPU host).
        # subprocess uses vfork here, which runs no fork handlers (services/common/processes.py).
        process = await asyncio.to_thread(subprocess.run, argv, stdout=subprocess.PIPE)
        ttfts = json.loads(process.stdout) if process.returncode == 0 else []
        if not ttfts:  # said, not silent: the report's probe figures are then missing (nan)
            print(
                f"warning: the {target} probe got no first token in the window "
                f"(exit status {process.returncode})",
                file=sys.stderr,
            )
        return ttfts

    return probe


def _start_stack(args: argparse.Namespace):
    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig

    metrics_port, engine_metrics_port = free_port(), free_port()
    args.router_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    router_args = ["--log-level", "WARNING", "--metrics-port", str(metrics_port)]
    if args.stream_interval is not None:
        router_args += ["--stream-interval", str(args.stream_interval)]
    router_args += shlex.split(args.router_args)
    engine_args: tuple[str, ...] = ("--dtype", args.engine_dtype) if args.engine_dtype else ()
    if not args.synthetic_step_ms:  # the synthetic engine has no /metrics
        engine_args += ("--metrics-port", str(engine_metrics_port))
        args.engine_metrics = f"http://127.0.0.1:{engine_metrics_port}/metrics"
    config = StackConfig(
        model=args.model,
        port=0,
        router_args=tuple(router_args),
        engine_args=engine_args,
        log_dir=Path(tempfile.mkdtemp(prefix="stack-bench-")),
    )
    if args.synthetic_step_ms:
        from benchmarks.synthetic_engine import synthetic_engine_starter

        return Stack(config, engine_starter=synthetic_engine_starter(args.synthetic_step_ms))
    return Stack(config)


async def run(args: argparse.Namespace) -> dict:
    load_average = os.getloadavg()  # before anything of ours starts
    # What a started stack inherits (a running stack's CPUs are not this process's to say).
    stack_cpus = None if args.router else sorted(os.sched_getaffinity(0))
    stack = None
    if args.router:
        router, engine, tokenizer = args.router, args.engine, args.tokenizer
        pids = {name: _find_pid(a) for name, a in (("router", router), ("engine", engine))}
        pids["tokenizer"] = _find_pid(tokenizer)
        if args.router_pid:
            pids["router"] = args.router_pid
    else:
        stack = _start_stack(args).start()
        if args.client_cpus:
            _move_this_process(args.client_cpus)
        router, tokenizer = stack.router_address, stack.tokenizer_address
        engine = stack.engine_addresses[0]
        pids = {
            "router": stack.router.process.pid,
            "engine": stack.engines[0].process.pid,
            "tokenizer": stack.tokenizer.process.pid,
        }
    results: dict[str, RunResult] = {}
    priorities: dict[str, dict] = {}
    idle: dict[str, list[float]] = {}
    phases = FirstTokenPhases(args.router_metrics) if args.router_metrics else None
    first_token_phases: dict[str, float | None] = {}
    try:
        prompt_ids = await _tokenize(tokenizer)
        sides = (("engine", "engine_alone", engine), ("router", "router", router))
        for side, name, address in sides:
            if args.only not in (None, side):
                continue
            batch = EngineBatch(args.engine_metrics) if args.engine_metrics else None

            def at_edge(side: str = side, batch: EngineBatch | None = batch) -> None:
                if batch is not None:
                    batch.snapshot()
                if side == "router" and phases is not None:
                    phases.snapshot()

            probe = _prober(side, address, prompt_ids) if args.probe else None
            results[name], priorities[name] = await _run_load(
                side, address, args, pids, prompt_ids, probe, at_edge
            )
            if batch is not None:
                results[name].engine_tokens_per_step = batch.tokens_per_step()
        if phases is not None:
            first_token_phases = phases.medians_ms()
        if args.only is None and args.idle_samples:
            idle["engine_alone"] = await engine_idle_ttft(engine, prompt_ids, args.idle_samples)
            idle["router"] = await router_idle_ttft(router, args.idle_samples)
    finally:
        if stack is not None:
            stack.stop()
    report: dict = {
        "model": f"synthetic ({args.synthetic_step_ms} ms steps)"
        if args.synthetic_step_ms
        else args.model,
        "engine_dtype": args.engine_dtype or "the engine's default",
        "stream_interval": "router default"
        if args.stream_interval is None
        else ("adaptive" if args.stream_interval == 0 else args.stream_interval),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "cpu_count": os.cpu_count(),
        "cpus": stack_cpus,
        "client_cpus": sorted(args.client_cpus) if args.client_cpus else None,
        "client_priority": args.client_priority,
        "client_priority_applied": priorities,  # per side: thread nice, autogroup nice
        "load_average_before": load_average,
    }
    for name, result in results.items():
        report[name] = result.summary()
    if first_token_phases:
        report["router"]["first_token_phase_median_ms"] = first_token_phases
    if args.hop_trace is not None and "router" in results:
        report["router"]["probe_hops"] = hop_report.report(args.hop_trace)
    if len(results) == 2:
        engine_side, router_side = report["engine_alone"], report["router"]
        report["ratio_router_to_engine"] = (
            router_side["tokens_per_s"] / engine_side["tokens_per_s"]
            if engine_side["tokens_per_s"]
            else None
        )
        report["added_ttft_median_ms_under_load"] = (
            router_side["ttft_median_ms"] - engine_side["ttft_median_ms"]
        )
        report["added_probe_ttft_median_ms_under_load"] = (
            router_side["probe_ttft_median_ms"] - engine_side["probe_ttft_median_ms"]
        )
    if idle:
        report["idle_ttft_median_ms"] = {k: percentile(v, 0.5) * 1e3 for k, v in idle.items()}
        report["added_ttft_median_ms_idle"] = (
            report["idle_ttft_median_ms"]["router"] - report["idle_ttft_median_ms"]["engine_alone"]
        )
    return report


def _print(report: dict) -> None:
    print(
        f"model {report['model']}, {report['concurrency']} streams, max_tokens "
        f"{report['max_tokens']}, stream interval {report['stream_interval']}, "
        f"{report['duration_s']} s counted after {report['warmup_s']} s warm-up; "
        + (f"stack on {len(report['cpus'])} CPUs; " if report["cpus"] else "")
        + (f"clients on {len(report['client_cpus'])} CPUs; " if report["client_cpus"] else "")
        + f"load generator at {report['client_priority']} priority; "
        + f"load average before {report['load_average_before'][0]:.2f}"
    )
    for key, label in (("engine_alone", "engine alone"), ("router", "router")):
        if key not in report:
            continue
        side = report[key]
        per_response = side["tokens_per_response"] or 0.0
        print(
            f"{label:>13}: {side['tokens_per_s']:9.0f} tokens/s ({side['tokens']} tokens, "
            f"{side['requests']} requests, {per_response:.2f} tokens/response), TTFT median "
            f"{side['ttft_median_ms']:.1f} ms, p90 {side['ttft_p90_ms']:.1f} ms"
            + (
                f", engine batch {side['engine_tokens_per_step']:.1f} tokens/step"
                if side["engine_tokens_per_step"]
                else ""
            )
        )
        cpu = ", ".join(
            f"{name} {us:.1f} ({side['cpu_cores'][name]:.2f} cores)"
            for name, us in side["cpu_us_per_token"].items()
        )
        print(f"{'':>15}CPU us/token: {cpu}")
        if side["probe_samples"]:
            print(
                f"{'':>15}probe TTFT under this load (separate process, {side['probe_samples']} "
                f"requests): median {side['probe_ttft_median_ms']:.1f} ms, p90 "
                f"{side['probe_ttft_p90_ms']:.1f} ms"
            )
        if side.get("first_token_phase_median_ms"):
            phases = ", ".join(
                f"{phase} {'-' if ms is None else f'{ms:.1f}'}"
                for phase, ms in side["first_token_phase_median_ms"].items()
            )
            print(f"{'':>15}router's first-token phases (medians, ms): {phases}")
    if report.get("ratio_router_to_engine") is not None:
        print(f"ratio router / engine alone: {report['ratio_router_to_engine']:.3f}")
        print(
            f"added median TTFT under load: {report['added_ttft_median_ms_under_load']:.1f} ms "
            f"(load streams), {report['added_probe_ttft_median_ms_under_load']:.1f} ms (probe)"
        )
    hops = report.get("router", {}).get("probe_hops")
    if hops and hops["requests"]:
        print("router probe: " + hop_report.format_summary(hops))
    if "idle_ttft_median_ms" in report:
        idle = report["idle_ttft_median_ms"]
        print(
            f"idle median TTFT (one request at a time): engine alone "
            f"{idle['engine_alone']:.2f} ms, router {idle['router']:.2f} ms, added "
            f"{report['added_ttft_median_ms_idle']:.2f} ms"
        )


def _move_this_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (and so what it starts from now on)."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(thread), cpus)


def cpu_list(text: str) -> set[int]:
    """CPU numbers as taskset writes them: '0,1', '0-3', '0-3,8'."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list (e.g. 0,1 or 0-3): {text!r}") from None
    return cpus


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stack_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="dummy:tiny", help="engine model (default dummy:tiny)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds counted per run")
    parser.add_argument(
        "--warmup-s", type=float, default=1.0, help="seconds of load before counting starts"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--router", help="router address of a running stack (else start one)")
    parser.add_argument("--engine", help="engine address of that stack")
    parser.add_argument("--tokenizer", help="tokenizer address of that stack")
    parser.add_argument("--router-pid", type=int, help="router process id (for CPU accounting)")
    parser.add_argument(
        "--router-metrics",
        help="that router's Prometheus URL (e.g. http://127.0.0.1:9090/metrics), for its "
        "first-token phases; a started stack's is used by default",
    )
    parser.add_argument(
        "--engine-metrics",
        help="that engine's Prometheus URL, for its mean batch in the window; a started "
        "stack's is used by default",
    )
    parser.add_argument(
        "--idle-samples", type=int, default=100, help="requests for the idle TTFT comparison"
    )
    parser.add_argument(
        "--only", choices=("router", "engine"), help="run one side only (for profiling)"
    )
    parser.add_argument(
        "--synthetic-step-ms",
        type=float,
        help="replace the engine by a model-free one stepping every this many ms",
    )
    parser.add_argument(
        "--engine-dtype", help="the started engine's --dtype (e.g. bfloat16; default: its own)"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        help="the started router's --stream-interval (tokens per response; 0: adapted to the "
        "load; default: the router's own default, adaptive)",
    )
    parser.add_argument(
        "--router-args",
        default="",
        help="more flags for the started router, e.g. '--stream-message-budget 1500'",
    )
    parser.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="skip the latency probe (benchmarks/stack_bench_probe.py) next to each load",
    )
    parser.add_argument(
        "--cpus",
        type=cpu_list,
        help="run on these CPUs only, e.g. '0,1' or '0-3' (this process and every one it "
        "starts; default: all this process may use)",
    )
    parser.add_argument(
        "--client-cpus",
        type=cpu_list,
        help="once the stack runs, move this bench client and its probe to these CPUs "
        "(e.g. with --cpus 0,1: '2,3'), so only the stack runs on --cpus",
    )
    parser.add_argument(
        "--client-priority",
        choices=PRIORITIES,
        default="low",
        help="CPU priority of the load generator, a process of its own on both sides "
        "(benchmarks/stack_bench_load.py): low (default) runs it at nice 19 in its own session, "
        "so on a small machine it takes only what the stack leaves, as a client on another "
        "machine would; normal runs it at the stack's priority. The probe stays normal.",
    )
    parser.add_argument(
        "--hop-trace",
        type=Path,
        metavar="DIR",
        help="trace each router probe's first token hop by hop (OpenTelemetry spans, "
        "services/common/tracing/) into this new or empty directory, and report where its "
        "time went (needs the tracing extra)",
    )
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.hop_trace is not None:
        if args.router or not args.probe:
            parser.error("--hop-trace needs a stack this bench starts and its probe")
        if args.hop_trace.exists() and any(args.hop_trace.iterdir()):
            parser.error(f"--hop-trace: {args.hop_trace} is not empty")
        args.hop_trace.mkdir(parents=True, exist_ok=True)
        # Read at start by every process the bench starts: the stack and the probes. The
        # stack traces only the calls that come traced (the probes'), not the load's; the hop
        # spans of the sessions record every request's first token.
        os.environ["SLUICE_TRACE_DIR"] = str(args.hop_trace.resolve())
        os.environ["SLUICE_TRACE_SAMPLE_RATIO"] = "0"
    if args.client_cpus and args.router:
        parser.error("--client-cpus needs a stack this bench starts (no --router)")
    if args.router and not (args.engine and args.tokenizer):
        parser.error("--router needs --engine and --tokenizer")
    if args.concurrency < 1 or args.max_tokens < 1 or args.duration_s <= 0 or args.warmup_s < 0:
        parser.error("concurrency, max-tokens and duration-s must be positive, warmup-s >= 0")
    if not faulthandler.is_enabled():  # a crash of this client says where it happened
        with contextlib.suppress(OSError, ValueError):  # no real stderr (captured in a test)
            faulthandler.enable()
    allowed = os.sched_getaffinity(0)
    if args.cpus:  # before anything starts: the stack's processes and the probe inherit it
        try:
            os.sched_setaffinity(0, args.cpus)
        except OSError as exc:
            parser.error(f"--cpus: cannot run on CPUs {sorted(args.cpus)}: {exc.strerror}")
    # As the services do (GIL hand-offs from gRPC's poller thread); the same for both sides.
    sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)
    try:
        report = event_loop.run(run(args))
    finally:
        if args.cpus or args.client_cpus:  # a caller in this process (a test) keeps its CPUs
            _move_this_process(allowed)
    _print(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
