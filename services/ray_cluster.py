"""Ray for `sluice up`: start a local Ray instance (or join one) and run engine actors on it.

`RayCluster(config).start()` either joins `--ray-address` or starts a private local Ray instance
with the dashboard off (`--ray-dashboard` turns it on) and no Ray client server (`ray.init` does
not start one; only `ray start --head` would). Ray's token authentication is left at this Ray
version's default for new local clusters, which is ON (a token is generated under ~/.ray when
missing); it is never disabled here, and `token_auth` reports what Ray says.

`start_engines(worker, store)` creates one `EngineWorker` actor (services/engine/worker.py) per
GPU (`num_gpus=1`, the default count being the GPUs Ray sees) or `--engines N` CPU engines
(`num_cpus=1` each), each with `max_restarts` so Ray restarts a crashed one (it re-registers in
Redis itself) and `max_task_retries=0` so nothing in flight is replayed. It waits for every actor
to report ready and returns their addresses. `stop()` deregisters and stops the actors, then shuts
Ray down if this process started it.

On a cluster someone else started (KubeRay), `services/ray_engines.py` drives the same calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.common.config import field
from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.ports import free_port
from services.common.redis_store import StoreConfig
from services.engine.worker import EngineWorker, EngineWorkerSettings
from services.engine.worker_config import WorkerConfig

log = logging.getLogger(__name__)

NAMESPACE = "sluice"


@dataclass(frozen=True)
class RayClusterConfig:
    """Where Ray runs and how engine actors are placed."""

    ray_address: str | None = field(
        None, help="Ray cluster to join (auto, host:port or ray://...); None starts a local one"
    )
    engines: int | None = field(
        None, help="number of engine actors (default: one per GPU Ray sees, else 1 on CPU)"
    )
    ray_num_cpus: int | None = field(
        None, help="CPUs of a local Ray instance (default: enough for the CPU engines)"
    )
    ray_dashboard: bool = field(False, help="start the Ray dashboard (closed unless asked for)")
    engine_max_restarts: int = field(10, help="times Ray restarts a crashed engine actor")
    engine_id_prefix: str = field("engine", help="engine ids are <prefix>-<index> in the registry")
    engine_ready_timeout_s: float = field(600.0, help="seconds to wait for engines to load")
    registration_ttl_s: float = field(10.0, help="TTL of an engine's registry entry")
    engine_port: int | None = field(
        None,
        help="on a joined cluster, the gRPC port each engine actor binds on its node (None: a "
        "free one; a taken port falls back to a free one)",
    )
    gpus_per_engine: int = field(
        1, help="GPUs of one engine actor (its tensor-parallel size); one actor per that many"
    )
    engine_metrics_port: int | None = field(
        None,
        help="on a local Ray, engine i serves Prometheus /metrics on this port + i (None: off)",
    )
    wait_for_gpus: bool = field(
        False,
        help="before placing engines, wait (up to --engine-ready-timeout-s) until the cluster "
        "has one GPU per engine (--engines): on KubeRay the GPU workers join after the head",
    )

    def __post_init__(self) -> None:
        if self.gpus_per_engine < 1:
            raise InvalidArgumentError(f"gpus_per_engine must be >= 1, got {self.gpus_per_engine}")
        if self.engines is not None and (not isinstance(self.engines, int) or self.engines < 1):
            raise InvalidArgumentError(f"engines must be >= 1, got {self.engines!r}")
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise InvalidArgumentError("ray_num_cpus must be >= 1")
        if self.engine_max_restarts < -1:
            raise InvalidArgumentError("engine_max_restarts must be >= -1 (-1 = forever)")
        if not self.engine_id_prefix:
            raise InvalidArgumentError("engine_id_prefix must be non-empty")
        if not self.engine_ready_timeout_s > 0 or not self.registration_ttl_s > 0:
            raise InvalidArgumentError("timeouts must be > 0")
        if self.engine_port is not None and not 0 < self.engine_port < 65536:
            raise InvalidArgumentError(f"engine_port must be in 1..65535, got {self.engine_port}")


@dataclass
class EngineActor:
    """One started engine actor and what it reported when ready."""

    engine_id: str
    handle: Any
    address: str
    pid: int


class RayCluster:
    """A Ray connection plus the engine actors started on it (module docstring)."""

    def __init__(self, config: RayClusterConfig) -> None:
        self.config = config
        self.engines: list[EngineActor] = []
        self._started_ray = False
        self.token_auth: bool | None = None

    def start(self) -> RayCluster:
        import ray

        if ray.is_initialized():
            log.info("using the Ray instance this process is already connected to")
        elif self.config.ray_address:
            ray.init(address=self.config.ray_address, namespace=NAMESPACE, log_to_driver=False)
            log.info("joined Ray cluster at %s", self.config.ray_address)
        else:
            num_cpus = self.config.ray_num_cpus or max(1, self.config.engines or 1)
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=self.config.ray_dashboard,
                namespace=NAMESPACE,
                log_to_driver=False,
            )
            self._started_ray = True
            log.info(
                "started a local Ray instance (%d CPUs, dashboard %s)",
                num_cpus,
                "on" if self.config.ray_dashboard else "off",
            )
        self.token_auth = token_auth_enabled()
        if self.token_auth is False:
            log.warning("Ray token authentication is OFF for this cluster (RAY_AUTH_MODE)")
        return self

    def wait_for_gpus(self, count: int, poll_s: float = 2.0) -> None:
        """Block until Ray sees at least `count` GPUs (UnavailableError after the ready timeout)."""
        import ray

        deadline = time.monotonic() + self.config.engine_ready_timeout_s
        while (gpus := int(ray.cluster_resources().get("GPU", 0))) < count:
            if time.monotonic() > deadline:
                raise UnavailableError(f"the Ray cluster has {gpus} GPUs, {count} are needed")
            log.info("waiting for GPUs: %d of %d in the Ray cluster", gpus, count)
            time.sleep(poll_s)

    def engine_count(self) -> tuple[int, bool]:
        """(how many engines, whether each takes a GPU)."""
        import ray

        gpus = int(ray.cluster_resources().get("GPU", 0))
        per_engine = self.config.gpus_per_engine
        if self.config.engines is not None:
            return self.config.engines, gpus >= self.config.engines * per_engine
        return (gpus // per_engine, True) if gpus >= per_engine else (1, False)

    def _metrics_port(self, index: int, fixed_ports: bool, worker: WorkerConfig) -> int | None:
        """Engine `index`'s metrics port: its own on a local Ray (one node, distinct ports)."""
        if fixed_ports and self.config.engine_metrics_port is not None:
            return self.config.engine_metrics_port + index
        return worker.network.metrics_port

    def start_engines(
        self, worker: WorkerConfig, store: StoreConfig, *, host: str | None = None
    ) -> list[EngineActor]:
        """Create the engine actors and wait until each is ready (see module docstring)."""
        import ray

        count, use_gpu = self.engine_count()
        # Local Ray: loopback unless told otherwise; a joined cluster: each node's own IP.
        bind_host = host or ("auto" if self.config.ray_address else worker.network.host)
        # One node (a local Ray): fixed free ports, so a restarted actor comes back on the same
        # address. A joined cluster: the actor's node picks (the registry carries the address).
        fixed_ports = self.config.ray_address is None and bind_host != "auto"
        actor_class = ray.remote(EngineWorker)
        started: list[tuple[str, Any]] = []
        for index in range(count):
            engine_id = f"{self.config.engine_id_prefix}-{index}"
            settings = EngineWorkerSettings(
                engine_id=engine_id,
                worker=replace(
                    worker,
                    network=replace(
                        worker.network,
                        host=bind_host,
                        port=free_port(bind_host) if fixed_ports else self.config.engine_port or 0,
                        metrics_port=self._metrics_port(index, fixed_ports, worker),
                    ),
                ),
                store=store,
                registration_ttl_s=self.config.registration_ttl_s,
                startup_timeout_s=self.config.engine_ready_timeout_s,
            )
            handle = actor_class.options(
                name=f"sluice-{engine_id}",
                num_gpus=self.config.gpus_per_engine if use_gpu else 0,
                num_cpus=0 if use_gpu else 1,
                max_restarts=self.config.engine_max_restarts,
                max_task_retries=0,
                get_if_exists=False,
            ).remote(settings)
            started.append((engine_id, handle))
        deadline = time.monotonic() + self.config.engine_ready_timeout_s
        for engine_id, handle in started:
            remaining = max(1.0, deadline - time.monotonic())
            try:
                ready = ray.get(handle.ready.remote(remaining), timeout=remaining + 5)
            except Exception as exc:
                self.engines.extend(EngineActor(e, h, "", 0) for e, h in started)
                self.stop()
                raise UnavailableError(f"engine actor {engine_id} did not start: {exc}") from exc
            self.engines.append(EngineActor(engine_id, handle, ready["address"], ready["pid"]))
            log.info("engine actor %s ready at %s", engine_id, ready["address"])
        return self.engines

    def describe_engines(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Each actor's current engine_id, address and pid (after restarts: the new ones)."""
        import ray

        return ray.get(
            [actor.handle.describe.remote() for actor in self.engines], timeout=timeout_s
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the engine actors (deregistering them), then Ray if this process started it."""
        import ray

        if not ray.is_initialized():
            return
        pending = []
        for actor in self.engines:
            try:
                pending.append(actor.handle.stop.remote(timeout_s))
            except Exception:  # noqa: BLE001 - the actor may already be gone
                log.debug("engine %s: stop not delivered", actor.engine_id)
        if pending:
            try:
                ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - killed below anyway
                log.debug("engines did not all stop cleanly")
        for actor in self.engines:
            try:
                ray.kill(actor.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                log.debug("engine %s already gone", actor.engine_id)
        self.engines = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def token_auth_enabled() -> bool | None:
    """Whether Ray's token authentication is on for this process (None if unknown)."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode

        return bool(get_authentication_mode() == AuthenticationMode.TOKEN)
    except Exception:  # noqa: BLE001 - an older Ray without token auth
        return None


def start_ray_engines(
    engine_argv: Sequence[str],
    *,
    redis_url: str | None,
    config: RayClusterConfig | None = None,
    host: str | None = None,
) -> RayCluster:
    """For `sluice up`: start (or join) Ray and the engine actors from `sluice serve engine`
    flags (e.g. ["--model", "dummy:tiny"]); returns the cluster (`.engines[i].address`, and
    `.stop()` on exit). With `redis_url` None the engines register nowhere shared: pass their
    addresses to the router statically (they keep them across restarts on a local cluster).
    `host` None: the engine flags' --host on a local Ray, each node's IP on a joined one."""
    worker = WorkerConfig.from_argv(list(engine_argv))
    cluster = RayCluster(config or RayClusterConfig()).start()
    try:
        cluster.start_engines(worker, StoreConfig(redis_url=redis_url), host=host)
    except BaseException:
        cluster.stop()
        raise
    return cluster
