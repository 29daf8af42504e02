"""The one place that reads the process environment.

Every setting can come from a flag, then an environment variable `SLUICE_<NAME>`, then a
default; config classes call `setting()` here instead of touching `os.environ`.
"""

from __future__ import annotations

import os

PREFIX = "SLUICE_"


def setting(name: str) -> str | None:
    """The value of SLUICE_<NAME> (name upper-cased, dashes as underscores), or None if unset."""
    key = PREFIX + name.upper().replace("-", "_")
    value = os.environ.get(key)
    return value if value not in (None, "") else None


def cache_dir() -> str:
    """Where converted models and other derived files live (SLUICE_CACHE_DIR or XDG cache)."""
    explicit = setting("cache_dir")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sluice")


def has_cuda_visible_devices() -> bool:
    """True unless CUDA_VISIBLE_DEVICES hides every GPU (used by Ray placement)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", None) != ""
