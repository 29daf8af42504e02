"""RouterConfig layering/validation and protobuf conversions."""

from __future__ import annotations

import pytest

from protos.sluice.v1 import common_pb2
from services.common.errors import InvalidArgumentError
from services.engine.sampling_params import SamplingParams
from services.router.config import RouterConfig
from services.router.convert import response_pb, sampling_params_from_pb, sampling_params_to_pb
from services.router.request import OutputPiece


def test_config_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_MAX_QUEUED_REQUESTS", "7")
    config = RouterConfig.from_argv(["--engines", "127.0.0.1:1,127.0.0.1:2", "--port", "0"])
    assert config.engines == ("127.0.0.1:1", "127.0.0.1:2")
    assert config.max_queued_requests == 7
    assert config.port == 0


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
        {"grace": -1.0},
        {"reconnect_min_backoff": 2.0, "reconnect_max_backoff": 1.0},
    ],
)
def test_config_rejects_bad_values(fields: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        RouterConfig(**fields)


def test_unset_params_take_defaults_and_round_trip() -> None:
    params = sampling_params_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams()
    given = SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.5, seed=3, stop=("x",), logprobs=2
    )
    assert sampling_params_from_pb(sampling_params_to_pb(given)) == given


def test_bad_params_raise_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="top_p"):
        sampling_params_from_pb(common_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        sampling_params_from_pb(common_pb2.SamplingParams(max_tokens=0))


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
