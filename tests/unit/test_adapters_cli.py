"""`sluice adapters add|list|remove` against a real router servicer over the fake engine, and
`sluice up --adapter-root` reaching the engines' flags."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services import cli
from tests.unit.router.test_adapter_admin import engine_with_adapters
from tests.unit.router.test_router_servicer import Stack, run_stack


def run_cli(*argv: str) -> int:
    return cli.dispatch(["adapters", *argv])


def test_add_list_remove_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    outputs: list[tuple[int, str, str]] = []

    async def check(stack: Stack) -> None:
        target = f"127.0.0.1:{stack.server.port}"

        async def call(*argv: str) -> None:
            code = await asyncio.to_thread(run_cli, *argv, "--target", target)
            captured = capsys.readouterr()
            outputs.append((code, captured.out, captured.err))

        await call("add", "support", "support/v1")
        await call("list")
        await call("add", "support", "legal")
        await call("add", "x", "../outside")
        await call("add", "x", "bad-shapes")
        await call("remove", "support")
        await call("remove", "support")
        await call("list")

    run_stack(check, engine=engine_with_adapters())
    added, listed, taken, traversal, shapes, removed, gone, empty = outputs
    assert added[0] == 0 and added[1].startswith("registered support (path support/v1, rank 16")
    assert listed[0] == 0 and "support" in listed[1] and "q_proj,v_proj" in listed[1]
    assert taken[:2] == (1, "") and taken[2].startswith("error: ALREADY_EXISTS: adapter 'support'")
    assert traversal[0] == 2 and traversal[2].startswith("error: INVALID_ARGUMENT:")
    assert "'..'" in traversal[2]
    assert shapes[0] == 2 and "576" in shapes[2]
    assert removed == (0, "removed support\n", "")
    assert gone[0] == 1 and gone[2].startswith("error: NOT_FOUND: unknown adapter 'support'")
    assert empty[0] == 0 and "support" not in empty[1]


def test_api_key_is_sent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-admin\n")
    codes: list[tuple[int, str]] = []

    async def check(stack: Stack) -> None:
        target = f"127.0.0.1:{stack.server.port}"
        for argv in (("list",), ("list", "--api-key", "sk-admin")):
            code = await asyncio.to_thread(run_cli, *argv, "--target", target)
            codes.append((code, capsys.readouterr().err))

    run_stack(check, engine=engine_with_adapters(), api_keys_file=str(keys))
    assert codes[0][0] == 1 and codes[0][1].startswith("error: UNAUTHENTICATED:")
    assert codes[1] == (0, "")


def test_unreachable_router_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("list", "--target", "127.0.0.1:1", "--timeout-s", "2") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE: cannot reach the router at 127.0.0.1:1")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli("add", "only-a-name")
    assert exit_info.value.code == 2


def test_up_passes_the_adapter_root_to_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import services.launcher as launcher

    configs: list[launcher.StackConfig] = []

    class FakeStack:
        router_address = "127.0.0.1:6000"
        engine_addresses: tuple[str, ...] = ()

        def __init__(self, config: launcher.StackConfig) -> None:
            configs.append(config)

        def start(self) -> FakeStack:
            return self

        def run_until_signal(self, announce) -> int:  # noqa: ANN001
            return 0

    monkeypatch.setattr(launcher, "Stack", FakeStack)
    monkeypatch.chdir(tmp_path)
    assert cli.dispatch(["up", "--no-ray", "--adapter-root", "adapters"]) == 0
    engine_args = configs[0].engine_args
    at = engine_args.index("--adapter-root")
    assert engine_args[at + 1] == str(tmp_path.resolve() / "adapters")
    assert "--adapter-root" not in configs[0].router_args
