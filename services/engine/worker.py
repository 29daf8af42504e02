"""The engine worker as a Ray actor: `EngineWorker` runs the engine gRPC server and registers it.

Ray places one `EngineWorker` per GPU (`num_gpus=1`), or per CPU slot, and restarts it when its
process dies (`max_restarts`; services/ray_cluster.py creates them). Inside the actor:
- a background thread runs an asyncio loop with the ordinary engine server
  (`services.engine.server.serve`, the same code as `sluice serve engine`) bound to the node's
  address (or the host given) on the port given (0: a free one);
- once the server answers `Info` (the model is loaded), the worker writes its `EngineRecord`
  (address, model, capacity, load, resident adapters) to the worker registry with a TTL and keeps
  it fresh from periodic `Info` calls; routers find it there (services/router/registry.py);
- `ready()` blocks until registered and returns where it serves; `stop()` deregisters and shuts
  the server down cleanly.
After a crash Ray runs `__init__` again: the worker starts a new server — on the same port when
one was given and it is free again, else on a new one — and re-registers under the same engine
id, which replaces any stale address. Nothing in flight is
replayed: the router's streams to the dead process fail with UNAVAILABLE and the router decides
what to retry; actor methods are not retried (`max_task_retries=0`).
This module imports neither torch nor ray at import time (ray only for the node address).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.errors import InvalidArgumentError, SluiceError, UnavailableError
from services.common.ports import free_port
from services.common.protocol.engine_record import EngineRecord
from services.common.redis_store import StoreConfig, open_store
from services.engine.registration import EngineRegistration
from services.engine.worker_config import WorkerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineWorkerSettings:
    """What one engine actor needs; plain data so Ray can ship it to the actor."""

    engine_id: str
    worker: WorkerConfig
    store: StoreConfig = field(default_factory=StoreConfig)
    # Bind host is worker.network.host ("auto" = this node's IP, as Ray sees it); the address
    # registered is advertise_host, else the bind host (the node's IP when binding 0.0.0.0).
    advertise_host: str | None = None
    registration_ttl_s: float = 10.0
    startup_timeout_s: float = 600.0
    info_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise InvalidArgumentError("engine_id must be non-empty")
        if not self.registration_ttl_s > 0 or not self.startup_timeout_s > 0:
            raise InvalidArgumentError("registration_ttl_s and startup_timeout_s must be > 0")


def node_address() -> str:
    """This node's IP address as Ray sees it (127.0.0.1 when Ray is not available)."""
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - no Ray: loopback
        return "127.0.0.1"


