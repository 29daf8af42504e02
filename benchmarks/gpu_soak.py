"""Varied traffic through one stack: every request ends as its client expects, none takes the
stack down, and the engine ends with every KV block free.

    python -m benchmarks.gpu_soak                            # a machine with an NVIDIA GPU
    python -m benchmarks.gpu_soak --model "" --device cpu --scale 0.1   # the default model, on CPU

The stack is `sluice up --no-ray --no-redis` (a Stack in this process) with four random PEFT
adapters of different ranks and projections on two device slots, so slots change hands all the
time. In order:

1. Requests one at a time, each checked against an earlier answer to the same prompt on the
   same stack: a request alone replays the same kernels, so its tokens repeat. The prompt's
   blocks are in the prefix cache for every answer compared (the first answer, which computes
   the whole prompt, may round differently in bf16; where it parts from the cached answers is
   noted in the report). Greedy tokens repeat; a stop token id ends the answer at its first
   occurrence; a stop string ends the text where it first occurs; a seed repeats its sampled
   tokens; top_k=1 gives the same tokens whatever the seed; penalties and min_p with a seed
   repeat; min_tokens holds a stop token back; logprobs come sorted, the greedy token the best;
   a chat request answers; each adapter's greedy tokens repeat after the other adapters have
   taken its slot.
2. Bad requests (a prompt past the context, an unknown adapter, out-of-range sampling values, a
   token id outside the vocabulary): each refused with INVALID_ARGUMENT or NOT_FOUND.
3. Load through the harness (`sluice bench` in a child process, as a user runs it): long
   prompts of varied length with sampling, a third of them cancelled mid-stream, over the
   adapters and the base model; shared prefixes (the prefix cache) under a Zipf adapter mix;
   a burst past saturation. The only ends allowed besides a finished answer: CANCELLED for
   what the harness cancelled, RESOURCE_EXHAUSTED (the router's admission bound); in the
   burst the admitted requests' TTFT p99 stays within that bound (3 s) plus a second.
4. Quiet again: no sequence running or waiting, every KV block free (cached prefix blocks count
   as free: they are evictable), and the base model's and an adapter's greedy answers still
   those of part 1.

Prints each check and writes a JSON report; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import lora_stack_adapters as adapters_side

ADAPTERS = (  # prefix, rank, projections
    ("qv-r8", 8, ("q_proj", "v_proj")),
    ("all-r16", 16, adapters_side.MODULES),
    ("mlp-r64", 64, ("gate_proj", "up_proj", "down_proj")),
    ("ko-r32", 32, ("k_proj", "o_proj")),
)
# The ends of a request under load besides OK: cancelled by the harness (--cancel-rate), refused
# by the router's admission bound (the queue could not start it in time).
ALLOWED_LOAD_ERRORS = {"CANCELLED", "RESOURCE_EXHAUSTED"}
# The router's --max-queue-delay-s: past saturation (the burst) the requests it admits should
# see their first token within about this (p99 within it plus a second).
QUEUE_DELAY_S = 3.0
VOCAB_LIMIT = 10_000


class Checks:
    """Named pass/fail results, printed as they come."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}{f': {detail}' if detail else ''}", flush=True)
        return bool(ok)

    def guarded(self, name: str, body: Callable[[], tuple[bool, Any]]) -> None:
        """Run `body` (returning ok, detail) and record it; an exception is a failure."""
        try:
            ok, detail = body()
        except Exception as error:  # a crashed check is a failed one, the soak goes on
            ok, detail = False, f"{type(error).__name__}: {error}"
        self.add(name, ok, detail)

    @property
    def failed(self) -> list[str]:
        return [r["check"] for r in self.results if not r["ok"]]


def prompt_ids(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, VOCAB_LIMIT, length).tolist()


