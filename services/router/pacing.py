"""How many tokens each streamed response gathers: a fixed count, or adapted to the router's load.

Every response is one gRPC message, and on the per-token path a message costs the router and its
client far more CPU than the token in it: on a 2-vCPU AMD EPYC VM at 64 streams, ~70 us of router
CPU and ~30 us of the client's per message, against ~26 and ~12 us per token besides (fitted from
runs at fixed `--stream-interval` 1, 4 and 8), so at 10,000 tokens/s one message per token takes a
whole core. A fixed `--stream-interval N` (as in vLLM and SGLang) divides that by N at every load,
and makes light-load streams bursty for nothing. The adaptive pacing (`--stream-interval 0`, the
default) keeps one message per token while the router streams fewer tokens per second than
`--stream-message-budget`, and above it gathers just enough tokens per response to stay near that
many messages per second:

    interval = clamp(ceil(streamed tokens per second / budget), 1, --stream-max-interval)

The token rate is measured over the last `RATE_WINDOW_S` (every detokenized step reports its
tokens). The first token of a request and its end always go at once, and a held-back token never
waits longer than `--stream-max-hold-ms` (a periodic sweep flushes it; see RouterCore), so a
stalled engine cannot hold text back. The hold limit must leave room for the interval: with
steps of 20-50 ms (a loaded GPU engine) a 50 ms limit flushed every 1-3 tokens whatever the
interval, so the router sent 2-3x the messages its budget asked for; at 250 ms (the default) an
interval of 8 holds at 20-30 ms steps (BENCHMARKS.md, "Serving stack"). The interval reaches
its cap only above cap x budget tokens/s (a router over several GPUs' engines): at ~38k tokens/s
a cap of 16 instead of 8 took the router from ~14.5 to ~10.6 us of CPU per token.
"""

from __future__ import annotations

import math

RATE_WINDOW_S = 0.25
# The adaptive pacing's defaults (RouterConfig's --stream-* flags take theirs from here).
DEFAULT_MESSAGE_BUDGET = 1500.0  # responses per second
DEFAULT_MAX_INTERVAL = 16  # tokens per response
DEFAULT_MAX_HOLD_S = 0.25


class StreamPacing:
    """The router-wide tokens-per-response setting that every request reads after each send."""

    def __init__(
        self,
        fixed_interval: int = 0,
        *,
        message_budget: float = DEFAULT_MESSAGE_BUDGET,
        max_interval: int = DEFAULT_MAX_INTERVAL,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
    ) -> None:
        if fixed_interval < 0 or max_interval < 1 or message_budget <= 0 or max_hold_s <= 0:
            raise ValueError("pacing needs fixed_interval >= 0, max_interval >= 1, budget > 0")
        self.adaptive = fixed_interval == 0
        self.interval = 1 if self.adaptive else fixed_interval
        self.message_budget = message_budget
        self.max_interval = max_interval
        self.max_hold_s = max_hold_s
        self.tokens_per_s = 0.0
        self._window_start: float | None = None
        self._window_tokens = 0

    @classmethod
    def fixed(cls, interval: int) -> StreamPacing:
        if interval < 1:
            raise ValueError(f"a fixed stream interval must be >= 1, got {interval}")
        return cls(interval)

    def observe(self, tokens: int, now: float) -> None:
        """`tokens` were streamed at `now` (time.monotonic()); updates the interval per window."""
        if not self.adaptive:
            return
        start = self._window_start
        if start is None:
            self._window_start = now
            self._window_tokens = tokens
            return
        self._window_tokens += tokens
        if now - start >= RATE_WINDOW_S:
            self._close_window(now)

    def idle(self, now: float) -> None:
        """Called by the periodic sweep: a window with no tokens at all brings the rate down."""
        start = self._window_start
        if self.adaptive and start is not None and now - start >= 2 * RATE_WINDOW_S:
            self._close_window(now)

    def _close_window(self, now: float) -> None:
        """The window's token rate sets the interval; a new window starts at `now`."""
        rate = self._window_tokens / (now - self._window_start)
        self.tokens_per_s = rate
        wanted = math.ceil(rate / self.message_budget) if rate > 0 else 1
        self.interval = max(1, min(self.max_interval, wanted))
        self._window_start = now
        self._window_tokens = 0
