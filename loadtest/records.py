"""What a client measured about one request, and its JSON form.

Times are seconds from the start of the run on the load generator's clock: when the request
was scheduled, when the scheduler released it (``dispatched_s``), when the call actually left
(``sent_s``; later than dispatch only while waiting for a ``--max-concurrency`` slot), and when
each streamed chunk carrying tokens arrived (``chunk_times_s`` with ``chunk_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """Timeline and outcome of one request; filled in by a client."""

    index: int
    scheduled_s: float
    adapter: str = ""
    input_tokens: int = 0
    expected_output_tokens: int = 0
    worker: int = 0
    dispatched_s: float | None = None
    sent_s: float | None = None
    finished_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    status: str = "UNKNOWN"
    error: str = ""
    finish_reason: str = ""
    cancelled: bool = False
    retries: int = 0  # sends again after RESOURCE_EXHAUSTED (ClientOptions.retries)
    retry_after_s: float | None = None  # the server's hint with the last refusal

    def add_chunk(self, at_s: float, tokens: int) -> None:
        """A streamed piece with `tokens` new tokens arrived at `at_s`."""
        if tokens <= 0:
            return
        self.chunk_times_s.append(at_s)
        self.chunk_tokens.append(tokens)
        self.output_tokens += tokens

    @property
    def send_lag_s(self) -> float | None:
        """Actual minus scheduled send time (includes any concurrency-slot wait)."""
        return None if self.sent_s is None else self.sent_s - self.scheduled_s

    @property
    def slot_wait_s(self) -> float | None:
        """Time spent waiting for a --max-concurrency slot."""
        if self.sent_s is None or self.dispatched_s is None:
            return None
        return self.sent_s - self.dispatched_s

    @property
    def ttft_s(self) -> float | None:
        """Time from sending to the first chunk carrying a token."""
        if self.sent_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        """Time from sending to the end of the stream."""
        if self.sent_s is None or self.finished_s is None:
            return None
        return self.finished_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): time per output token after the first."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def inter_token_latencies_s(self) -> list[float]:
        """Per-token gaps between streamed chunks.

        A chunk carrying k tokens that arrived g seconds after the previous chunk contributes k
        gaps of g / k each (its interval is split evenly), so every token after the first has
        exactly one ITL sample whatever the server's chunking.
        """
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times_s)):
            interval = self.chunk_times_s[i] - self.chunk_times_s[i - 1]
            tokens = self.chunk_tokens[i]
            gaps.extend([interval / tokens] * tokens)
        if self.chunk_tokens and self.chunk_tokens[0] > 1:
            # Tokens that arrived together with the first one came with no gap.
            gaps.extend([0.0] * (self.chunk_tokens[0] - 1))
        return gaps

    def to_json(self, *, with_chunks: bool = False) -> dict[str, Any]:
        """The JSON record of the report's `requests` list."""
        data = {
            "index": self.index,
            "scheduled_s": self.scheduled_s,
            "dispatched_s": self.dispatched_s,
            "sent_s": self.sent_s,
            "send_lag_s": self.send_lag_s,
            "slot_wait_s": self.slot_wait_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "expected_output_tokens": self.expected_output_tokens,
            "status": self.status,
            "error": self.error,
            "finish_reason": self.finish_reason,
            "cancelled": self.cancelled,
            "retries": self.retries,
            "adapter": self.adapter,
            "worker": self.worker,
        }
        if with_chunks:
            data["chunk_times_s"] = self.chunk_times_s
            data["chunk_tokens"] = self.chunk_tokens
            data["finished_s"] = self.finished_s
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        """Rebuild a record written by `to_json(with_chunks=True)` (worker → parent)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in data.items() if key in names})
