"""Fault benchmark: kill each kind of child of a running stack under steady load.

    python -m benchmarks.faults --out benchmarks/results/faults-cpu.json
    python -m benchmarks.faults --no-ray --rate 8 --phase-s 15

Starts the default stack in this process (Ray engines unless --no-ray, a private persistent
redis-server, API keys required), makes an API key with `sluice keys add`, then runs one load
phase per fault with the harness's own runner (`sluice bench`'s client, constant arrivals, the
key on every request). `--kill-at-s` into each phase it does the fault: kill -9 of the engine
(the Ray actor's process under Ray), the tokenizer, the router, the redis-server, and SIGSTOP of
redis-server for `--redis-stop-s`. For each it reports
- the failed requests and their status codes (only those in flight on the dead process should
  fail, with UNAVAILABLE);
- `recovered_after_s`: from the fault to the send time of the first request from which on every
  request succeeded (0 when nothing sent after the fault failed);
- `served_again_after_s`: from the fault to the first token of the first request sent after it
  that succeeded (the router holds new requests while a peer restarts, so this is how long new
  requests waited);
- that no state was lost: the key made before still authenticates afterwards, and every engine's
  KV blocks are all free again once the load has drained.
The stack's supervisor (services/supervisor.py) runs in a thread here, as `sluice up` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from loadtest.arrivals import arrival_times
from loadtest.datasets import DatasetOptions, build_requests
from loadtest.records import RequestRecord
from loadtest.runner import run
from loadtest.schedule import ClientOptions
from protos.sluice.v1 import engine_pb2, engine_pb2_grpc
from services.client import SluiceClient
from services.launcher import Stack, StackConfig
from services.supervisor import CrashLoopError

FAULTS = ("engine", "tokenizer", "router", "redis-kill", "redis-stop")


@dataclass(frozen=True)
class FaultRun:
    """What one phase measured."""

    fault: str
    requests: int
    failed: int
    failed_by_status: dict[str, int]
    recovered_after_s: float | None  # None: failures never stopped before the phase ended
    served_again_after_s: float | None  # first token of a request sent after the fault
    key_still_valid: bool
    kv_idle_after: bool
    supervisor_restarts: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="dummy:tiny", help="model (default: %(default)s)")
    parser.add_argument("--no-ray", action="store_true", help="engines as plain processes")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s (default: 8)")
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of load per fault")
    parser.add_argument("--kill-at-s", type=float, default=5.0, help="fault this far into it")
    parser.add_argument("--redis-stop-s", type=float, default=8.0, help="SIGSTOP duration")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    if not 0 < args.kill_at_s < args.phase_s:
        parser.error("--kill-at-s must be inside the phase")
    return args


def cpu_name() -> str:
    """This machine's CPU model and core count, as the report names the device."""
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{model}, {os.cpu_count()} cores"


