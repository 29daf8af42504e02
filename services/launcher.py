"""Starts a whole Sluice stack on this machine: tokenizer, engine worker(s) and router.

Each service runs as its own OS process (`python -m services.cli serve <service> ...`) bound to
loopback, so the stack behaves as it would in a cluster: real gRPC between processes, one
process per role. The launcher
- resolves (and, for the default GGUF model, converts) the model once before any child starts,
  so children never race on the conversion;
- picks free ports for the internal services, starts the tokenizer and engines, waits until
  their gRPC health says SERVING, then starts the router and waits for it too;
- stops everything cleanly: the router first (it drains), then engines and tokenizer; each child
  gets SIGTERM, then SIGKILL after a grace period;
- while it runs (`run_until_signal`), supervises every child it started (services/supervisor.py):
  a child that exits unexpectedly (tokenizer, router, engine process, private redis-server) is
  restarted on the same port with backoff, and only a crash loop stops the stack (exit code 1).

It is used by `sluice up` and by the integration test fixture (tests/integration/conftest.py).
Two ways to run engines: plain processes (the default of `StackConfig`, fast to start; what most
integration tests use), or, with `ray=True` (`sluice up` unless --no-ray), Ray actors started by
services/ray_cluster.py that Ray restarts on a crash. With `shared_state=True` the stack gets a
Redis (`redis_url`, else a private loopback redis-server with a random password, else the
in-memory store, said at start-up); Ray engines register there and the router finds them in the
registry, so engines that restart or join need no router restart.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from services.common.ports import free_port
from services.common.processes import tied_env
from services.common.redis_server import LocalRedisServer, redis_for_stack
from services.supervisor import CrashLoopError, RestartPolicy, Supervisor

if TYPE_CHECKING:  # Ray and the engine worker load only when Ray engines are asked for
    from services.ray_cluster import RayCluster, RayClusterConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class StackConfig:
    """What to start. Extra argv lists pass flags through to one kind of service unchanged."""

    model: str | None = None
    host: str = LOOPBACK  # the router's address; internal services always bind loopback
    port: int = 50051  # the router's port; 0 picks a free one
    engines: int = 1
    tokenizers: int = 1  # tokenizer processes; the router spreads its requests over them
    # GPU ids for engine processes: engine i sees only engine_gpus[i] (CUDA_VISIBLE_DEVICES).
    # Empty: engines see what the launcher sees. Ray pins its actors itself (num_gpus=1).
    engine_gpus: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    tokenizer_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    log_dir: Path | None = None  # None: children log to this process's stderr
    ray: bool = False  # engines as Ray actors (services/ray_cluster.py) instead of processes
    ray_cluster: RayClusterConfig | None = None  # Ray flags (address, restarts, ...)
    shared_state: bool = False  # a Redis for registry/keys/limits/idempotency (see module doc)
    redis_url: str | None = None  # an existing Redis; None with shared_state: a private one
    redis_data_dir: Path | None = None  # where a private Redis persists (None: not persisted)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)  # for crashed children
    # Prometheus ports: the launcher's own /metrics (restarts) on metrics_port, the router's on
    # metrics_port + 1, engine i's (process or local Ray actor) on metrics_port + 2 + i. None: off.
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.engines, bool) or not isinstance(self.engines, int):
            raise InvalidArgumentError(f"engines must be an integer, got {self.engines!r}")
        if self.engines < 1:
            raise InvalidArgumentError(f"engines must be >= 1, got {self.engines}")
        if isinstance(self.tokenizers, bool) or not isinstance(self.tokenizers, int):
            raise InvalidArgumentError(f"tokenizers must be an integer, got {self.tokenizers!r}")
        if self.tokenizers < 1:
            raise InvalidArgumentError(f"tokenizers must be >= 1, got {self.tokenizers}")
        if self.engine_gpus and len(self.engine_gpus) != self.engines:
            raise InvalidArgumentError(
                f"{self.engines} engines need {self.engines} GPUs to pin, got "
                f"{len(self.engine_gpus)} ({', '.join(self.engine_gpus)})"
            )
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536 - 2 - self.engines:
            raise InvalidArgumentError(f"metrics_port out of range: {self.metrics_port}")
        if self.startup_timeout_s <= 0 or self.stop_grace_s < 0:
            raise InvalidArgumentError("startup_timeout_s must be > 0 and stop_grace_s >= 0")


@dataclass
class ChildProcess:
    """One started service process and where it listens."""

    name: str
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    _log_file: IO[bytes] | None = field(default=None, repr=False)
    command: tuple[str, ...] = ()  # what started it: a restart runs the same (same port)
    env: dict[str, str] = field(default_factory=dict)  # set on top of the launcher's environment

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self) -> int | None:
        return self.process.poll()

    def restart(self) -> None:
        """Start the same command again after the process exited; its log is appended to."""
        if self.alive():
            raise FailedPreconditionError(f"{self.name} is still running")
        self.close_log()
        self.process, self._log_file = _popen(
            self.command, self.log_path, append=True, env=self.env
        )

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of the child's log file (empty when it logs to the terminal)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace")
        return text[-max_chars:]

    def close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


@dataclass(frozen=True)
class ModelSpec:
    """The model argument children get: the user's string (None = the default model)."""

    model: str | None

    def flags(self) -> list[str]:
        return [] if self.model is None else ["--model", self.model]