# ---- 1. one at a time ---------------------------------------------------------------------------
def quiet_checks(
    client: Any, names: list[str], checks: Checks, notes: dict[str, Any]
) -> dict[str, list[int]]:
    """The checks of part 1; returns each model's cached greedy answer to the reference prompt
    (the base model's under "")."""
    prompt = prompt_ids(1, 96)
    greedy = {"token_ids": prompt, "temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    references: dict[str, list[int]] = {}
    cold = client.complete(**greedy)  # fills the prefix cache: every answer below hits it
    reference = client.complete(**greedy)
    tokens = references[""] = reference.token_ids
    notes["base: whole prompt against cached"] = _first_difference(cold.token_ids, tokens)
    checks.add("greedy answer has max_tokens tokens", len(tokens) == 48, reference.finish_reason)
    again = client.complete(**greedy).token_ids
    checks.add("greedy tokens repeat", again == tokens, _first_difference(again, tokens))

    def stop_token() -> tuple[bool, Any]:
        position = len(tokens) // 2
        stop = tokens[position]
        first = tokens.index(stop)
        got = client.complete(**greedy, stop_token_ids=[stop])
        ok = got.finish_reason == "stop" and got.token_ids in (tokens[:first], tokens[: first + 1])
        return ok, f"stop id at {first}: {len(got.token_ids)} tokens, {got.finish_reason}"

    checks.guarded("a stop token id ends the answer at its first occurrence", stop_token)

    def stop_string() -> tuple[bool, Any]:
        text = reference.text
        stop = text[len(text) // 2 : len(text) // 2 + 6]
        if not stop.strip():
            return True, "no printable text to cut (skipped)"
        got = client.complete(**greedy, stop=[stop])
        cut = text[: text.index(stop)]
        ok = got.finish_reason == "stop_string" and got.text == cut and got.matched_stop == stop
        return ok, f"{got.finish_reason}, {len(got.text)} of {len(cut)} characters"

    checks.guarded("a stop string ends the text where it first occurs", stop_string)

    sampled = {"token_ids": prompt, "temperature": 0.9, "top_p": 0.95, "max_tokens": 32}
    sampled["ignore_eos"] = True

    def seeded() -> tuple[bool, Any]:
        first = client.complete(**sampled, seed=1234).token_ids
        second = client.complete(**sampled, seed=1234).token_ids
        other = client.complete(**sampled, seed=4321).token_ids
        return first == second and len(first) == 32, f"another seed differs: {first != other}"

    checks.guarded("a seed repeats its sampled tokens", seeded)

    def top_k_one() -> tuple[bool, Any]:
        runs = [
            client.complete(token_ids=prompt, temperature=1.0, top_k=1, max_tokens=24, seed=s)
            for s in (1, 2, 3)
        ]
        same = all(run.token_ids == runs[0].token_ids for run in runs)
        return same and len(runs[0].token_ids) > 0, f"{len(runs[0].token_ids)} tokens"

    checks.guarded("top_k=1 gives the same tokens whatever the seed", top_k_one)

    def penalties() -> tuple[bool, Any]:
        params = {**sampled, "repetition_penalty": 1.3, "presence_penalty": 0.5}
        params.update(frequency_penalty=0.5, min_p=0.05, seed=7)
        first, second = client.complete(**params), client.complete(**params)
        return first.token_ids == second.token_ids and len(first.token_ids) == 32, ""

    checks.guarded("penalties and min_p with a seed repeat their tokens", penalties)

    def min_tokens() -> tuple[bool, Any]:
        stop = tokens[0]
        got = client.complete(
            token_ids=prompt, temperature=0.0, max_tokens=8, min_tokens=8, stop_token_ids=[stop]
        )
        ok = len(got.token_ids) == 8 and stop not in got.token_ids
        return ok, f"{len(got.token_ids)} tokens, {got.finish_reason}"

    checks.guarded("min_tokens holds a stop token back", min_tokens)

    def logprobs() -> tuple[bool, Any]:
        responses = list(client.generate(**{**greedy, "max_tokens": 12}, logprobs=3))
        entries = [entry for response in responses for entry in response.logprobs]
        ok = len(entries) == 12
        for entry in entries:
            top = [t.logprob for t in entry.top]
            ok &= len(top) == 3 and top == sorted(top, reverse=True) and entry.logprob <= 1e-6
            ok &= abs(entry.logprob - top[0]) < 1e-3  # greedy: the chosen token is the best
        return ok, f"{len(entries)} tokens with logprobs"

    checks.guarded("logprobs sorted, the greedy token the best", logprobs)

    def chat() -> tuple[bool, Any]:
        got = client.complete(
            chat=[("system", "Answer briefly."), ("user", "Name three rivers.")],
            max_tokens=16,
            temperature=0.0,
        )
        ok = got.prompt_tokens > 0 and 0 < got.completion_tokens <= 16
        return ok, f"{got.prompt_tokens} prompt tokens, {got.finish_reason}"

    checks.guarded("a chat request answers", chat)

    def each_adapter() -> tuple[bool, Any]:
        for name in names:  # two slots for four adapters: each is evicted before its turn below
            cold = client.complete(**greedy, adapter=name).token_ids
            references[name] = client.complete(**greedy, adapter=name).token_ids
            notes[f"{name}: whole prompt against cached"] = _first_difference(
                cold, references[name]
            )
        detail = {}
        for name in names:
            again = client.complete(**greedy, adapter=name).token_ids
            same = again == references[name] and len(again) == 48
            detail[name] = _first_difference(again, references[name]) or (
                f"repeats; {'differs from' if again != tokens else 'same as'} the base model"
            )
            if not same:
                return False, detail
        return True, detail

    checks.guarded("each adapter's greedy tokens repeat after its slot is reloaded", each_adapter)
    return references


def _first_difference(a: list[int], b: list[int]) -> str:
    if a == b:
        return ""
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return f"first difference at {min(len(a), len(b)) if index is None else index}"


# ---- 2. bad requests ----------------------------------------------------------------------------
def bad_requests(client: Any, context: int, vocab: int, checks: Checks) -> None:
    import grpc

    cases = {
        "a prompt past the context": ({"token_ids": prompt_ids(2, context)}, "INVALID_ARGUMENT"),
        "prompt + max_tokens past the context": (
            {"token_ids": prompt_ids(3, context - 4), "max_tokens": 64},
            "INVALID_ARGUMENT",
        ),
        "an unknown adapter": ({"prompt": "hi", "adapter": "no-such-adapter"}, "NOT_FOUND"),
        "a negative temperature": ({"prompt": "hi", "temperature": -1.0}, "INVALID_ARGUMENT"),
        "top_p over 1": ({"prompt": "hi", "top_p": 1.5}, "INVALID_ARGUMENT"),
        "a token id outside the vocabulary": ({"token_ids": [1, vocab + 5]}, "INVALID_ARGUMENT"),
        "min_tokens over max_tokens": (
            {"prompt": "hi", "min_tokens": 9, "max_tokens": 4},
            "INVALID_ARGUMENT",
        ),
    }
    for label, (kwargs, expected) in cases.items():
        try:
            client.complete(**kwargs)
            got = "OK"
        except grpc.RpcError as error:
            got = error.code().name
        checks.add(f"refused: {label}", got == expected, f"{got} (expected {expected})")


# ---- 3. load through the harness ----------------------------------------------------------------
def bench_phases(scale: float, names: list[str], context: int) -> dict[str, list[str]]:
    """Each phase's `sluice bench` flags."""

    def count(n: int) -> str:
        return str(max(8, int(n * scale)))

    longest = max(64, context - 160)
    long_mean = min(2500, longest // 3)
    return {
        "long-prompts-sampled-cancelled": [
            "--rate", str(max(1.0, 6 * scale)), "--num-requests", count(150),
            "--input-mean", str(long_mean), "--input-stdev", str(long_mean // 2),
            "--output-mean", "96", "--output-stdev", "48", "--temperature", "0.8",
            "--cancel-rate", "0.3", "--adapters", ",".join(names),
        ],
        "shared-prefix-zipf-adapters": [
            "--rate", str(max(1.0, 20 * scale)), "--num-requests", count(240),
            "--dataset", "shared-prefix", "--num-prefix-groups", "6",
            "--prefix-len", str(min(1024, longest // 4)), "--input-mean", "128",
            "--output-mean", "64", "--adapters", ",".join(names), "--adapter-dist", "zipf",
        ],
        "burst": [
            "--rate", str(max(4.0, 400 * scale)), "--num-requests", count(600),
            "--input-mean", "512", "--input-stdev", "256", "--output-mean", "128",
        ],
    }  # fmt: skip


def run_bench(
    target: str, path: Path, flags: list[str], timeout_s: float | None = None
) -> tuple[dict[str, Any] | None, float, int, str]:
    """`sluice bench` in a child process, its report written to `path`: (the report, None if it
    wrote none; seconds taken; the child's exit status; the tail of its stderr)."""
    command = [sys.executable, "-m", "loadtest", "--target", target, "--out", str(path)]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--no-progress", *flags], capture_output=True, text=True, timeout=timeout_s
    )
    seconds = round(time.perf_counter() - started, 1)
    if not path.exists():
        return None, seconds, done.returncode, done.stderr[-2000:]
    return json.loads(path.read_text()), seconds, done.returncode, ""


def load_checks(
    target: str, names: list[str], context: int, scale: float, out_dir: Path, checks: Checks
) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    for name, flags in bench_phases(scale, names, context).items():
        path = out_dir / f"{name}.json"
        flags = ["--timeout-s", "120", *flags]
        report, seconds, code, stderr = run_bench(target, path, flags, timeout_s=600)
        if report is None:
            checks.add(f"load: {name} ran", False, f"exit {code}: {stderr}")
            continue
        details, summary = report["details"], report["summary"]
        errors = details["errors"]
        phases[name] = {
            "seconds": seconds,
            "requests": details["num_requests"],
            "completed": details["completed"],
            "errors": errors,
            "cancelled_by_harness": details["cancelled_by_harness"],
            "output_tok_s": round(summary["output_token_throughput"], 1),
            "ttft_ms_p50_p99": [summary["ttft_ms"].get("p50"), summary["ttft_ms"].get("p99")],
        }
        unexpected = {code: n for code, n in errors.items() if code not in ALLOWED_LOAD_ERRORS}
        cancelled = errors.get("CANCELLED", 0)
        ok = not unexpected and cancelled <= details["cancelled_by_harness"]
        ok &= details["completed"] > 0
        checks.add(
            f"load: {name}",
            ok,
            f"{details['completed']} of {details['num_requests']} completed, errors {errors}",
        )
        p99_ms = summary["ttft_ms"].get("p99")
        if name == "burst" and p99_ms is not None:
            checks.add(
                "load: burst: the admitted start within the queue-delay bound",
                p99_ms <= (QUEUE_DELAY_S + 1.0) * 1000.0,
                f"TTFT p99 {p99_ms / 1000:.2f} s (bound {QUEUE_DELAY_S:g} s + 1 s)",
            )
    return phases


# ---- 4. quiet again -----------------------------------------------------------------------------
def wait_idle(addresses: list[str], timeout_s: float = 60.0) -> list[Any]:
    """Each engine's load once none runs or waits (or after timeout_s)."""
    from services.launcher import engine_info

    deadline = time.monotonic() + timeout_s
    while True:
        loads = [engine_info(address).load for address in addresses]
        if all(load.running == 0 and load.waiting == 0 for load in loads):
            return loads
        if time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


# ---- main ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default="dummy:llama-3-8b", help="model to serve ('': the default model)"
    )
    parser.add_argument("--device", default="cuda", help="the engine's device")
    parser.add_argument("--scale", type=float, default=1.0, help="request counts and rates x")
    parser.add_argument("--max-loras", type=int, default=2, help="device slots for adapters")
    parser.add_argument("--engine-args", default="", help="more `sluice serve engine` flags")
    parser.add_argument("--out", type=Path, default=Path("gpu-soak.json"), help="JSON report")
    return parser


def main(argv: list[str] | None = None) -> int:
    from services.client import SluiceClient
    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig, describe_engines

    args = build_parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gpu-soak-"))
    root = work / "adapters"
    names: list[str] = []
    for seed, (prefix, rank, modules) in enumerate(ADAPTERS):
        written = adapters_side.write_adapters(
            root, args.model, 1, rank, seed=seed, modules=modules, prefix=prefix
        )
        names.extend(written["names"])
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", "-m", "benchmarks.gpu_soak", *(sys.argv[1:] if argv is None else argv)]
        ),
        "model": args.model,
        "adapters": {name: spec[1:] for name, spec in zip(names, ADAPTERS, strict=True)},
    }
    engine_args = (
        "--device", args.device, "--adapter-root", str(root), "--max-loras",
        str(args.max_loras), "--max-cpu-loras", str(len(names)), "--max-lora-rank", "64",
        *args.engine_args.split(),
    )  # fmt: skip
    config = StackConfig(
        model=args.model or None, port=free_port(), engine_args=engine_args, log_dir=work / "logs",
        router_args=("--max-queue-delay-s", f"{QUEUE_DELAY_S:g}", "--log-level", "WARNING"),
        startup_timeout_s=400.0,
    )  # fmt: skip
    checks = Checks()
    started = time.perf_counter()
    stack = Stack(config).start()
    try:
        report["stack_start_s"] = round(time.perf_counter() - started, 1)
        report["engines"] = describe_engines(stack.engine_addresses)
        print("\n".join(report["engines"]), flush=True)
        target = stack.router_address
        adapters_side.register_adapters(target, names)
        with SluiceClient(target, timeout_s=120.0) as client:
            model = client.list_models()[0]
            report["device"] = _device_name(args.device)
            report["notes"] = notes = {}
            references = quiet_checks(client, names, checks, notes)
            bad_requests(client, model.context_length, model.vocab_size, checks)
            report["load"] = load_checks(
                target, names, model.context_length, args.scale, work, checks
            )
            loads = wait_idle(stack.engine_addresses)
            for address, load in zip(stack.engine_addresses, loads, strict=True):
                checks.add(
                    f"engine {address} idle with every KV block free",
                    load.running == 0
                    and load.waiting == 0
                    and load.free_blocks == load.total_blocks,
                    f"running {load.running}, waiting {load.waiting}, "
                    f"{load.free_blocks} of {load.total_blocks} blocks free",
                )
            greedy = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
            for name in ("", names[0]):
                ask = {"token_ids": prompt_ids(1, 96), "adapter": name or None, **greedy}
                client.complete(**ask)  # the load may have evicted the prompt's cached blocks
                after = client.complete(**ask).token_ids
                checks.add(
                    f"{name or 'the base model'}: the same greedy answer after the load",
                    after == references[name],
                    _first_difference(after, references[name]),
                )
    finally:
        stack.stop()
    report["checks"] = checks.results
    report["failed"] = checks.failed
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(checks.results) - len(checks.failed)} of {len(checks.results)} checks passed")
    return 1 if checks.failed else 0


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    from benchmarks.faults import cpu_name

    return cpu_name()


if __name__ == "__main__":
    raise SystemExit(main())
