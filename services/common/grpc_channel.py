"""Options of every gRPC channel Sluice opens: to the router, the tokenizer and engines.

One place, so clients and the router agree. Besides message sizes (a batched engine step for
many sequences can be large), the channel's own reconnect backoff is kept short: gRPC's default
waits up to 120 s between attempts to reach a peer that went away, and a call made meanwhile
fails at once without trying. A restarted peer on loopback or in a cluster answers within a
second or two, so attempts every 0.1-1 s let traffic resume as soon as it does.
`open_channel` makes a channel with these options, traced on its client side when tracing is
switched on (services/common/tracing/).
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from services.common import tracing

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def open_channel(address: str) -> Any:
    """An insecure grpc.aio channel with CHANNEL_OPTIONS, traced when tracing is on."""
    return tracing.traced_channel(grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))


# Clients of the public Router service also retry a call that fails UNAVAILABLE before the
# router has answered anything (its process restarting, a connection refused): the call never
# started generating, so a retry is safe. Once the response headers arrive the call is
# committed and never retried; the router sends them as soon as it accepts the call.
_ROUTER_RETRY = {
    "methodConfig": [
        {
            "name": [{"service": "sluice.v1.Router"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.2s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}
ROUTER_CLIENT_OPTIONS: tuple[tuple[str, int | str], ...] = (
    *CHANNEL_OPTIONS,
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(_ROUTER_RETRY)),
)