# (stack config, model) -> started engine children, each serving the Engine service.
# Replaceable: with Ray, engines start as Ray actors instead of processes.
EngineStarter = Callable[[StackConfig, ModelSpec], list[ChildProcess]]


def spawn_service(
    config: StackConfig,
    name: str,
    service: str,
    port: int,
    argv: Sequence[str],
    *,
    host: str = LOOPBACK,
    env: dict[str, str] | None = None,
) -> ChildProcess:
    """Start `sluice serve <service>` on `host:port` as a child process (`env`: variables set
    for it on top of this process's environment, e.g. CUDA_VISIBLE_DEVICES)."""
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        service,
        "--host",
        host,
        "--port",
        str(port),
        *argv,
    ]
    log_path: Path | None = None
    if config.log_dir is not None:
        config.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = config.log_dir / f"{name}.log"
    log.info("starting %s: %s", name, " ".join(command))
    process, log_file = _popen(command, log_path, env=env)
    return ChildProcess(
        name, f"{host}:{port}", process, log_path, log_file, tuple(command), dict(env or {})
    )


def _popen(
    command: Sequence[str],
    log_path: Path | None,
    *,
    append: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], IO[bytes] | None]:
    """Start one service process, logging to `log_path` (else this process's stderr)."""
    log_file: IO[bytes] | None = None
    if log_path is not None:
        log_file = open(log_path, "ab" if append else "wb")  # noqa: SIM115 - ChildProcess closes
    process = subprocess.Popen(
        command,
        # Without a log directory, children log to this process's stderr: stdout carries only
        # the launcher's own lines (the router address), so scripts can read it.
        stdout=log_file if log_file is not None else sys.stderr.fileno(),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops children in
        # order (router first, so it can drain).
        start_new_session=True,
        # SIGTERM when this launcher dies, even by SIGKILL: the child arms it itself at start
        # (services/common/processes.py says why not from here).
        env=tied_env() | (env or {}),
    )
    return process, log_file


def start_engine_processes(config: StackConfig, model: ModelSpec) -> list[ChildProcess]:
    """The default EngineStarter: one `sluice serve engine` process per engine."""
    return [
        spawn_service(
            config,
            f"engine-{index}",
            "engine",
            free_port(),
            [*model.flags(), *metrics_flags(config, 2 + index), *config.engine_args],
            env={"CUDA_VISIBLE_DEVICES": config.engine_gpus[index]} if config.engine_gpus else None,
        )
        for index in range(config.engines)
    ]


def plan_engine_processes(
    engines: int | None, device: str | None, gpus: Sequence[str], gpus_per_engine: int = 1
) -> tuple[int, tuple[str, ...]]:
    """(engine count, GPUs of each engine) for engines run as processes (`sluice up --no-ray`).

    Data parallel by default: as many engines as the visible GPUs hold, each pinned to its own
    `gpus_per_engine` GPUs (its tensor-parallel group; CUDA_VISIBLE_DEVICES "0,1"). On CPU (no
    GPU, or --device cpu): the asked count (default 1), unpinned. An explicit --device cuda:N
    keeps every engine on that device. More GPUs than there are is refused: two engines on one
    GPU would each size their KV cache from the same free memory."""
    if gpus_per_engine < 1:
        raise InvalidArgumentError(f"GPUs per engine must be >= 1, got {gpus_per_engine}")
    on_gpu = bool(gpus) and (device is None or device in ("auto", "cuda"))
    if not on_gpu:
        return (1 if engines is None else engines), ()
    count = len(gpus) // gpus_per_engine if engines is None else engines
    if count < 1 or count * gpus_per_engine > len(gpus):
        raise InvalidArgumentError(
            f"{max(count, 1)} engines of {gpus_per_engine} GPUs each but {len(gpus)} GPUs "
            f"({', '.join(gpus)}): each engine needs GPUs of its own (--device cpu for CPU engines)"
        )
    return count, tuple(
        ",".join(gpus[i * gpus_per_engine : (i + 1) * gpus_per_engine]) for i in range(count)
    )


