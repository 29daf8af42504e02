"""Engine actors on a Ray cluster that someone else started: the KubeRay head's driver.

`python -m services.ray_engines --ray-address auto ...` joins the cluster, waits until it has one
GPU per engine (`--wait-for-gpus`: KubeRay's GPU workers join after the head; an engine of
`--tensor-parallel-size N` takes N GPUs in one actor), places the
EngineWorker actors through `services.ray_cluster.RayCluster` (`--engine-port` pins their gRPC
port on each node, so probes and network policies can name it), and holds them until SIGTERM,
when it drains and deregisters them. The actors are not detached: they live as long as this
driver, which is the head pod's main process (deploy/k8s/base/raycluster.yaml).

`--drain-this-node` instead drains the engine actors that serve from this node and returns: a
Ray worker pod's preStop hook, so a pod that is going away lets its streams finish first.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace

from services.common.config import add_arguments, from_layers
from services.common.errors import InvalidArgumentError, SluiceError
from services.common.redis_store import StoreConfig
from services.engine.worker import node_address
from services.engine.worker_config import WorkerConfig, build_parser
from services.ray_cluster import NAMESPACE, RayCluster, RayClusterConfig


def drain_node_engines(config: RayClusterConfig, timeout_s: float) -> list[str]:
    """Drain and deregister the engine actors that serve from this node; returns their ids.

    Finds the actors by name (`sluice-<prefix>-N` in Ray's `sluice` namespace, through the GCS:
    no dashboard needed) and stops those whose address is this node's. The actors stay alive
    until the node goes; Ray then restarts each where a GPU is free, and it registers again."""
    import ray

    ray.init(address=config.ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        prefix = f"sluice-{config.engine_id_prefix}-"
        names = [name for name in ray.util.list_named_actors() if name.startswith(prefix)]
        handles = [ray.get_actor(name) for name in names]
        described = ray.get([handle.describe.remote() for handle in handles], timeout=timeout_s)
        here = node_address()
        local = [
            (handle, info)
            for handle, info in zip(handles, described, strict=True)
            if info["address"].rpartition(":")[0] == here
        ]
        ray.get([handle.stop.remote(timeout_s) for handle, _ in local], timeout=timeout_s + 5.0)
        return [info["engine_id"] for _, info in local]
    finally:
        ray.shutdown()


def with_tensor_parallel(config: RayClusterConfig, worker: WorkerConfig) -> RayClusterConfig:
    """`config` with one actor's GPUs equal to the engines' --tensor-parallel-size (a group
    of N ranks needs N GPUs in its actor): taken from it when --gpus-per-engine is left at 1,
    refused when both are set and differ."""
    size = worker.engine.tensor_parallel_size
    if config.gpus_per_engine == size:
        return config
    if config.gpus_per_engine == 1:
        return replace(config, gpus_per_engine=size)
    raise InvalidArgumentError(
        f"--gpus-per-engine {config.gpus_per_engine} differs from the engines' "
        f"--tensor-parallel-size {size}: an engine's ranks take one GPU each"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m services.ray_engines` (module docstring)."""
    parser = build_parser("python -m services.ray_engines")
    parser.description = "Join a Ray cluster and hold one engine actor per GPU until SIGTERM."
    add_arguments(parser.add_argument_group("ray"), RayClusterConfig)
    add_arguments(parser.add_argument_group("registry"), StoreConfig)
    parser.add_argument(
        "--drain-this-node",
        action="store_true",
        help="drain the engine actors serving from this node, then exit (a preStop hook); "
        "waits up to --shutdown-grace-s for their streams",
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        worker = WorkerConfig.from_namespace(args)
        config = with_tensor_parallel(from_layers(RayClusterConfig, args), worker)
        store = from_layers(StoreConfig, args)
        if config.ray_address is None:
            raise InvalidArgumentError("--ray-address is needed (auto: the cluster of this node)")
        if config.wait_for_gpus and config.engines is None:
            raise InvalidArgumentError("--wait-for-gpus needs --engines")
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    if args.drain_this_node:
        drained = drain_node_engines(config, worker.network.shutdown_grace_s + 5.0)
        print(f"drained engines on this node: {', '.join(drained) or 'none'}", flush=True)
        return 0
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster = RayCluster(config).start()
    try:
        if config.wait_for_gpus and config.engines is not None:
            cluster.wait_for_gpus(config.engines * config.gpus_per_engine)
        engines = cluster.start_engines(worker, store, host=worker.network.host)
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    for engine in engines:
        print(f"engine {engine.engine_id} ready at {engine.address}", flush=True)
    stop.wait()
    cluster.stop(timeout_s=worker.network.shutdown_grace_s + 5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
