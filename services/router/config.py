"""The router's configuration: one frozen, validated dataclass filled from flags, env, defaults.

`RouterConfig.from_argv(argv)` is what `python -m services.router.server` and `sluice serve
router` use; every field is a `--flag` and a `SLUICE_<FIELD>` variable (see common/config.py).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common import env
from services.common.config import add_arguments, field, from_layers
from services.common.errors import InvalidArgumentError
from services.common.redis_store import StoreConfig
from services.common.tracing import TracingConfig
from services.router.api_keys import ApiKeyConfig
from services.router.pacing import (
    DEFAULT_MAX_HOLD_S,
    DEFAULT_MAX_INTERVAL,
    DEFAULT_MESSAGE_BUDGET,
)


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, whom it calls, and how much it queues."""

    host: str = field("127.0.0.1", help="address to listen on")
    port: int = field(50051, help="port to listen on (0 picks a free one)")
    engines: tuple[str, ...] = field(
        ("127.0.0.1:50061",), help="engine worker addresses, comma separated (host:port,...)"
    )
    tokenizer: str = field(
        "127.0.0.1:50052",
        help="tokenizer service address (host:port); comma-separated for several replicas",
    )
    max_queued_requests: int = field(
        1024, help="requests admitted but not yet on an engine; more are RESOURCE_EXHAUSTED"
    )
    max_queued_tokens: int = field(
        1_048_576, help="prompt tokens of the queued requests; more are RESOURCE_EXHAUSTED"
    )
    max_inflight_per_engine: int = field(
        0,
        help="requests placed on one engine at once (0: what the engine reports: its "
        "max_num_seqs, twice that when it time-slices LoRA slots)",
    )
    retry_after_s: float = field(
        1.0, help="seconds suggested to a rejected client (retry-after trailer), at least"
    )
    max_queue_delay_s: float = field(
        3.0,
        help="refuse a request at once (RESOURCE_EXHAUSTED + retry-after) when, by the engines' "
        "reported load and measured rates, it could not start within this many seconds; per "
        "priority (0: off; services/router/queue_delay.py)",
    )
    shutdown_grace_s: float = field(
        30.0, help="seconds in-flight requests may take to finish on SIGTERM"
    )
    api_keys_file: str | None = field(
        None, help="file with one API key per line; unset means no authentication"
    )
    engine_registry: bool = field(
        False,
        help="find engines in the Redis worker registry instead of --engines (default: on "
        "when --redis-url is set)",
    )
    redis_api_keys: bool = field(
        False, help="also accept API keys stored in Redis (`sluice keys add`); needs --redis-url"
    )
    registry_poll_s: float = field(
        1.0, help="seconds between reads of the Redis engine registry (with --redis-url)"
    )
    idempotency_ttl_s: float = field(
        600.0, help="seconds a finished request's result is kept for a retry with its request_id"
    )
    tokenize_timeout_s: float = field(10.0, help="seconds tokenizing a prompt may take")
    ready_wait_s: float = field(
        10.0,
        help="seconds a new request waits for a ready tokenizer and engine (one restarting) "
        "before UNAVAILABLE; 0 fails at once",
    )
    stream_interval: int = field(
        0,
        help="tokens a streamed response gathers before it is sent (the first token and the "
        "end go at once; above 1: fewer messages per token, burstier streams); 0 adapts it to "
        "the load: 1 until the router streams more than --stream-message-budget tokens/s",
    )
    stream_message_budget: float = field(
        DEFAULT_MESSAGE_BUDGET,
        help="with --stream-interval 0: responses per second the router aims to stay under "
        "(each costs ~70 us of router CPU and ~30 us of its client's; 1500/s ~ 0.15 core)",
    )
    stream_max_interval: int = field(
        DEFAULT_MAX_INTERVAL, help="with --stream-interval 0: the most tokens one response gathers"
    )
    stream_max_hold_ms: float = field(
        DEFAULT_MAX_HOLD_S * 1e3,
        help="with --stream-interval 0: the longest a token may be held back, ms",
    )
    reconnect_min_backoff_s: float = field(0.1, help="first reconnect delay to a lost service, s")
    reconnect_max_backoff_s: float = field(1.0, help="longest reconnect delay to a lost service, s")
    lora_max_wait_s: float = field(
        2.0,
        help="seconds a request may wait for its LoRA adapter to get a slot before an engine is "
        "made to exchange an adapter for it (bounds the wait of rare adapters; docs/lora.md)",
    )
    lora_swap_cost_s: float = field(
        0.05,
        help="estimated seconds to load an adapter on an engine, until the engine's loads have "
        "been measured; a request waits up to this long for an engine that holds its adapter",
    )
    adapter_inspect_timeout_s: float = field(
        30.0, help="seconds an engine may take to check an adapter being registered"
    )
    metrics_port: int | None = field(None, help="serve Prometheus /metrics on this port")
    http_port: int | None = field(
        None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) on this port of --host; unset or 0: off",
    )
    log_level: str = field("INFO", help="logging level")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port}")
        if isinstance(self.engines, str):
            object.__setattr__(
                self, "engines", tuple(e.strip() for e in self.engines.split(",") if e.strip())
            )
        object.__setattr__(self, "engines", tuple(self.engines))
        if not self.engines and not self.engine_registry:
            raise InvalidArgumentError("at least one engine address is needed (--engines)")
        if not self.tokenizer_addresses:
            raise InvalidArgumentError("at least one tokenizer address is needed (--tokenizer)")
        for address in (*self.engines, *self.tokenizer_addresses):
            _check_address(address)
        _positive_int("max_queued_requests", self.max_queued_requests)
        _positive_int("max_queued_tokens", self.max_queued_tokens)
        if isinstance(self.stream_interval, bool) or self.stream_interval < 0:
            raise InvalidArgumentError(
                f"stream_interval must be an integer >= 0, got {self.stream_interval!r}"
            )
        _positive_int("stream_max_interval", self.stream_max_interval)
        for name in ("stream_message_budget", "stream_max_hold_ms"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value}")
        if self.max_inflight_per_engine < 0:
            raise InvalidArgumentError("max_inflight_per_engine must be >= 0")
        for name in (
            "retry_after_s",
            "max_queue_delay_s",
            "shutdown_grace_s",
            "tokenize_timeout_s",
            "ready_wait_s",
            "lora_swap_cost_s",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value}")
        for name in (
            "registry_poll_s",
            "idempotency_ttl_s",
            "lora_max_wait_s",
            "adapter_inspect_timeout_s",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.reconnect_min_backoff_s <= self.reconnect_max_backoff_s:
            raise InvalidArgumentError(
                "need 0 < reconnect_min_backoff_s <= reconnect_max_backoff_s"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise InvalidArgumentError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise InvalidArgumentError(f"http_port must be in 0..65535, got {self.http_port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tokenizer_addresses(self) -> tuple[str, ...]:
        """The tokenizer replicas (`tokenizer` is a comma-separated list of host:port)."""
        return tuple(a.strip() for a in self.tokenizer.split(",") if a.strip())

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> RouterConfig:
        """The router part of `RouterSettings.from_argv` (store flags are accepted too)."""
        return RouterSettings.from_argv(argv).router


@dataclass(frozen=True)
class RouterSettings:
    """Everything `sluice serve router` reads: its own config, its shared store, tracing."""

    router: RouterConfig
    store: StoreConfig
    api_keys: ApiKeyConfig
    tracing: TracingConfig = TracingConfig()

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> RouterSettings:
        parser = argparse.ArgumentParser(
            prog="sluice serve router", description="The public Sluice router service."
        )
        add_arguments(parser, RouterConfig)
        add_arguments(parser, StoreConfig)
        add_arguments(parser, ApiKeyConfig)
        add_arguments(parser, TracingConfig)
        args = parser.parse_args(argv)
        store = from_layers(StoreConfig, args)
        if args.engine_registry is None and env.setting("engine_registry") is None:
            args.engine_registry = store.redis_url is not None
        router = from_layers(RouterConfig, args)
        if router.redis_api_keys and store.redis_url is None:
            raise InvalidArgumentError("--redis-api-keys needs --redis-url")
        return cls(router, store, from_layers(ApiKeyConfig, args), from_layers(TracingConfig, args))


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"expected host:port, got {address!r}")