def metrics_flags(config: StackConfig, offset: int) -> list[str]:
    """`--metrics-port` for the child at `offset` from the stack's metrics port (if any)."""
    if config.metrics_port is None:
        return []
    return ["--metrics-port", str(config.metrics_port + offset)]


class Stack:
    """A running stack. Use `start()` then `stop()`, or as a context manager."""

    def __init__(
        self, config: StackConfig, *, engine_starter: EngineStarter = start_engine_processes
    ) -> None:
        self.config = config
        self.engine_starter = engine_starter
        self.tokenizers: list[ChildProcess] = []
        self.engines: list[ChildProcess] = []
        self.router: ChildProcess | None = None
        self.redis_url: str | None = None
        self.redis_server: LocalRedisServer | None = None
        self.ray_cluster: RayCluster | None = None
        self._ray_addresses: list[str] = []
        self._stopped = False

    # ---- addresses ------------------------------------------------------------------------
    @property
    def router_address(self) -> str:
        if self.router is None:
            raise UnavailableError("the stack is not started")
        return self.router.address

    @property
    def tokenizer(self) -> ChildProcess | None:
        """The first tokenizer process (None before start)."""
        return self.tokenizers[0] if self.tokenizers else None

    @property
    def tokenizer_address(self) -> str:
        """The tokenizer replicas' addresses, comma-separated (the router's --tokenizer)."""
        if not self.tokenizers:
            raise UnavailableError("the stack is not started")
        return ",".join(tokenizer.address for tokenizer in self.tokenizers)

    @property
    def engine_addresses(self) -> list[str]:
        return [engine.address for engine in self.engines] + self._ray_addresses

    @property
    def children(self) -> list[ChildProcess]:
        members = [self.router, *self.engines, *self.tokenizers]
        return [child for child in members if child is not None]

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Stack:
        """Start every service and return once all report SERVING (raises and cleans up if not)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        config = self.config
        model = ModelSpec(config.model)
        prepare_model(config.model)
        if config.metrics_port is not None:
            from services.common.metrics import start_metrics_server

            start_metrics_server(config.metrics_port, addr=config.host)
        deadline = time.monotonic() + config.startup_timeout_s
        self.tokenizers = [
            spawn_service(
                config,
                "tokenizer" if config.tokenizers == 1 else f"tokenizer-{index}",
                "tokenizer",
                free_port(),
                [*model.flags(), *config.tokenizer_args],
            )
            for index in range(config.tokenizers)
        ]
        if config.shared_state or config.redis_url:
            self.redis_url, self.redis_server = redis_for_stack(
                config.redis_url, config.redis_data_dir
            )
        if config.ray:
            self._start_ray_engines(model)
        else:
            self.engines = self.engine_starter(config, model)
        for child in (*self.tokenizers, *self.engines):
            wait_until_serving(child, deadline)
        router_port = config.port or free_port(config.host)
        flags = router_flags(self.tokenizer_address, self.engine_addresses)
        if self.redis_url is not None:
            # Ray engines register in Redis: the router follows the registry. Plain engine
            # processes do not register: the router keeps their static list.
            flags += ["--redis-url", self.redis_url]
            flags += ["--engine-registry" if config.ray else "--no-engine-registry"]
        self.router = spawn_service(
            config,
            "router",
            "router",
            router_port,
            [*flags, *metrics_flags(config, 1), *config.router_args],
            host=config.host,
        )
        wait_until_serving(self.router, deadline)

    def _start_ray_engines(self, model: ModelSpec) -> None:
        from services.ray_cluster import RayClusterConfig, start_ray_engines

        # Given Ray flags decide the engine count (None there: one per GPU, else 1 on CPU).
        ray_config = self.config.ray_cluster or RayClusterConfig(engines=self.config.engines)
        if self.config.metrics_port is not None:  # engine i on metrics_port + 2 + i, as processes
            ray_config = replace(ray_config, engine_metrics_port=self.config.metrics_port + 2)
        self.ray_cluster = start_ray_engines(
            ["--host", LOOPBACK, *model.flags(), *self.config.engine_args],
            redis_url=self.redis_url,
            config=ray_config,
        )
        self._ray_addresses = [engine.address for engine in self.ray_cluster.engines]

    def dead_children(self) -> list[ChildProcess]:
        return [child for child in self.children if not child.alive()]

    def stop(self) -> None:
        """Router first (SIGTERM lets it drain), then engines and tokenizer. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace_s = self.config.stop_grace_s
        if self.router is not None:
            terminate([self.router], grace_s)
        terminate([*self.engines, *self.tokenizers], grace_s)
        if self.ray_cluster is not None:
            try:
                self.ray_cluster.stop(timeout_s=max(grace_s, 1.0))
            except Exception:  # noqa: BLE001 - keep stopping the rest
                log.exception("stopping the Ray engines failed")
        if self.redis_server is not None:
            self.redis_server.stop()
        for child in self.children:
            child.close_log()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def supervisor(self, announce: Callable[[str], None] = print) -> Supervisor:
        """A supervisor watching every child this stack started (Ray restarts its engines)."""
        supervisor = Supervisor(self.config.restart_policy, announce=announce)
        for child in self.children:
            supervisor.watch(
                child.name, alive=child.alive, exit_code=child.exit_code, restart=child.restart
            )
        redis_server = self.redis_server
        if redis_server is not None:
            supervisor.watch(
                "redis-server",
                alive=redis_server.running,
                exit_code=lambda: redis_server.process.poll(),
                restart=redis_server.restart,
            )
        return supervisor

    def run_until_signal(self, announce: Callable[[str], None] = print) -> int:
        """Serve until SIGINT/SIGTERM (exit code 0), restarting crashed children; a crash loop
        stops the stack (reported; exit code 1)."""
        stop_requested = threading.Event()
        previous = {
            signum: signal.signal(signum, lambda *_: stop_requested.set())
            for signum in (signal.SIGINT, signal.SIGTERM)
        }
        supervisor = self.supervisor(announce)
        try:
            while not stop_requested.wait(0.2):
                try:
                    supervisor.poll()
                except CrashLoopError as exc:
                    announce(f"sluice: {exc.message}")
                    return 1
            announce("sluice: stopping")
            return 0
        finally:
            self.stop()
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def engine_info(address: str, timeout_s: float = 5.0):
    """The engine's Info reply (engine_pb2.EngineInfo); raises grpc.RpcError."""
    import grpc

    from protos.sluice.v1 import engine_pb2, engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Info(
            engine_pb2.EngineInfoRequest(), timeout=timeout_s
        )


