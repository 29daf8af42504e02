"""A registered LoRA adapter as the router's registry keeps it, and the rules for its name and path.

Routers store `AdapterRecord`s (JSON, one field per adapter in the Redis hash `sluice:adapters`)
and send one as `AdapterSpec` with every submit that names the adapter, so engines need no
registry of their own; an engine's `InspectAdapter` answers one at registration. The record and
its protobuf form live here because both sides read and write them. Names follow the rule of
router.proto (letters, digits, '-', '_', '.'; at most 128 characters); paths are relative to
the engines' `--adapter-root` and never URLs, absolute or `..` (the engine resolves symlinks and
checks the result again). Plain Python: no torch, no gRPC.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from protos.sluice.v1 import common_pb2
from services.common.errors import InvalidArgumentError

MAX_ADAPTER_NAME_CHARS = 128
MAX_ADAPTER_PATH_CHARS = 1024
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def validate_adapter_name(name: object) -> str:
    """The name as requests will send it; InvalidArgumentError with the rule otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("an adapter needs a non-empty name")
    if len(name) > MAX_ADAPTER_NAME_CHARS or not _NAME.match(name):
        raise InvalidArgumentError(
            f"adapter name {name[:MAX_ADAPTER_NAME_CHARS]!r} must be 1 to "
            f"{MAX_ADAPTER_NAME_CHARS} letters, digits, '-', '_' or '.', starting with a letter "
            "or digit"
        )
    return name


def validate_adapter_path(path: object) -> str:
    """A path relative to the adapter root; InvalidArgumentError for a URL, `..` or absolute."""
    if not isinstance(path, str) or not path.strip():
        raise InvalidArgumentError("an adapter needs a path relative to the engines' adapter root")
    if len(path) > MAX_ADAPTER_PATH_CHARS or "\x00" in path:
        raise InvalidArgumentError(
            f"adapter path must be at most {MAX_ADAPTER_PATH_CHARS} characters, without NUL"
        )
    if _URL.match(path):
        raise InvalidArgumentError(
            f"adapter path {path!r} is a URL; give a directory under the engines' adapter root"
        )
    pure = PurePosixPath(path.replace("\\", "/"))
    if pure.is_absolute() or path.startswith("~"):
        raise InvalidArgumentError(
            f"adapter path {path!r} must be relative to the engines' adapter root"
        )
    if ".." in pure.parts:
        raise InvalidArgumentError(f"adapter path {path!r} must not contain '..'")
    return path


@dataclass(frozen=True)
class AdapterRecord:
    """One registered adapter: its name, where it is, its checksum and what it adapts."""

    name: str
    path: str
    sha256: str
    rank: int
    target_modules: tuple[str, ...] = ()
    registered_at: float = field(default_factory=time.time, compare=False)

    @property
    def key(self) -> tuple[str, str]:
        """Identity of these exact files: a re-registration under the same name is another key
        (engines key their loaded weights and prefix cache by it)."""
        return (self.name, self.sha256)

    def __post_init__(self) -> None:
        validate_adapter_name(self.name)
        validate_adapter_path(self.path)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise InvalidArgumentError(f"adapter rank must be an integer >= 0, got {self.rank!r}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def to_pb(self) -> common_pb2.AdapterSpec:
        return common_pb2.AdapterSpec(
            name=self.name,
            path=self.path,
            sha256=self.sha256,
            rank=self.rank,
            target_modules=self.target_modules,
        )

    @classmethod
    def from_pb(cls, spec: common_pb2.AdapterSpec) -> AdapterRecord:
        """The record for an engine's answer (InvalidArgumentError for a bad name or path)."""
        return cls(
            name=spec.name,
            path=spec.path,
            sha256=spec.sha256,
            rank=spec.rank,
            target_modules=tuple(spec.target_modules),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "path": self.path,
                "sha256": self.sha256,
                "rank": self.rank,
                "target_modules": list(self.target_modules),
                "registered_at": self.registered_at,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> AdapterRecord:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgumentError(f"malformed adapter record: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidArgumentError("an adapter record must be a JSON object")
        try:
            return cls(
                name=data["name"],
                path=data["path"],
                sha256=str(data.get("sha256", "")),
                rank=int(data.get("rank", 0)),
                target_modules=tuple(data.get("target_modules") or ()),
                registered_at=float(data.get("registered_at", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"malformed adapter record: {exc}") from exc
