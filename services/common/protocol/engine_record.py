"""An engine's entry in the shared worker registry: what it writes and what routers read.

Each engine publishes one `EngineRecord` — its gRPC address, model, capacity, current load and
resident LoRA adapters — as JSON under `ENGINE_KEY_PREFIX + engine_id` with a TTL. The engine
keeps it fresh (services/engine/registration.py); routers watch the keys
(services/router/registry.py). The record lives here because both sides must read and write the
same format without importing each other. Plain JSON; no torch, no Redis.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from services.common.errors import InvalidArgumentError

ENGINE_KEY_PREFIX = "sluice:engines:"


@dataclass(frozen=True)
class EngineRecord:
    """What routers need to know to place work on one engine."""

    engine_id: str
    address: str
    model: str
    max_model_len: int = 0
    block_size: int = 0
    num_blocks: int = 0
    max_num_seqs: int = 0
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    resident_adapters: tuple[str, ...] = ()
    backend: str = ""
    device: str = ""
    pid: int = 0
    started_at: float = 0.0
    updated_at: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.engine_id or not isinstance(self.engine_id, str):
            raise InvalidArgumentError("engine_id must be a non-empty string")
        if ":" not in self.address:
            raise InvalidArgumentError(f"address must be host:port, got {self.address!r}")

    @property
    def key(self) -> str:
        return ENGINE_KEY_PREFIX + self.engine_id

    def to_json(self) -> str:
        data = asdict(self)
        data["resident_adapters"] = list(self.resident_adapters)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> EngineRecord:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise InvalidArgumentError("engine record must be a JSON object")
        known = {name for name in cls.__dataclass_fields__}
        values = {name: value for name, value in data.items() if name in known}
        values["resident_adapters"] = tuple(values.get("resident_adapters") or ())
        values["extra"] = dict(values.get("extra") or {})
        return cls(**values)
