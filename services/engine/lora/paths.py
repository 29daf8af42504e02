"""Where adapter files may come from, and proof that they did not change since registration.

An adapter is registered by name with a path an operator supplied; requests only ever name it.
The path must be a local directory that resolves, after every symlink, inside `adapter_root`
(no URLs, no `..`, no link that leads out), and holds exactly the two files of the PEFT format
the engine reads: `adapter_config.json` and `adapter_model.safetensors`. Pickled weights
(`adapter_model.bin`) are never read. A SHA-256 over both files is recorded at registration and
compared, at load, with the bytes actually parsed, so a file swapped in between is caught.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from services.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_PATH_CHARS = 4096
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


def resolve_adapter_dir(path: str, adapter_root: str | Path | None) -> Path:
    """The real directory of an adapter given by `path` (absolute, or relative to the root).

    Raises InvalidArgumentError, with the reason, for a URL, a `..` component, a path that
    leads outside `adapter_root` after symlinks, or lacks the PEFT safetensors files;
    NotFoundError for a path that does not exist.
    """
    if adapter_root is None:
        raise FailedPreconditionError(
            "adapters are not enabled on this engine (no adapter root directory configured)"
        )
    if not isinstance(path, str) or not path.strip():
        raise InvalidArgumentError("adapter path must be a non-empty string")
    if len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise InvalidArgumentError("adapter path is too long or contains a NUL character")
    if "://" in path or _SCHEME.match(path):
        raise InvalidArgumentError(f"adapter path {path!r} is a URL; only local paths are served")
    if ".." in Path(path).parts:
        raise InvalidArgumentError(f"adapter path {path!r} may not contain '..'")
    root = Path(adapter_root).resolve()
    candidate = Path(path) if Path(path).is_absolute() else root / path
    try:
        directory = candidate.resolve(strict=True)
    except FileNotFoundError as exc:
        raise NotFoundError(f"adapter path {path!r} does not exist") from exc
    except (OSError, RuntimeError) as exc:  # a symlink loop, unreadable
        raise InvalidArgumentError(f"adapter path {path!r} does not exist") from exc
    _require_inside(directory, root, path)
    if not directory.is_dir():
        raise InvalidArgumentError(f"adapter path {path!r} is not a directory")
    for name in ADAPTER_FILES:
        file = directory / name
        if not file.exists():
            pickled = [other for other in PICKLE_FILES if (directory / other).exists()]
            hint = f" (found {pickled[0]}: pickled weights are never loaded)" if pickled else ""
            raise InvalidArgumentError(f"adapter {path!r} has no {name}{hint}")
        _require_inside(file.resolve(strict=True), root, f"{path}/{name}")
        if not file.resolve().is_file():
            raise InvalidArgumentError(f"adapter {path!r}: {name} is not a regular file")
    return directory


def _require_inside(resolved: Path, root: Path, shown: str) -> None:
    if not resolved.is_relative_to(root):
        raise InvalidArgumentError(
            f"adapter path {shown!r} resolves outside the adapter root directory"
        )


def read_adapter_files(directory: Path) -> dict[str, bytes]:
    """The bytes of both adapter files (read once: the checksum covers what is parsed)."""
    contents: dict[str, bytes] = {}
    for name in ADAPTER_FILES:
        try:
            contents[name] = (directory / name).read_bytes()
        except OSError as exc:
            raise FailedPreconditionError(f"cannot read adapter file {name}: {exc}") from exc
    return contents


def checksum_of(contents: dict[str, bytes]) -> str:
    """SHA-256 (hex) over the adapter files, each framed by its name and length."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        data = contents[name]
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def verify_checksum(contents: dict[str, bytes], expected: str, name: str) -> None:
    """Raise FailedPreconditionError if the files read differ from those registered."""
    actual = checksum_of(contents)
    if actual != expected:
        raise FailedPreconditionError(
            f"adapter {name!r} changed on disk since it was registered (sha256 {actual[:16]}… "
            f"!= registered {expected[:16]}…); register it again to serve the new files"
        )
