"""API keys: bearer and x-api-key accepted, missing or wrong keys rejected, no keys = open."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import FailedPreconditionError, UnauthenticatedError
from services.router.auth import ApiKeyAuthenticator, extract_key


def test_open_without_keys() -> None:
    auth = ApiKeyAuthenticator()
    assert not auth.enabled
    auth.check(())
    auth.check(None)


def test_accepts_bearer_and_x_api_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nalpha\n\n beta \n")
    auth = ApiKeyAuthenticator.from_file(str(keys))
    auth.check((("authorization", "Bearer alpha"),))
    auth.check((("x-api-key", "beta"),))
    auth.check((("Authorization", b"bearer beta"),))


def test_rejects_missing_and_wrong_keys() -> None:
    auth = ApiKeyAuthenticator(["alpha"])
    with pytest.raises(UnauthenticatedError, match="missing"):
        auth.check((("user-agent", "x"),))
    with pytest.raises(UnauthenticatedError, match="invalid"):
        auth.check((("authorization", "Bearer alphb"),))
    with pytest.raises(UnauthenticatedError, match="missing"):
        auth.check((("authorization", "Basic alpha"),))
    with pytest.raises(UnauthenticatedError):
        auth.check((("x-api-key", "# comment"),))


def test_bad_keys_file(tmp_path: Path) -> None:
    with pytest.raises(FailedPreconditionError):
        ApiKeyAuthenticator.from_file(str(tmp_path / "absent"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(FailedPreconditionError):
        ApiKeyAuthenticator.from_file(str(empty))


def test_extract_key_prefers_first_valid_header() -> None:
    assert extract_key((("x-api-key", "  k1 "),)) == "k1"
    assert extract_key((("authorization", "Bearer   "),)) is None
