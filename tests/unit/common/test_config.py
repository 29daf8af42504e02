"""Layered configuration: flag beats environment beats default; secrets masked when printed."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from services.common.config import add_arguments, bool_setting, describe, field, from_layers
from services.common.errors import InvalidArgumentError


@dataclass(frozen=True)
class _Example:
    port: int = field(50051, help="port")
    ratio: float = field(0.5, help="ratio")
    verbose: bool = field(False, help="talk more")
    names: tuple[str, ...] = field(default_factory=tuple, help="names")
    redis_password: str | None = field(None, help="secret")
    max_num_batched_tokens: int = field(2048, help="budget")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, _Example)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_PORT", "6000")
    monkeypatch.setenv("SLUICE_RATIO", "0.25")
    config = from_layers(_Example, _parse(["--port", "7000", "--verbose", "--names", "a,b"]))
    assert config.port == 7000  # flag
    assert config.ratio == 0.25  # environment
    assert config.verbose is True
    assert config.names == ("a", "b")
    assert from_layers(_Example, _parse([])).max_num_batched_tokens == 2048  # default


def test_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_PORT", "not-a-number")
    with pytest.raises(InvalidArgumentError, match="port"):
        from_layers(_Example, _parse([]))


def test_describe_masks_only_secrets() -> None:
    text = describe(_Example(redis_password="hunter2"))
    assert "hunter2" not in text
    assert "redis_password = '***'" in text
    assert "max_num_batched_tokens = 2048" in text


def test_a_boolean_setting_reads_the_flag_words_and_refuses_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLUICE_SOME_SWITCH", raising=False)
    assert bool_setting("some_switch", True) is True
    for raw, expected in (("off", False), ("0", False), ("Yes", True), (" 1 ", True)):
        monkeypatch.setenv("SLUICE_SOME_SWITCH", raw)
        assert bool_setting("some_switch", not expected) is expected
    monkeypatch.setenv("SLUICE_SOME_SWITCH", "maybe")
    with pytest.raises(InvalidArgumentError, match="SLUICE_SOME_SWITCH"):
        bool_setting("some_switch", True)
