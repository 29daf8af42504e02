"""Scrapes Prometheus `/metrics` endpoints (`--metrics-url`, repeatable) during a run.

A background thread fetches each URL every `interval_s` and keeps the gauge and counter samples
(histogram buckets are skipped: the harness measures latency itself). The report plots queue
depth, running sequences and KV-cache use from these series beside the client-side latency.
Scrape failures are counted, never fatal: a run is not lost because a metrics port is down.
`scrape_histogram` and `window_quantile` read one histogram at two moments and give a quantile
of what was observed in between (the stack benchmark's first-token phases); `scrape_samples`
reads a few samples of any type (its engine's step and token counters).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

_KEPT_TYPES = ("gauge", "counter", "untyped", "unknown")


@dataclass
class Scrape:
    """One fetch of one URL: wall time and `name{label="value",...}` → value."""

    url: str
    epoch_s: float
    values: dict[str, float]


@dataclass
class ScrapeLog:
    """Everything scraped during a run."""

    scrapes: list[Scrape] = field(default_factory=list)
    failures: int = 0

    def series(self, name: str, start_epoch_s: float = 0.0) -> tuple[list[float], list[float]]:
        """(times from start, values) of one metric summed over labels and URLs per scrape."""
        times, values = [], []
        for scrape in self.scrapes:
            matching = [v for key, v in scrape.values.items() if key.split("{", 1)[0] == name]
            if matching:
                times.append(scrape.epoch_s - start_epoch_s)
                values.append(sum(matching))
        return times, values

    def to_json(self, start_epoch_s: float) -> dict:
        """The report's `server_metrics` section."""
        return {
            "failures": self.failures,
            "scrapes": [
                {"url": s.url, "t_s": s.epoch_s - start_epoch_s, "values": s.values}
                for s in self.scrapes
            ],
        }


def parse_metrics(text: str) -> dict[str, float]:
    """Gauge and counter samples of a Prometheus text exposition."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in _KEPT_TYPES:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return values


def fetch(url: str, timeout_s: float) -> str:
    """One endpoint's exposition text (raises OSError on failure)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - operator URL
        return response.read().decode("utf-8", errors="replace")


def scrape_once(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Fetch and parse one endpoint (raises OSError/ValueError on failure)."""
    return parse_metrics(fetch(url, timeout_s))


# Cumulative histogram buckets: (upper bound "le", observations at or below it), ascending.
Buckets = list[tuple[float, float]]


def scrape_histogram(url: str, name: str, label: str, timeout_s: float = 5.0) -> dict[str, Buckets]:
    """One histogram's cumulative buckets from an endpoint, by the value of `label`."""
    by_label: dict[str, Buckets] = {}
    for family in text_string_to_metric_families(fetch(url, timeout_s)):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and label in sample.labels:
                bucket = (float(sample.labels["le"]), float(sample.value))
                by_label.setdefault(sample.labels[label], []).append(bucket)
    return {key: sorted(buckets) for key, buckets in by_label.items()}


def scrape_samples(url: str, names: set[str], timeout_s: float = 5.0) -> dict[str, float]:
    """The unlabelled samples named `names`, of any metric type (e.g. a histogram's `_count`)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(fetch(url, timeout_s)):
        for sample in family.samples:
            if sample.name in names and not sample.labels:
                found[sample.name] = float(sample.value)
    return found


def window_quantile(before: Buckets, after: Buckets, q: float) -> float | None:
    """The q-quantile of the observations made between two scrapes of one histogram,
    interpolated linearly inside its bucket as Prometheus' histogram_quantile does (the lowest
    bucket from 0; past the highest finite bound: that bound). None without observations."""
    earlier = dict(before)
    window = [(bound, count - earlier.get(bound, 0.0)) for bound, count in sorted(after)]
    if not window or window[-1][1] <= 0:
        return None
    rank = window[-1][1] * q
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in window:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 0.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return None


class Scraper:
    """Polls URLs from a daemon thread between `start()` and `stop()`."""

    def __init__(self, urls: list[str], interval_s: float = 0.5) -> None:
        self._urls = list(urls)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log = ScrapeLog()

    def start(self) -> None:
        if self._urls:
            self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)
            self._thread.start()

    def stop(self) -> ScrapeLog:
        """Stop polling (after one last scrape) and return what was gathered."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.log

    def _loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            began = time.monotonic()
            for url in self._urls:
                try:
                    values = scrape_once(url)
                except (OSError, ValueError, urllib.error.URLError):
                    self.log.failures += 1
                    continue
                self.log.scrapes.append(Scrape(url, time.time(), values))
            if stopping:
                return
            self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - began)))
