"""RouterConfig layering/validation and the router's own protobuf conversions."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.router.config import RouterConfig
from services.router.convert import response_pb
from services.router.request import OutputPiece


def test_config_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_QUEUED_REQUESTS", "7")
    config = RouterConfig.from_argv(["--engines", "127.0.0.1:1,127.0.0.1:2", "--port", "0"])
    assert config.engines == ("127.0.0.1:1", "127.0.0.1:2")
    assert config.max_queued_requests == 7
    assert config.port == 0


def test_duration_flags_and_environment_carry_their_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_TOKENIZE_TIMEOUT_S", "4.5")
    config = RouterConfig.from_argv(
        ["--shutdown-grace-s", "3", "--retry-after-s", "0.25", "--reconnect-max-backoff-s", "2"]
    )
    assert config.shutdown_grace_s == 3.0
    assert config.retry_after_s == 0.25
    assert config.tokenize_timeout_s == 4.5
    assert config.reconnect_max_backoff_s == 2.0
    with pytest.raises(SystemExit):  # the unitless spelling is gone, not silently ignored
        RouterConfig.from_argv(["--grace", "3"])


@pytest.mark.parametrize(
    "fields",
    [
        {"engines": ()},
        {"engines": ("nohost",)},
        {"tokenizer": "x:99999"},
        {"max_queued_requests": 0},
        {"max_queued_tokens": -1},
        {"stream_interval": -1},
        {"stream_max_interval": 0},
        {"stream_message_budget": 0.0},
        {"stream_max_hold_ms": float("nan")},
        {"shutdown_grace_s": -1.0},
        {"retry_after_s": float("inf")},
        {"tokenize_timeout_s": -0.5},
        {"reconnect_min_backoff_s": 2.0, "reconnect_max_backoff_s": 1.0},
    ],
)
def test_config_rejects_bad_values(fields: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        RouterConfig(**fields)


def test_response_sets_usage_only_on_the_last_piece() -> None:
    middle = response_pb(OutputPiece(text="a", token_ids=[1]), "id")
    assert not middle.HasField("usage") and middle.finish_reason == 0
    last = response_pb(
        OutputPiece(
            text="b",
            token_ids=[2],
            finish_reason=3,
            matched_stop="b",
            completion_tokens=2,
            prompt_tokens=4,
        ),
        "id",
    )
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 2)
    assert last.matched_stop == "b" and last.request_id == "id"


def test_router_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, services.router.server, services.router.core; "
        "sys.exit(int(any(m in sys.modules for m in ('torch', 'transformers'))))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
