"""The `sluice` command: help is cheap, generate streams and reports errors, up/serve/bench wire
their arguments through. Uses the fake router of test_client.py (no model)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from services import cli
from tests.unit.test_client import fake_router


def test_help_is_fast_and_imports_no_heavy_modules() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from services import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--help'])\n"
        "print(sorted(m for m in ('torch', 'grpc', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["generate", "up"])
def test_subcommand_help_lists_its_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    flags = [
        "--target",
        "--chat",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--seed",
        "--stop",
        "--adapter",
        "--timeout-s",
    ]
    if command == "up":
        flags = [
            "--port",
            "--model",
            "--engines",
            "--host",
            "--api-keys-file",
            "--max-queued-requests",
            "--startup-timeout-s",
            "--stop-grace-s",
        ]
    for flag in flags:
        assert flag in text


def test_generate_streams_text(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_router() as (address, servicer):
        code = cli.dispatch(
            [
                "generate",
                "--target",
                address,
                "--max-tokens",
                "3",
                "--temperature",
                "0",
                "--top-p",
                "0.5",
                "--top-k",
                "4",
                "--seed",
                "9",
                "--stop",
                "a",
                "--stop",
                "b",
                "--adapter",
                "sql",
                "one two",
            ]
        )
    assert code == 0
    assert capsys.readouterr().out == "one two\n"
    params = servicer.requests[0].params
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (3, 0.0, 4, 9)
    assert params.top_p == pytest.approx(0.5)
    assert list(params.stop) == ["a", "b"]
    assert servicer.requests[0].adapter == "sql"
    assert not params.HasField("logprobs")


def test_generate_chat_sends_a_user_turn(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_router() as (address, servicer):
        code = cli.dispatch(
            ["generate", "--target", address, "--chat", "--system", "be brief", "hello there"]
        )
    assert code == 0
    turns = [(m.role, m.content) for m in servicer.requests[0].chat.messages]
    assert turns == [("system", "be brief"), ("user", "hello there")]
    assert capsys.readouterr().out == "be brief hello there\n"


def test_generate_error_format_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_router() as (address, _):
        code = cli.dispatch(["generate", "--target", address, "--max-tokens", "0", "hi"])
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "error: INVALID_ARGUMENT: max_tokens must be >= 1, got 0\n"


def test_generate_value_protobuf_cannot_hold_is_invalid(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.dispatch(["generate", "--target", "127.0.0.1:1", "--max-tokens", "-1", "hi"])
    assert code == 1
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: ")


def test_serve_and_bench_hand_over_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, list[str]] = {}
    fake_service = types.ModuleType("fake_service")
    fake_service.main = lambda argv: seen.setdefault("serve", argv) and 3
    fake_bench = types.ModuleType("loadtest.cli")
    fake_bench.main = lambda argv: seen.setdefault("bench", argv) and None
    monkeypatch.setitem(sys.modules, "fake_service", fake_service)
    monkeypatch.setitem(sys.modules, "loadtest.cli", fake_bench)
    monkeypatch.setitem(cli.SERVICES, "engine", "fake_service")
    assert cli.dispatch(["serve", "engine", "--port", "1", "--help"]) == 3
    assert seen["serve"] == ["--port", "1", "--help"]
    assert cli.dispatch(["bench", "run", "--rate", "5"]) == 0
    assert seen["bench"] == ["run", "--rate", "5"]


@pytest.fixture
def stack_configs(monkeypatch: pytest.MonkeyPatch) -> list:
    """`sluice up` against a fake Stack: the StackConfigs it was given, in order."""
    import services.launcher as launcher

    configs: list[launcher.StackConfig] = []

    class FakeStack:
        router_address = "127.0.0.1:6000"
        engine_addresses = ()

        def __init__(self, config: launcher.StackConfig) -> None:
            configs.append(config)

        def start(self) -> FakeStack:
            return self

        def run_until_signal(self, announce) -> int:  # noqa: ANN001
            announce("stopped")
            return 0

    monkeypatch.setattr(launcher, "Stack", FakeStack)
    return configs


def test_up_builds_the_stack_config(
    stack_configs: list, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.dispatch(
        [
            "up",
            "--port",
            "6000",
            "--model",
            "dummy:tiny",
            "--engines",
            "2",
            "--max-queued-requests",
            "7",
            "--kv-cache-bytes",
            "1000",
            "--target-step-ms",
            "40",
            "--kv-cache-dtype",
            "fp8",
            "--shutdown-grace-s",
            "3",
            "--stop-grace-s",
            "7.5",
            "--engine-args",
            "--max-model-len 256",
        ]
    )
    assert code == 0
    config = stack_configs[0]
    assert (config.port, config.model, config.engines) == (6000, "dummy:tiny", 2)
    assert config.router_args == ("--max-queued-requests", "7", "--shutdown-grace-s", "3")
    assert config.stop_grace_s == 7.5
    assert config.engine_args == (
        "--kv-cache-bytes",
        "1000",
        "--target-step-ms",
        "40.0",
        "--kv-cache-dtype",
        "fp8",
        "--max-model-len",
        "256",
    )
    assert capsys.readouterr().out == "Sluice router ready at 127.0.0.1:6000\n"


def test_up_rejects_bad_engine_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.dispatch(["up", "--engines", "0"]) == 1
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: engines must be >= 1")


def test_up_passes_http_port_to_the_router(
    stack_configs: list, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.dispatch(["up", "--port", "6000", "--http-port", "8000"]) == 0
    assert stack_configs[0].router_args == ("--http-port", "8000")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "Sluice router ready at 127.0.0.1:6000",
        "OpenAI-compatible HTTP at http://127.0.0.1:8000/v1",
    ]
    assert cli.dispatch(["up", "--port", "6000"]) == 0
    assert "--http-port" not in stack_configs[1].router_args
    assert capsys.readouterr().out == "Sluice router ready at 127.0.0.1:6000\n"
