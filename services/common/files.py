"""Small file helpers every cache shares: an exclusive lock around a build, and a file's sha256.

The converted default model (model_files.py) and the exported ONNX segments
(engine/backends/onnx_cache.py) are each built once per cache directory while other processes
may start at the same time: both take `file_lock` around the build and check what they built
with `sha256_of`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path

_CHUNK_BYTES = 1 << 22


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the `with` block."""
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
