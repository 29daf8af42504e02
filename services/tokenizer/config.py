"""The tokenizer service's configuration: one frozen, validated dataclass.

Filled from flags, then `SLUICE_*` environment variables, then these defaults (see
services/common/config.py). The limits bound the memory and CPU one caller can take: the number
of live requests per DetokenizeSession stream, the stop strings per request, and the size of a
Tokenize batch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.config import add_arguments, field, from_layers
from services.common.errors import InvalidArgumentError
from services.common.tracing import TracingConfig


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer to load, where to listen, and the per-caller limits."""

    model: str | None = field(
        None, help="model: None = default SmolLM2-135M, an HF dir, a .gguf file, or dummy:<shape>"
    )
    host: str = field("127.0.0.1", help="address to listen on")
    port: int = field(50052, help="port to listen on (0 picks a free one)")
    max_requests_per_session: int = field(
        4096, help="live requests one DetokenizeSession stream may hold; more get an item error"
    )
    max_stop_strings: int = field(16, help="stop strings one request may give")
    max_stop_length: int = field(256, help="longest stop string, in characters")
    max_batch_items: int = field(1024, help="items one Tokenize call may carry")
    max_text_chars: int = field(4_000_000, help="longest text (or rendered chat) to encode")
    tokenize_threads: int = field(2, help="threads that encode Tokenize batches")
    shutdown_grace_s: float = field(5.0, help="seconds open calls may take to finish on SIGTERM")
    log_level: str = field("INFO", help="logging level")

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise InvalidArgumentError("model must be a non-empty string or None")
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port must be in 0..65535, got {self.port}")
        if not self.host:
            raise InvalidArgumentError("host must not be empty")
        for name in (
            "max_requests_per_session",
            "max_stop_strings",
            "max_stop_length",
            "max_batch_items",
            "max_text_chars",
            "tokenize_threads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        if self.shutdown_grace_s < 0:
            raise InvalidArgumentError(
                f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}"
            )

    @property
    def address(self) -> str:
        """host:port for the server to bind."""
        return f"{self.host}:{self.port}"

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> TokenizerConfig:
        """Parse `--flags` (then environment, then defaults) into a config."""
        return settings_from_argv(argv)[0]


def settings_from_argv(argv: Sequence[str] | None = None) -> tuple[TokenizerConfig, TracingConfig]:
    """What `sluice serve tokenizer` reads: its config and the process's tracing settings."""
    parser = argparse.ArgumentParser(
        prog="sluice serve tokenizer", description="Sluice tokenizer/detokenizer service"
    )
    add_arguments(parser, TokenizerConfig)
    add_arguments(parser, TracingConfig)
    args = parser.parse_args(list(argv) if argv is not None else None)
    return from_layers(TokenizerConfig, args), from_layers(TracingConfig, args)
