"""Configuration of one engine worker process: where it listens plus how its engine runs.

Composed, not copied: `WorkerNetworkConfig` holds the worker's own settings (address, metrics
port, idle load reports) and `EngineConfig` (services/engine/config.py) the engine's; both get
their flags from their dataclass fields and are layered flag > `SLUICE_*` env > default by
`services.common.config.from_layers`. `WorkerConfig` bundles the two, with the process's
tracing settings (services/common/tracing/).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import add_arguments, field, from_layers
from services.common.errors import InvalidArgumentError
from services.common.tracing import TracingConfig
from services.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerNetworkConfig:
    """The worker's own settings (the engine's are in EngineConfig)."""

    host: str = field("127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    port: int = field(50061, help="gRPC port of the Engine service (0 picks a free one)")
    metrics_port: int | None = field(None, help="port of the Prometheus /metrics endpoint")
    load_report_interval_s: float = field(
        1.0, help="seconds between load-only messages to routers while the engine is idle"
    )
    shutdown_grace_s: float = field(5.0, help="seconds in-flight streams get on SIGTERM")

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise InvalidArgumentError("host must be a non-empty string")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise InvalidArgumentError(f"port must be an integer, got {self.port!r}")
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidArgumentError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.load_report_interval_s > 0:
            raise InvalidArgumentError("load_report_interval_s must be > 0")
        if not self.shutdown_grace_s >= 0:
            raise InvalidArgumentError("shutdown_grace_s must be >= 0")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one engine worker needs."""

    network: WorkerNetworkConfig
    engine: EngineConfig
    tracing: TracingConfig = TracingConfig()

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None) -> WorkerConfig:
        """Parse `sluice serve engine` flags (then env, then defaults)."""
        namespace = build_parser().parse_args(list(argv) if argv is not None else None)
        return cls.from_namespace(namespace)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> WorkerConfig:
        return cls(
            network=from_layers(WorkerNetworkConfig, namespace),
            engine=from_layers(EngineConfig, namespace),
            tracing=from_layers(TracingConfig, namespace),
        )


def build_parser(prog: str = "sluice serve engine") -> argparse.ArgumentParser:
    """Flags of both dataclasses, in two help groups."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Run one engine worker (the Engine gRPC service) standalone."
    )
    add_arguments(parser.add_argument_group("worker"), WorkerNetworkConfig)
    add_arguments(parser.add_argument_group("engine"), EngineConfig)
    add_arguments(parser.add_argument_group("tracing"), TracingConfig)
    return parser
