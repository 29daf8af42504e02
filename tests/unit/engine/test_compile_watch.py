"""Kernels compiled after the warm-up are logged and counted."""

from __future__ import annotations

import logging

import pytest

from services.engine import compile_watch
from services.engine.metrics import ENGINE_LATE_KERNEL_COMPILES

knobs = pytest.importorskip("triton").knobs


def test_a_late_compile_is_counted_and_logged(caplog):
    before = ENGINE_LATE_KERNEL_COMPILES._value.get()
    with caplog.at_level(logging.WARNING, logger="services.engine.compile_watch"):
        compile_watch.note_compile("_decode_split_kernel[num_warps=4](q: *bf16, n: i32)")
    assert ENGINE_LATE_KERNEL_COMPILES._value.get() == before + 1
    assert "_decode_split_kernel" in caplog.text and "warm-up did not cover" in caplog.text
    assert compile_watch.late_compiles()[-1][1].startswith("_decode_split_kernel")


def test_arm_installs_a_hook_that_chains_the_previous_one(monkeypatch):
    seen = []

    def previous(**kwargs):
        seen.append(kwargs["repr"])
        return False

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", previous)
    monkeypatch.setattr(compile_watch, "_armed", False)
    before = ENGINE_LATE_KERNEL_COMPILES._value.get()
    assert compile_watch.arm() and compile_watch.arm()  # the second call changes nothing
    hook = knobs.runtime.jit_cache_hook
    assert hook is not previous
    # Triton calls the hook with keywords; a false answer lets the compile go ahead.
    assert (
        hook(key=None, repr="k[...](x: *fp32)", fn=None, compile={}, already_compiled=False)
        is False
    )
    assert seen == ["k[...](x: *fp32)"]
    assert ENGINE_LATE_KERNEL_COMPILES._value.get() == before + 1
