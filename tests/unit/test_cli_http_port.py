"""`sluice up --http-port` hands the port to the router and prints the OpenAI base URL."""

from __future__ import annotations

import pytest

from services import cli


def test_up_passes_http_port_to_the_router(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import services.launcher as launcher

    configs: list[launcher.StackConfig] = []

    class FakeStack:
        router_address = "127.0.0.1:6000"

        def __init__(self, config: launcher.StackConfig) -> None:
            configs.append(config)

        def start(self) -> FakeStack:
            return self

        def run_until_signal(self, announce) -> int:  # noqa: ANN001
            return 0

    monkeypatch.setattr(launcher, "Stack", FakeStack)
    assert cli.dispatch(["up", "--port", "6000", "--http-port", "8000"]) == 0
    assert configs[0].router_args == ("--http-port", "8000")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "Sluice router ready at 127.0.0.1:6000",
        "OpenAI-compatible HTTP at http://127.0.0.1:8000/v1",
    ]
    assert cli.dispatch(["up", "--port", "6000"]) == 0
    assert "--http-port" not in configs[1].router_args
    assert capsys.readouterr().out == "Sluice router ready at 127.0.0.1:6000\n"
