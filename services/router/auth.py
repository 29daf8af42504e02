"""API keys: who may call the router.

Keys come from `--api-keys-file` (one per line; blank lines and `#` comments ignored). A caller
sends `authorization: Bearer <key>` or `x-api-key: <key>` metadata. Without a keys file the
router is open. Keys are compared in constant time; only their SHA-256 digests are kept.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from services.common.errors import FailedPreconditionError, UnauthenticatedError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeyAuthenticator:
    """Checks request metadata against a set of keys; an empty set allows everyone."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = [_digest(k) for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @classmethod
    def from_file(cls, path: str | None) -> ApiKeyAuthenticator:
        if not path:
            return cls()
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise FailedPreconditionError(f"cannot read the API keys file {path}: {exc}") from exc
        keys = [line.strip() for line in text.splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise FailedPreconditionError(f"the API keys file {path} holds no keys")
        return cls(keys)

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Raise UnauthenticatedError unless the metadata carries a known key."""
        if not self._digests:
            return
        key = extract_key(metadata)
        if key is None:
            raise UnauthenticatedError(
                "missing API key: send 'authorization: Bearer <key>' or 'x-api-key' metadata"
            )
        digest = _digest(key)
        # Compare against every key so timing does not reveal which prefix matched.
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        if not matched:
            raise UnauthenticatedError("invalid API key")


def extract_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key from `authorization: Bearer <key>` or `x-api-key`, or None."""
    for name, value in metadata or ():
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        lowered = name.lower()
        if lowered == "x-api-key" and value.strip():
            return value.strip()
        if lowered == "authorization":
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None
