"""The committed stubs are exactly what protos/generate.py produces from the .proto files."""

from __future__ import annotations

import re
from pathlib import Path

from protos import generate


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    produced = sorted((tmp_path / generate.PROTO_DIR).glob("*_pb2*.py*"))
    assert produced, "protoc produced nothing"
    for fresh in produced:
        committed = generate.ROOT / generate.PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} is missing: run python -m protos.generate"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python -m protos.generate"
        )


def test_every_field_and_enum_is_documented() -> None:
    for proto in (generate.ROOT / generate.PROTO_DIR).glob("*.proto"):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            is_field = re.match(r"^(optional |repeated )?[\w.]+ \w+ = \d+;", stripped)
            is_rpc = stripped.startswith("rpc ")
            if is_field or is_rpc:
                previous = lines[number - 1].strip()
                assert previous.startswith("//"), f"{proto.name}:{number + 1} lacks a comment"
        for enum_body in re.findall(r"enum (\w+) \{(.*?)\}", proto.read_text(), re.S):
            name, body = enum_body
            first = re.search(r"(\w+) = 0;", body)
            assert first and first.group(1).endswith("_UNSPECIFIED"), (
                f"{name} must start at *_UNSPECIFIED"
            )
