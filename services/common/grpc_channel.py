"""Options of every gRPC channel Sluice opens: to the router, the tokenizer and engines.

One place, so clients and the router agree. Besides message sizes (a batched engine step for
many sequences can be large), the channel's own reconnect backoff is kept short: gRPC's default
waits up to 120 s between attempts to reach a peer that went away, and a call made meanwhile
fails at once without trying. A restarted peer on loopback or in a cluster answers within a
second or two, so attempts every 0.1-1 s let traffic resume as soon as it does.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
