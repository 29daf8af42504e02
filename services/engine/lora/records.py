"""Registering an adapter: the checks made once, and the record that later loads rely on.

`inspect_adapter` resolves the operator's path under the adapter root, reads both files, fully
parses and validates them against the base model (so a bad adapter is refused at registration,
with INVALID_ARGUMENT and the reason, never at a request's first token) and records their
SHA-256. The `AdapterRecord` is what the registry keeps: name, path, checksum, rank, modules.
Loads later re-resolve the path and verify the checksum against the bytes they parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import InvalidArgumentError
from services.engine.lora.loader import parse_adapter
from services.engine.lora.paths import checksum_of, read_adapter_files, resolve_adapter_dir
from services.engine.models.config import ModelConfig

MAX_ADAPTER_NAME_CHARS = 128
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:]*$")


@dataclass(frozen=True)
class AdapterRecord:
    """A registered adapter: where it is and what it is (plain data, JSON-friendly)."""

    name: str
    path: str  # as registered (resolved again under the root at every load)
    checksum: str  # SHA-256 over adapter_config.json and adapter_model.safetensors
    rank: int
    modules: tuple[str, ...]

    @property
    def key(self) -> tuple[str, str]:
        """Identity of these exact files: a re-registration under the same name is another key."""
        return (self.name, self.checksum)


def validate_adapter_name(name: object) -> str:
    """An adapter name as requests will send it; InvalidArgumentError otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("adapter name must be a non-empty string")
    if len(name) > MAX_ADAPTER_NAME_CHARS or not _NAME.match(name):
        raise InvalidArgumentError(
            f"adapter name {name[:MAX_ADAPTER_NAME_CHARS]!r} must be at most "
            f"{MAX_ADAPTER_NAME_CHARS} characters of letters, digits and . _ - / :, starting "
            "with a letter or digit"
        )
    return name


def inspect_adapter(
    name: str,
    path: str,
    *,
    adapter_root: str | Path | None,
    model_config: ModelConfig,
    max_rank: int,
) -> AdapterRecord:
    """Check an adapter completely and return its record (raises a SluiceError with the reason)."""
    validate_adapter_name(name)
    directory = resolve_adapter_dir(path, adapter_root)
    contents = read_adapter_files(directory)
    checksum = checksum_of(contents)
    weights = parse_adapter(
        name,
        contents,
        checksum,
        model_config=model_config,
        max_rank=max_rank,
        dtype=torch.float32,
    )
    return AdapterRecord(
        name=name,
        path=path,
        checksum=checksum,
        rank=weights.rank,
        modules=tuple(sorted(weights.modules)),
    )