def describe_engines(addresses: Sequence[str], timeout_s: float = 5.0) -> list[str]:
    """One line per engine: its device, dtype, step limits and how its steps run (from Info)."""
    import grpc

    lines = []
    for address in addresses:
        try:
            info = engine_info(address, timeout_s)
        except grpc.RpcError as error:
            lines.append(f"engine at {address}: no Info ({error.code().name})")
            continue
        target = f", target_step_ms {info.target_step_ms:g}" if info.target_step_ms else ""
        lora = ""
        if info.max_loras:
            adapters = info.load.lora_adapter_capacity or info.max_loras
            lora = f", LoRA {info.max_loras} device slots for {adapters} adapters in flight"
        lines.append(
            f"engine at {address}: {info.model} on {info.device} ({info.dtype}), "
            f"max_num_seqs {info.max_num_seqs}, max_num_batched_tokens "
            f"{info.max_num_batched_tokens}{target}, {info.num_blocks} KV blocks of "
            f"{info.block_size}{lora}; {info.execution_path or info.backend}"
        )
    return lines


def router_flags(tokenizer_address: str, engine_addresses: Sequence[str]) -> list[str]:
    """How the router is told where its tokenizer and engines are (services/router/config.py)."""
    return ["--tokenizer", tokenizer_address, "--engines", ",".join(engine_addresses)]


def prepare_model(model: str | None) -> None:
    """Resolve the model once (converting the default GGUF) before children start."""
    from services.common.model_files import resolve_model

    resolve_model(model)


def wait_until_serving(child: ChildProcess, deadline: float) -> None:
    """Poll the child's gRPC health until SERVING; raise if it exits or the deadline passes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(child.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not child.alive():
                raise UnavailableError(
                    f"{child.name} exited with code {child.process.returncode} while starting"
                    + _tail_note(child)
                )
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    log.info("%s serving at %s", child.name, child.address)
                    return
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"{child.name} at {child.address} not serving before the start-up timeout"
                    + _tail_note(child)
                )
            time.sleep(0.2)


def terminate(children: Sequence[ChildProcess], grace_s: float) -> None:
    """SIGTERM every live child, wait up to `grace_s` for all, then SIGKILL the rest."""
    for child in children:
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        remaining = max(deadline - time.monotonic(), 0.0)
        try:
            child.process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.1f s; killing it", child.name, grace_s)
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            child.process.wait()


def _tail_note(child: ChildProcess) -> str:
    tail = child.log_tail()
    return f"\n--- last lines of {child.log_path} ---\n{tail}" if tail else ""
