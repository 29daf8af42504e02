"""Adapter paths: only local directories under the adapter root; checksums catch changed files."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from services.engine.lora.paths import (
    checksum_of,
    read_adapter_files,
    resolve_adapter_dir,
    verify_checksum,
)


def _adapter(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text("{}")
    (directory / "adapter_model.safetensors").write_bytes(b"weights")
    return directory


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    _adapter(root / "team" / "sql")
    return root


def test_relative_and_absolute_paths_under_the_root_resolve(root: Path) -> None:
    expected = (root / "team" / "sql").resolve()
    assert resolve_adapter_dir("team/sql", root) == expected
    assert resolve_adapter_dir(str(root / "team" / "sql"), str(root)) == expected


def test_symlink_inside_the_root_is_followed(root: Path) -> None:
    (root / "alias").symlink_to(root / "team" / "sql")
    assert resolve_adapter_dir("alias", root) == (root / "team" / "sql").resolve()


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("team/../team/sql", "'..'"),
        ("../outside", "'..'"),
        ("https://example.com/adapter", "URL"),
        ("s3://bucket/adapter", "URL"),
        ("hf:org/adapter", "URL"),
        ("file:///etc", "URL"),
        ("", "non-empty"),
        ("team/\x00sql", "NUL"),
    ],
)
def test_refused_paths(root: Path, path: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError, match=reason):
        resolve_adapter_dir(path, root)


def test_missing_path_is_not_found(root: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        resolve_adapter_dir("team/missing", root)


def test_absolute_path_outside_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    outside = _adapter(tmp_path / "elsewhere")
    with pytest.raises(InvalidArgumentError, match="outside the adapter root"):
        resolve_adapter_dir(str(outside), root)


def test_directory_symlink_escaping_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    outside = _adapter(tmp_path / "elsewhere")
    (root / "escape").symlink_to(outside)
    with pytest.raises(InvalidArgumentError, match="outside the adapter root"):
        resolve_adapter_dir("escape", root)


def test_file_symlink_escaping_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    outside = _adapter(tmp_path / "elsewhere")
    inside = root / "mixed"
    inside.mkdir()
    (inside / "adapter_config.json").write_text("{}")
    (inside / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(InvalidArgumentError, match="outside the adapter root"):
        resolve_adapter_dir("mixed", root)


def test_pickled_weights_are_named_and_refused(root: Path) -> None:
    pickled = root / "old"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(InvalidArgumentError, match="adapter_model.bin: pickled weights"):
        resolve_adapter_dir("old", root)


def test_a_file_is_not_an_adapter(root: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        resolve_adapter_dir("team/sql/adapter_config.json", root)


def test_without_a_root_adapters_are_off(root: Path) -> None:
    with pytest.raises(FailedPreconditionError, match="not enabled"):
        resolve_adapter_dir("team/sql", None)


def test_checksum_covers_both_files_and_detects_a_change(root: Path) -> None:
    directory = root / "team" / "sql"
    contents = read_adapter_files(directory)
    checksum = checksum_of(contents)
    assert len(checksum) == 64
    verify_checksum(contents, checksum, "sql")
    (directory / "adapter_config.json").write_text('{"r": 8}')
    changed = read_adapter_files(directory)
    assert checksum_of(changed) != checksum
    with pytest.raises(FailedPreconditionError, match="changed on disk"):
        verify_checksum(changed, checksum, "sql")
    # Moving bytes between the two files changes the checksum too (each file is framed).
    moved = {
        "adapter_config.json": b"{}w",
        "adapter_model.safetensors": b"eights",
    }
    assert checksum_of(moved) != checksum
