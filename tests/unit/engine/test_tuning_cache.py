"""Tuned kernel choices persist per GPU, model shape, dtype and kernel code."""

from __future__ import annotations

from pathlib import Path

from services.engine import tuning_cache

SHAPE = {"hidden_size": 4096, "num_layers": 32}


def key(**changes) -> str:
    fields = {"device_name": "NVIDIA H100 80GB HBM3", "model_shape": SHAPE, "dtype": "bfloat16"}
    fields.update(changes)
    return tuning_cache.tuning_key(code_version=fields.pop("code_version", "v1"), **fields)


def test_key_changes_with_each_part_and_not_otherwise():
    base = key()
    assert base == key()
    assert base != key(device_name="NVIDIA H200")
    assert base != key(model_shape={**SHAPE, "num_layers": 16})
    assert base != key(dtype="float16")
    assert base != key(code_version="v2")


def test_choices_round_trip_and_stay_apart(tmp_path: Path):
    choices = {"qkv:1": [4, 1024, 4, 3, "rows"], "down:8": [16, 512, 4, 4]}
    path = tuning_cache.save_choices(key(), choices, about={"device": "x"}, root=tmp_path)
    assert path is not None and path.is_file()
    assert tuning_cache.load_choices(key(), root=tmp_path) == choices
    assert tuning_cache.load_choices(key(dtype="float16"), root=tmp_path) is None


def test_a_corrupt_or_foreign_file_is_ignored(tmp_path: Path):
    path = tuning_cache.tuning_path(key(), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning_cache.load_choices(key(), root=tmp_path) is None
    path.write_text('{"key": "someone-else", "choices": {}}')
    assert tuning_cache.load_choices(key(), root=tmp_path) is None
    tuning_cache.save_choices(key(), {"qkv:1": [1]}, root=tmp_path)  # rewritten
    assert tuning_cache.load_choices(key(), root=tmp_path) == {"qkv:1": [1]}


def test_code_version_follows_the_source(tmp_path: Path):
    source = tmp_path / "kernel.py"
    source.write_text("A = 1\n")
    first = tuning_cache.code_version(source, extra="triton 3")
    source.write_text("A = 2\n")
    assert tuning_cache.code_version(source, extra="triton 3") != first
    assert tuning_cache.code_version(source, extra="triton 4") != tuning_cache.code_version(
        source, extra="triton 3"
    )


def test_an_unwritable_cache_is_not_fatal(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert tuning_cache.save_choices(key(), {"a:1": [1]}, root=blocker) is None
