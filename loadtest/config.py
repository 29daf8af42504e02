"""`BenchConfig`: every `sluice bench run` flag as one frozen, validated dataclass.

Flags come from `services.common.config.add_arguments`, layered over `SLUICE_<FIELD>`
environment variables and the defaults below (`from_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.arrivals import ARRIVAL_KINDS
from loadtest.datasets import ADAPTER_DISTRIBUTIONS, DATASETS, DatasetOptions
from loadtest.metrics import parse_slo
from loadtest.schedule import ClientOptions
from services.common.config import field
from services.common.errors import InvalidArgumentError


@dataclass(frozen=True)
class BenchConfig:
    """A load-test run: target, arrivals, dataset, metrics and output."""

    target: str | None = field(None, help="Sluice router HOST:PORT (gRPC, streaming)")
    openai_url: str | None = field(
        None, help="OpenAI-compatible server URL (streaming completions)"
    )
    model: str | None = field(
        None, help="model name for --openai-url (default: first of /v1/models)"
    )
    api_key: str | None = field(None, help="API key sent as a Bearer token")
    arrival: str = field("exponential", help=f"arrival process: {', '.join(ARRIVAL_KINDS)}")
    rate: float = field(1.0, help="mean request rate, requests/s")
    burstiness: float = field(1.0, help="gamma shape B (CV = 1/sqrt(B)); 1 = Poisson")
    num_requests: int | None = field(
        None, help="number of requests (default 100 unless --duration-s)"
    )
    duration_s: float | None = field(None, help="schedule requests for this many seconds instead")
    max_concurrency: int | None = field(None, help="at most this many requests in flight")
    seed: int = field(0, help="seed of arrivals and dataset")
    dataset: str = field("synthetic", help=f"dataset: {', '.join(DATASETS)}")
    dataset_path: str | None = field(None, help="ShareGPT JSON file for --dataset sharegpt")
    input_mean: float = field(128.0, help="synthetic prompt length mean (tokens)")
    input_stdev: float = field(0.0, help="synthetic prompt length stdev (tokens)")
    output_mean: float = field(64.0, help="output length mean (tokens)")
    output_stdev: float = field(0.0, help="output length stdev (tokens)")
    num_prefix_groups: int = field(4, help="shared-prefix: number of groups")
    prefix_len: int = field(256, help="shared-prefix: tokens in each group's prefix")
    vocab_limit: int = field(10_000, help="synthetic token ids are drawn below this id")
    tokenizer: str | None = field(None, help="HF tokenizer dir to decode/count tokens (optional)")
    adapters: tuple[str, ...] = field((), help="comma-separated LoRA adapter names to mix")
    adapter_dist: str = field("uniform", help=f"adapter mix: {', '.join(ADAPTER_DISTRIBUTIONS)}")
    zipf_s: float = field(1.1, help="Zipf exponent for --adapter-dist zipf")
    cancel_rate: float = field(0.0, help="fraction of requests cancelled mid-stream")
    slo: str | None = field(None, help="SLOs in ms for goodput, e.g. ttft=500,tpot=50")
    out: str | None = field(None, help="write the JSON report here (+ .md and PNG plots)")
    workers: int = field(1, help="load-generator processes")
    metrics_url: tuple[str, ...] = field((), help="comma-separated /metrics URLs to scrape")
    scrape_interval_s: float = field(0.5, help="seconds between metric scrapes")
    grpc_channels: int = field(4, help="gRPC channels per load-generator process")
    timeout_s: float = field(600.0, help="per-request timeout in seconds")
    retries: int = field(
        0,
        help="send a request refused with RESOURCE_EXHAUSTED (HTTP 429) again after the "
        "server's retry-after, up to N times (its TTFT counts from the first send)",
    )
    temperature: float = field(0.0, help="sampling temperature sent with each request")
    lag_warning_ms: float = field(50.0, help="warn when a request leaves this late")
    progress: bool = field(True, help="show a progress bar")

    def __post_init__(self) -> None:
        if (self.target is None) == (self.openai_url is None):
            raise InvalidArgumentError("give exactly one of --target HOST:PORT and --openai-url")
        if self.num_requests is not None and self.duration_s is not None:
            raise InvalidArgumentError("give --num-requests or --duration-s, not both")
        if self.num_requests is not None and self.num_requests < 1:
            raise InvalidArgumentError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise InvalidArgumentError(f"--duration-s must be > 0, got {self.duration_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidArgumentError("--max-concurrency must be >= 1")
        if self.retries < 0:
            raise InvalidArgumentError(f"--retries must be >= 0, got {self.retries}")
        if self.workers < 1 or self.grpc_channels < 1:
            raise InvalidArgumentError("--workers and --grpc-channels must be >= 1")
        if not self.timeout_s > 0 or not self.scrape_interval_s > 0:
            raise InvalidArgumentError("--timeout-s and --scrape-interval-s must be > 0")
        parse_slo(self.slo)

    @property
    def slo_ms(self) -> dict[str, float]:
        return parse_slo(self.slo)

    def dataset_options(self) -> DatasetOptions:
        return DatasetOptions(
            dataset=self.dataset,
            dataset_path=self.dataset_path,
            input_mean=self.input_mean,
            input_stdev=self.input_stdev,
            output_mean=self.output_mean,
            output_stdev=self.output_stdev,
            num_prefix_groups=self.num_prefix_groups,
            prefix_len=self.prefix_len,
            vocab_limit=self.vocab_limit,
            adapters=self.adapters,
            adapter_dist=self.adapter_dist,
            zipf_s=self.zipf_s,
            cancel_rate=self.cancel_rate,
            seed=self.seed,
        )

    def client_options(self) -> ClientOptions:
        return ClientOptions(
            target=self.target,
            openai_url=self.openai_url,
            model=self.model,
            grpc_channels=self.grpc_channels,
            timeout_s=self.timeout_s,
            temperature=self.temperature,
            api_key=self.api_key,
            retries=self.retries,
        )
