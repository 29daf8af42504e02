"""AdapterRecord: a registered adapter as the registry keeps it, and the rule for its name.

Plain data (no tensors), so policy code (the adapter manager, the scheduler's gate) can hold
records. `loader.inspect_adapter` makes one after validating the files completely; loads
re-resolve its path and verify its checksum against the bytes they parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError

MAX_ADAPTER_NAME_CHARS = 128
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:]*$")


@dataclass(frozen=True)
class AdapterRecord:
    """A registered adapter: where it is and what it is (the fields of sluice.v1.AdapterSpec)."""

    name: str
    path: str  # as registered (resolved again under the root at every load)
    sha256: str  # over adapter_config.json and adapter_model.safetensors (paths.checksum_of)
    rank: int
    target_modules: tuple[str, ...]  # the PEFT modules it adapts (q_proj, ..., down_proj)

    @property
    def key(self) -> tuple[str, str]:
        """Identity of these exact files: a re-registration under the same name is another key."""
        return (self.name, self.sha256)


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
