"""The `sluice` command: generate, up, serve router|tokenizer|engine, bench.

Subcommands import their modules only when they run, so `sluice --help` stays fast (no torch,
no gRPC). `serve` and `bench` hand the rest of the command line to the service's own parser.

    sluice up                          # tokenizer + engine + router on 127.0.0.1:50051
    sluice generate "Hello"            # streams the answer from the router
    sluice generate --chat "What is the capital of France?"
    sluice serve engine --model dummy:tiny --port 50061
    sluice bench ...                   # the load-test harness (loadtest/)
    sluice keys add --name alice --redis-url redis://...   # API keys in Redis (add|list|revoke)
    sluice adapters add support-v1 support/v1              # LoRA adapters by name (add|list|remove)
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.processes import exit_with_parent

SERVICES = {
    "router": "services.router.server",
    "tokenizer": "services.tokenizer.server",
    "engine": "services.engine.server",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Sluice: serve Llama-family models over gRPC."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(commands)
    _add_up(commands)
    serve = commands.add_parser(
        "serve",
        help="run one service (router, tokenizer or engine) as a container would",
        description="Run one service; `sluice serve <service> --help` lists its flags.",
    )
    serve.add_argument("service", choices=sorted(SERVICES), help="which service to run")
    serve.add_argument("service_args", nargs=argparse.REMAINDER, help="the service's own flags")
    bench = commands.add_parser(
        "bench", help="the load-test harness (see `sluice bench --help`)", add_help=False
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    keys = commands.add_parser(
        "keys",
        help="manage API keys in Redis: add|list|revoke (see `sluice keys --help`)",
        add_help=False,
    )
    keys.add_argument("keys_args", nargs=argparse.REMAINDER)
    adapters = commands.add_parser(
        "adapters",
        help="register LoRA adapters with a router: add|list|remove (see `sluice adapters --help`)",
        add_help=False,
    )
    adapters.add_argument("adapters_args", nargs=argparse.REMAINDER)
    return parser


def _add_generate(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="stream an answer from a running router",
        description="Stream generated text to stdout. Values are sent as given; the server "
        "validates them. On error prints `error: <STATUS>: <message>` and exits 1.",
    )
    generate.add_argument("prompt", help="the prompt (or the user turn with --chat)")
    generate.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="router address host:port (default: %(default)s)",
    )
    generate.add_argument(
        "--chat", action="store_true", help="send the prompt as a user chat turn (chat template)"
    )
    generate.add_argument("--system", help="a system turn before the user turn (with --chat)")
    generate.add_argument("--max-tokens", type=int, help="most tokens to generate (server: 16)")
    generate.add_argument("--min-tokens", type=int, help="fewest tokens before EOS may stop")
    generate.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    generate.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    generate.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    generate.add_argument("--seed", type=int, help="seed for reproducible sampling")
    generate.add_argument(
        "--stop", action="append", help="stop string (repeatable); output is cut before it"
    )
    generate.add_argument("--adapter", help="LoRA adapter name")
    generate.add_argument("--api-key", help="API key, when the router requires one")
    generate.add_argument("--timeout-s", type=float, help="deadline of the call in seconds")


def _add_up(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser(
        "up",
        help="run the whole stack on this machine until Ctrl-C",
        description="Start tokenizer, engine(s) and router on loopback: engines as Ray actors "
        "(restarted on a crash; --no-ray: plain processes), shared state in Redis (--redis-url, "
        "else a private redis-server with a random password, else in memory). Prints the "
        "router address when ready, stops all cleanly on Ctrl-C/SIGTERM. Unknown flags are "
        "passed to the router (e.g. --shutdown-grace-s, --retry-after-s, --redis-api-keys to "
        "require keys made with `sluice keys add`).",
    )
    up.add_argument(
        "--no-ray", action="store_true", help="run engines as plain processes, not Ray actors"
    )
    up.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    up.add_argument(
        "--ray-dashboard", action="store_true", help="start the Ray dashboard (off by default)"
    )
    up.add_argument(
        "--engine-max-restarts", type=int, default=10, help="Ray restarts of a crashed engine"
    )
    up.add_argument("--redis-url", help="shared Redis (redis://, rediss://); default: private")
    up.add_argument(
        "--no-redis", action="store_true", help="no Redis: in-memory state, one router only"
    )
    up.add_argument("--port", type=int, default=50051, help="router port (default: %(default)s)")
    up.add_argument("--host", default="127.0.0.1", help="router address (default: %(default)s)")
    up.add_argument("--model", help="HF dir, .gguf file or dummy:<shape> (default: SmolLM2-135M)")
    up.add_argument(
        "--engines",
        type=int,
        help="engine workers (default: one per GPU, each pinned to its own, as Ray actors or "
        "with --no-ray as processes with their own CUDA_VISIBLE_DEVICES; 1 on CPU)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=9400,
        help="Prometheus /metrics: the launcher's own (child restarts) on this port, the "
        "router's on +1, engine i's on +2+i; 0 turns them off "
        "(default: %(default)s)",
    )
    up.add_argument(
        "--max-crashes",
        type=int,
        default=5,
        help="a child that crashes this often within --crash-window-s stops the stack; "
        "fewer crashes are restarted with backoff (default: %(default)s)",
    )
    up.add_argument(
        "--crash-window-s",
        type=float,
        default=60.0,
        help="the window of --max-crashes, in seconds (default: %(default)s)",
    )
    up.add_argument(
        "--tokenizers",
        type=int,
        default=1,
        help="tokenizer processes; the router spreads requests over them and keeps serving "
        "while one is down (default: %(default)s)",
    )
    up.add_argument("--api-keys-file", help="router: file with one API key per line")
    up.add_argument(
        "--http-port",
        type=int,
        help="router: serve the OpenAI-compatible HTTP API (/v1/...) on this port of --host "
        "(default: off)",
    )
    up.add_argument("--max-queued-requests", type=int, help="router: queue bound (requests)")
    up.add_argument("--max-queued-tokens", type=int, help="router: queue bound (prompt tokens)")
    up.add_argument("--kv-cache-bytes", type=int, help="engines: bytes of KV cache each")
    up.add_argument(
        "--max-num-seqs",
        type=int,
        help="engines: most sequences per step (default sized from the device: 384 on an H100)",
    )
    up.add_argument(
        "--target-step-ms",
        type=float,
        help="engines: step-time target in ms; chunked prefill keeps each step's predicted "
        "time within it, bounding time per output token under load (default: 0, off)",
    )
    up.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        help="engines: KV cache element type; fp8 (CUDA fast path) holds twice the tokens and "
        "halves each decode step's KV reads, rounding keys and values (default: auto, the "
        "model's dtype)",
    )
    up.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="engines: GPUs each engine splits the model over (default 1); one engine per "
        "that many GPUs",
    )
    up.add_argument("--device", help="engines: cpu, cuda, cuda:N or auto")
    up.add_argument(
        "--backend", help="engines: forward backend (torch, cuda, onnxruntime or tensorrt)"
    )
    up.add_argument(
        "--adapter-root",
        help="engines: directory that LoRA adapters registered with `sluice adapters add` must "
        "resolve under (default: none, no adapters)",
    )
    up.add_argument(
        "--engine-args",
        default="",
        help='more engine flags as one string, e.g. --engine-args="--max-model-len 4096"',
    )
    up.add_argument(
        "--startup-timeout-s",
        type=float,
        default=600.0,
        help="seconds to wait for every service to report SERVING (default: %(default)s)",
    )
    up.add_argument(
        "--stop-grace-s",
        type=float,
        default=30.0,
        help="seconds a stopping service gets before SIGKILL (default: %(default)s)",
    )


def _flag_pairs(namespace: argparse.Namespace, names: Sequence[str]) -> list[str]:
    argv: list[str] = []
    for name in names:
        value = getattr(namespace, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def run_up(namespace: argparse.Namespace, extra_router_args: Sequence[str]) -> int:
    from services.common.env import cache_dir
    from services.common.errors import SluiceError
    from services.common.gpus import visible_gpus
    from services.launcher import Stack, StackConfig, describe_engines, plan_engine_processes
    from services.supervisor import RestartPolicy

    router_args = _flag_pairs(
        namespace, ("api_keys_file", "max_queued_requests", "max_queued_tokens", "http_port")
    )
    if namespace.adapter_root:  # engines (Ray actors too) may run in another directory
        namespace.adapter_root = str(Path(namespace.adapter_root).expanduser().resolve())
    engine_args = _flag_pairs(
        namespace,
        (
            "kv_cache_bytes",
            "max_num_seqs",
            "target_step_ms",
            "kv_cache_dtype",
            "device",
            "backend",
            "adapter_root",
            "tensor_parallel_size",
        ),
    )
    try:
        engines, engine_gpus = 1 if namespace.engines is None else namespace.engines, ()
        if namespace.no_ray:  # Ray places one actor per GPU itself
            engines, engine_gpus = plan_engine_processes(
                namespace.engines,
                namespace.device,
                visible_gpus(),
                namespace.tensor_parallel_size or 1,
            )
        config = StackConfig(
            model=namespace.model,
            host=namespace.host,
            port=namespace.port,
            engines=engines,
            engine_gpus=engine_gpus,
            tokenizers=namespace.tokenizers,
            router_args=(*router_args, *extra_router_args),
            engine_args=(*engine_args, *shlex.split(namespace.engine_args)),
            startup_timeout_s=namespace.startup_timeout_s,
            stop_grace_s=namespace.stop_grace_s,
            ray=not namespace.no_ray,
            ray_cluster=_ray_config(namespace),
            shared_state=not namespace.no_redis,
            redis_url=namespace.redis_url,
            redis_data_dir=Path(cache_dir()) / "redis",
            restart_policy=RestartPolicy(
                max_crashes=namespace.max_crashes, crash_window_s=namespace.crash_window_s
            ),
            metrics_port=namespace.metrics_port or None,
        )
        stack = Stack(config)
        if namespace.no_redis and namespace.redis_url:
            print("error: --no-redis and --redis-url contradict", file=sys.stderr)
            return 2
        print("sluice: starting tokenizer, engine(s) and router ...", file=sys.stderr, flush=True)
        # SIGTERM during start-up stops the children started so far, like Ctrl-C does.
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            stack.start()
        finally:
            signal.signal(signal.SIGTERM, previous)
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    for line in describe_engines(stack.engine_addresses):  # which device and path each uses
        print(f"sluice: {line}", file=sys.stderr, flush=True)
    print(f"Sluice router ready at {stack.router_address}", flush=True)
    if namespace.http_port:
        url = f"http://{namespace.host}:{namespace.http_port}/v1"
        print(f"OpenAI-compatible HTTP at {url}", flush=True)
    return stack.run_until_signal(lambda line: print(line, file=sys.stderr, flush=True))


def _ray_config(namespace: argparse.Namespace) -> object | None:
    if namespace.no_ray:
        return None
    from services.ray_cluster import RayClusterConfig

    return RayClusterConfig(
        engines=namespace.engines,
        ray_address=namespace.ray_address,
        ray_dashboard=namespace.ray_dashboard,
        engine_max_restarts=namespace.engine_max_restarts,
        gpus_per_engine=namespace.tensor_parallel_size or 1,
    )


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_generate(namespace: argparse.Namespace) -> int:
    import grpc

    from services.client import SluiceClient

    request: dict = {
        "max_tokens": namespace.max_tokens,
        "min_tokens": namespace.min_tokens,
        "temperature": namespace.temperature,
        "top_p": namespace.top_p,
        "top_k": namespace.top_k,
        "seed": namespace.seed,
        "stop": namespace.stop,
        "adapter": namespace.adapter,
        "timeout_s": namespace.timeout_s,
    }
    if namespace.chat:
        turns = [("system", namespace.system)] if namespace.system else []
        request["chat"] = [*turns, ("user", namespace.prompt)]
    else:
        request["prompt"] = namespace.prompt
    try:
        with SluiceClient(namespace.target, api_key=namespace.api_key) as client:
            for response in client.generate(**request):
                if response.text:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
    except grpc.RpcError as error:
        sys.stdout.flush()
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as error:  # e.g. a value protobuf cannot hold
        print(f"error: INVALID_ARGUMENT: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    sys.stdout.write("\n")
    return 0


def run_serve(service: str, argv: Sequence[str]) -> int:
    module = importlib.import_module(SERVICES[service])
    result = module.main(list(argv))
    return int(result or 0)


def run_bench(argv: Sequence[str]) -> int:
    from loadtest.cli import main as bench_main

    result = bench_main(list(argv))
    return int(result or 0)


def dispatch(argv: Sequence[str]) -> int:
    """Run one `sluice` command line; returns the exit code."""
    argv = list(argv)
    # serve/bench hand everything after them to the service's own parser (including --help).
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in SERVICES:
        return run_serve(argv[1], argv[2:])
    if argv and argv[0] == "bench":
        return run_bench(argv[1:])
    if argv and argv[0] == "keys":
        from services.keys_cli import main as keys_main

        return int(keys_main(argv[1:]) or 0)
    if argv and argv[0] == "adapters":
        from services.adapters_cli import main as adapters_main

        return int(adapters_main(argv[1:]) or 0)
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if namespace.command == "bench":
        return run_bench([*namespace.bench_args, *unknown])
    if namespace.command == "serve":
        return run_serve(namespace.service, [*namespace.service_args, *unknown])
    if namespace.command == "up":
        return run_up(namespace, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_generate(namespace)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (`sluice`)."""
    exit_with_parent()  # a service a launcher started (tied_env) ends with that launcher
    raise SystemExit(dispatch(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