def make_key(redis_url: str) -> str:
    """A new API key via `sluice keys add`, as an operator makes one."""
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "keys", "add", "--name", "faults"],
        env={**os.environ, "SLUICE_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return result.stdout.strip().splitlines()[-1]


def key_works(address: str, key: str, wait_s: float = 10.0) -> bool:
    """Whether a request with `key` succeeds within `wait_s` (routers reload keys every 2 s)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with SluiceClient(address, api_key=key, timeout_s=30.0) as client:
                return client.complete("Hi", max_tokens=2, temperature=0.0).completion_tokens > 0
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def engine_addresses(stack: Stack) -> list[str]:
    if stack.ray_cluster is not None:
        return [engine["address"] for engine in stack.ray_cluster.describe_engines()]
    return [engine.address for engine in stack.engines]


def kv_idle(stack: Stack, wait_s: float = 30.0) -> bool:
    """Whether every engine's KV blocks are all free (and nothing runs) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        loads = []
        for address in engine_addresses(stack):
            with grpc.insecure_channel(address) as channel:
                try:
                    info = engine_pb2_grpc.EngineStub(channel).Info(
                        engine_pb2.EngineInfoRequest(), timeout=5
                    )
                except grpc.RpcError:
                    loads = []
                    break
                loads.append(info.load)
        if loads and all(
            load.free_blocks == load.total_blocks and not load.running and not load.waiting
            for load in loads
        ):
            return True
        time.sleep(0.5)
    return False


def fault_pid(stack: Stack, fault: str) -> int:
    if fault == "engine":
        if stack.ray_cluster is not None:
            return int(stack.ray_cluster.describe_engines()[0]["pid"])
        return stack.engines[0].process.pid
    if fault == "tokenizer":
        return stack.tokenizer.process.pid
    if fault == "router":
        return stack.router.process.pid
    assert stack.redis_server is not None
    return stack.redis_server.pid


def do_fault(stack: Stack, fault: str, redis_stop_s: float) -> None:
    pid = fault_pid(stack, fault)
    if fault == "redis-stop":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(redis_stop_s)
        os.kill(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGKILL)


def recovered_after_s(records: list[RequestRecord], fault_s: float) -> float | None:
    """From the fault to the send time of the first request after which all succeeded."""
    after = sorted(
        (r for r in records if r.sent_s is not None and r.sent_s >= fault_s),
        key=lambda r: r.sent_s,
    )
    failed = [i for i, record in enumerate(after) if record.status != "OK"]
    if not failed:
        return 0.0
    if failed[-1] + 1 >= len(after):
        return None
    return after[failed[-1] + 1].sent_s - fault_s


def served_again_after_s(records: list[RequestRecord], fault_s: float) -> float | None:
    """From the fault to the first token of the first request sent after it that succeeded:
    how long the service was out for new requests (held requests count once served)."""
    served = [
        r.chunk_times_s[0]
        for r in records
        if r.sent_s is not None and r.sent_s >= fault_s and r.status == "OK" and r.chunk_times_s
    ]
    return min(served) - fault_s if served else None


def run_phase(stack: Stack, key: str, fault: str, args: argparse.Namespace) -> FaultRun:
    times = arrival_times("constant", args.rate, duration_s=args.phase_s)
    options = DatasetOptions(
        input_mean=args.input_tokens, output_mean=args.output_tokens, seed=len(fault)
    )
    specs = build_requests(options, len(times))
    client = ClientOptions(target=stack.router_address, api_key=key, timeout_s=60.0)
    started = threading.Event()
    start_epoch = [0.0]
    result: list[Any] = []

    def on_start(epoch_s: float) -> None:
        start_epoch[0] = epoch_s
        started.set()

    loader = threading.Thread(
        target=lambda: result.append(run(specs, times, client, on_start=on_start, emit=print)),
        daemon=True,
    )
    loader.start()
    started.wait(60)
    time.sleep(max(start_epoch[0] + args.kill_at_s - time.time(), 0.0))
    fault_s = time.time() - start_epoch[0]
    do_fault(stack, fault, args.redis_stop_s)
    loader.join()
    records = result[0].records
    failed = [r for r in records if r.status != "OK"]
    return FaultRun(
        fault=fault,
        requests=len(records),
        failed=len(failed),
        failed_by_status=dict(Counter(r.status for r in failed)),
        recovered_after_s=recovered_after_s(records, fault_s),
        served_again_after_s=served_again_after_s(records, fault_s),
        key_still_valid=key_works(stack.router_address, key, wait_s=0),
        kv_idle_after=kv_idle(stack),
        supervisor_restarts=0,
    )


def supervise(stack: Stack, stop: threading.Event, errors: list[str]) -> Any:
    supervisor = stack.supervisor(lambda line: print(line, file=sys.stderr, flush=True))

    def loop() -> None:
        while not stop.wait(0.2):
            try:
                supervisor.poll()
            except CrashLoopError as exc:
                errors.append(exc.message)
                return

    threading.Thread(target=loop, daemon=True).start()
    return supervisor


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="sluice-faults-"))
    config = StackConfig(
        model=args.model,
        port=0,
        ray=not args.no_ray,
        shared_state=True,
        redis_data_dir=work / "redis",
        router_args=("--redis-api-keys",),
        engine_args=("--kv-cache-bytes", str(64 * 1024 * 1024)),
        log_dir=work / "logs",
    )
    stop, errors = threading.Event(), []
    runs: list[FaultRun] = []
    with Stack(config) as stack:
        supervisor = supervise(stack, stop, errors)
        assert stack.redis_url is not None
        key = make_key(stack.redis_url)
        if not key_works(stack.router_address, key):
            raise SystemExit("faults: the new API key was never accepted")
        for fault in args.faults.split(","):
            print(f"faults: {fault} at {args.kill_at_s:g} s of a {args.phase_s:g} s phase")
            phase = run_phase(stack, key, fault, args)
            name = {"redis-kill": "redis-server", "redis-stop": "redis-server"}.get(fault, fault)
            name = "engine-0" if name == "engine" else name
            restarts = supervisor.restarts(name) if name in supervisor.names() else 0
            runs.append(FaultRun(**{**phase.to_json(), "supervisor_restarts": restarts}))
            print(json.dumps(runs[-1].to_json()))
        stop.set()
    report = {
        "device": cpu_name(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python -m benchmarks.faults " + " ".join(argv or sys.argv[1:]),
        "stack": "ray" if not args.no_ray else "processes",
        "rate_req_s": args.rate,
        "phase_s": args.phase_s,
        "kill_at_s": args.kill_at_s,
        "stack_stopped_itself": bool(errors),
        "faults": [run.to_json() for run in runs],
    }
    header = ("fault", "requests", "failed", "recovered s", "served again s", "key ok", "kv idle")
    print("{:<12} {:>8} {:>6} {:>11} {:>14} {:>6} {:>7}".format(*header))
    for run_ in runs:
        recovered = "never" if run_.recovered_after_s is None else f"{run_.recovered_after_s:.2f}"
        served = (
            "never" if run_.served_again_after_s is None else f"{run_.served_again_after_s:.2f}"
        )
        print(
            f"{run_.fault:<12} {run_.requests:>8} {run_.failed:>6} {recovered:>11} {served:>14} "
            f"{str(run_.key_still_valid):>6} {str(run_.kv_idle_after):>7}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
