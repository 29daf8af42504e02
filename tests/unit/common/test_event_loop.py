"""The event loop every Sluice process runs: uvloop when installed, asyncio's on request."""

from __future__ import annotations

import asyncio

import pytest

from services.common import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")  # a dependency on Linux; absent e.g. on the GPU machine
    monkeypatch.delenv("SLUICE_EVENT_LOOP", raising=False)
    assert event_loop.use_uvloop()
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_choice_keeps_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_EVENT_LOOP", "asyncio")
    assert not event_loop.use_uvloop()
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_unknown_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_EVENT_LOOP", "tornado")
    with pytest.raises(ValueError, match="SLUICE_EVENT_LOOP"):
        event_loop.use_uvloop()
