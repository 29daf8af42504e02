"""Tuned kernel choices kept on disk, so a restart on the same GPU skips the tuning.

The CUDA fast path times each projection's candidate kernels against cuBLAS at start (seconds
per model). The winner depends only on the GPU, the model's matrix shapes, the dtype and the
kernel code, so it is written once under the engine's cache directory
(`services.common.env.cache_dir()`/tuning/) as JSON, in a file named by a hash of exactly those
things: another GPU, shape, dtype or kernel version reads another file (or none) and tunes
afresh. A file that cannot be read or parsed is ignored and rewritten. Plain Python.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common.env import cache_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def tuning_key(
    *, device_name: str, model_shape: Mapping[str, Any], dtype: str, code_version: str
) -> str:
    """A short hash naming one GPU x model shape x dtype x kernel-code combination."""
    text = json.dumps(
        {
            "format": FORMAT_VERSION,
            "device": device_name,
            "shape": dict(sorted(model_shape.items())),
            "dtype": dtype,
            "code": code_version,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def code_version(*paths: Path, extra: str = "") -> str:
    """A hash of the kernel sources (and library versions in `extra`) the choices depend on."""
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def tuning_path(key: str, root: str | os.PathLike[str] | None = None) -> Path:
    return Path(root if root is not None else cache_dir()) / "tuning" / f"{key}.json"


def load_choices(key: str, root: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The saved choices for `key`, or None when there are none (or the file is unreadable)."""
    path = tuning_path(key, root)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("ignoring unreadable tuning file %s: %s", path, error)
        return None
    if not isinstance(data, dict) or data.get("key") != key or "choices" not in data:
        logger.warning("ignoring tuning file %s: not a tuning record for this key", path)
        return None
    return data["choices"]


def save_choices(
    key: str,
    choices: Mapping[str, Any],
    *,
    about: Mapping[str, Any] | None = None,
    root: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Write `choices` (JSON-serialisable) atomically; None when the directory is not writable
    (serving goes on; the next start tunes again)."""
    path = tuning_path(key, root)
    record = {"key": key, "about": dict(about or {}), "choices": dict(choices)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            temporary = Path(f.name)
        temporary.replace(path)
    except OSError as error:
        logger.warning("could not save tuned choices to %s: %s", path, error)
        return None
    return path