class EngineWorker:
    """The Ray actor body (module docstring). Ray wraps it with `ray.remote(...)`."""

    def __init__(self, settings: EngineWorkerSettings) -> None:
        self.settings = settings
        network = settings.worker.network
        bind_host = node_address() if network.host == "auto" else network.host
        advertised = settings.advertise_host or (
            node_address() if bind_host == "0.0.0.0" else bind_host
        )
        port = network.port
        if port and not _port_free(bind_host, port):
            log.warning("port %d is taken; engine %s uses a free one", port, settings.engine_id)
            port = 0
        port = port or free_port(bind_host)
        self._config = replace(settings.worker, network=replace(network, host=bind_host, port=port))
        self.address = f"{advertised}:{port}"
        self._local_target = f"{'127.0.0.1' if bind_host == '0.0.0.0' else bind_host}:{port}"
        self.started_at = time.time()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._thread.start()

    # ---- actor methods --------------------------------------------------------------------
    def ready(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until serving and registered; returns engine_id, address, pid."""
        timeout = self.settings.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self._error is not None:
                raise UnavailableError(f"engine {self.settings.engine_id} failed: {self._error!r}")
            if self._done.is_set():
                raise UnavailableError(f"engine {self.settings.engine_id} stopped")
            if time.monotonic() > deadline:
                raise UnavailableError(f"engine {self.settings.engine_id} not ready in {timeout}s")
        return self.describe()

    def describe(self) -> dict[str, Any]:
        return {
            "engine_id": self.settings.engine_id,
            "address": self.address,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "ready": self._ready.is_set(),
        }

    def pid(self) -> int:
        return os.getpid()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Deregister and stop the server; True when it stopped within the timeout."""
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- the background loop --------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported through ready()
            self._error = exc
            log.exception("engine worker %s failed", self.settings.engine_id)
        finally:
            self._done.set()

    async def _main(self) -> None:
        from services.engine.server import serve

        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        store = open_store(self.settings.store)
        server = asyncio.create_task(  # the actor's process serves until it ends
            serve(self._config, stop_event=self._stop_event, freeze_heap=True)
        )
        registration: EngineRegistration | None = None
        try:
            info = await self._wait_for_info(server)
            registration = EngineRegistration(
                store, _Snapshot(self, info), ttl_s=self.settings.registration_ttl_s
            )
            await registration.start()
            self._ready.set()
            log.info("engine %s ready at %s", self.settings.engine_id, self.address)
            stopper = asyncio.create_task(self._stop_event.wait())
            await asyncio.wait({server, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
        finally:
            if registration is not None:
                await registration.stop(deregister=True)
            self._stop_event.set()
            with contextlib.suppress(asyncio.CancelledError):
                await server
            await store.close()

    async def _wait_for_info(self, server: asyncio.Task[None]) -> Any:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while True:
            if server.done():
                server.result()  # raises the server's error
                raise UnavailableError("the engine server stopped during start-up")
            try:
                return await fetch_info(self._local_target, self.settings.info_timeout_s)
            except Exception:  # noqa: BLE001 - still loading
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def _port_free(host: str, port: int, wait_s: float = 2.0) -> bool:
    """True if `port` can be bound on `host` (retrying briefly: a dead process may hold it)."""
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.1)


async def fetch_info(target: str, timeout_s: float) -> Any:
    """The Engine.Info message of the server at `target`."""
    import grpc

    from protos.sluice.v1 import engine_pb2, engine_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return await stub.Info(engine_pb2.EngineInfoRequest(), timeout=timeout_s)


class _Snapshot:
    """Builds the registry record from the latest Info (refreshed on each call)."""

    def __init__(self, worker: EngineWorker, info: Any) -> None:
        self.worker = worker
        self.info = info

    async def __call__(self) -> EngineRecord:
        with contextlib.suppress(Exception):
            self.info = await fetch_info(
                self.worker._local_target, self.worker.settings.info_timeout_s
            )
        return record_from_info(
            self.worker.settings.engine_id, self.worker.address, self.info, self.worker.started_at
        )


def record_from_info(engine_id: str, address: str, info: Any, started_at: float) -> EngineRecord:
    """An EngineRecord from an Engine.Info protobuf message."""
    load = info.load
    return EngineRecord(
        engine_id=engine_id,
        address=address,
        model=info.model,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        max_num_seqs=info.max_num_seqs,
        free_blocks=load.free_blocks,
        running=load.running,
        waiting=load.waiting,
        resident_adapters=tuple(load.resident_adapters),
        backend=info.backend,
        device=info.device,
        pid=os.getpid(),
        started_at=started_at,
        extra={"instance_id": info.engine_id},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m services.engine.worker`: one engine that registers itself, without Ray.

    The engine flags of `sluice serve engine`, plus --redis-url/--redis-password and
    --engine-id; for a plain container or a GPU machine that joins a Redis-backed cluster.
    """
    from services.common.config import add_arguments, from_layers
    from services.engine.worker_config import build_parser

    parser = build_parser("python -m services.engine.worker")
    add_arguments(parser.add_argument_group("registry"), StoreConfig)
    registry = parser.add_argument_group("registration")
    registry.add_argument("--engine-id", default=None, help="registry id (default: host-port)")
    registry.add_argument("--advertise-host", default=None, help="host routers should dial")
    registry.add_argument("--registration-ttl-s", type=float, default=10.0, help="entry TTL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        worker_config = WorkerConfig.from_namespace(args)
        network = worker_config.network
        settings = EngineWorkerSettings(
            engine_id=args.engine_id or f"engine-{socket.gethostname()}-{network.port}",
            worker=worker_config,
            store=from_layers(StoreConfig, args),
            advertise_host=args.advertise_host,
            registration_ttl_s=args.registration_ttl_s,
        )
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    worker = EngineWorker(settings)
    try:
        ready = worker.ready()
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        worker.stop()
        return 1
    print(f"engine {ready['engine_id']} ready at {ready['address']}", flush=True)
    while not stop.wait(0.5):
        if worker._done.is_set():
            print(f"error: engine {settings.engine_id} stopped unexpectedly", file=sys.stderr)
            return 1
    return 0 if worker.stop() else 1


if __name__ == "__main__":
    sys.exit(main())
