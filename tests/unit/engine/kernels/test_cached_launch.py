"""CachedLaunch: the JIT path once per specialization, the compiled launcher after that."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.triton import launch


class FakeCompiled:
    function = "fn"
    packed_metadata = "meta"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *args) -> None:
        self.log.append(("direct", args))


class FakeKernel:
    """A @triton.jit function's face: arg_names and kernel[grid](...) returning the compiled."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def run(*args, **named):
            self.log.append(("jit", grid, args, named))
            return FakeCompiled(self.log)

        return run


class FakeDriver:
    class active:  # noqa: N801 - the shape of triton.runtime.driver.active
        @staticmethod
        def get_current_stream(device):
            return f"stream{device}"


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launch, "driver", FakeDriver)
    return FakeKernel()


def test_a_second_launch_of_the_same_specialization_skips_the_jit(kernel) -> None:
    cached = launch.CachedLaunch(kernel)
    x = torch.zeros(8)
    cached((4,), x, 32, BLOCK=16, num_warps=4)
    cached((6, 2), x, 48, BLOCK=16, num_warps=4)  # 48: still a multiple of 16, not 1
    assert [entry[0] for entry in kernel.log] == ["jit", "direct"]
    _, args = kernel.log[1]
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter
    assert args == (6, 2, 1, "stream-1", "fn", "meta", None, None, None, x, 48, 16)
    assert cached.direct_launches == 1


@pytest.mark.parametrize(
    "other",
    [
        {"n": 1},  # Triton turns 1 into a constant
        {"n": 33},  # no longer a multiple of 16
        {"n": 2**31},  # past int32
        {"x": torch.zeros(8, dtype=torch.float16)},  # another dtype
        {"x": torch.zeros(9)[1:]},  # an address not 16-byte aligned
        {"block": 32},  # another constexpr
        {"n": True},  # a bool where an int was
        {"n": 32.0},  # a float where an int was
    ],
)
def test_anything_triton_specializes_on_takes_the_jit_path_again(kernel, other) -> None:
    cached = launch.CachedLaunch(kernel)
    x = torch.zeros(8)
    cached((4,), x, 32, BLOCK=16)
    cached((4,), other.get("x", x), other.get("n", 32), BLOCK=other.get("block", 16))
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


def test_one_true_and_one_point_zero_are_three_specializations(kernel) -> None:
    """Equal in Python, not to Triton: each keeps its own compiled kernel."""
    cached = launch.CachedLaunch(kernel)
    x = torch.zeros(8)
    for value in (1, True, 1.0, 1, True, 1.0):
        cached((4,), x, value, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["jit"] * 3 + ["direct"] * 3
    assert [entry[1][-2] for entry in kernel.log[3:]] == [1, True, 1.0]
    assert [type(entry[1][-2]) for entry in kernel.log[3:]] == [int, bool, float]


def test_switched_off_or_hooked_launches_take_the_jit_path(kernel, monkeypatch) -> None:
    cached = launch.CachedLaunch(kernel)
    x = torch.zeros(8)
    cached((4,), x, 32, BLOCK=16)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    cached((4,), x, 32, BLOCK=16)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    hooks = launch.knobs.runtime.launch_enter_hook  # a chain of hooks, empty by default
    monkeypatch.setattr(hooks, "calls", [lambda *_: None])  # a profiler's
    cached((4,), x, 32, BLOCK=16)
    monkeypatch.setattr(launch.knobs.runtime, "launch_exit_hook", lambda *_: None)
    monkeypatch.setattr(hooks, "calls", [])
    cached((4,), x, 32, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit", "jit"]


@pytest.mark.parametrize(
    ("capability", "setting", "expected"),
    [
        ((9, 0), None, {"USE_PDL": True, "launch_pdl": True}),  # Hopper
        ((10, 0), "1", {"USE_PDL": True, "launch_pdl": True}),
        ((8, 0), None, {"USE_PDL": False}),  # Ampere: no programmatic dependent launch
        ((9, 0), "0", {"USE_PDL": False}),  # turned off
    ],
)
def test_kernels_launch_dependent_on_hopper_unless_turned_off(
    monkeypatch, capability, setting, expected
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    if setting is None:
        monkeypatch.delenv("SLUICE_PDL", raising=False)
    else:
        monkeypatch.setenv("SLUICE_PDL", setting)
    launch._pdl_supported.cache_clear()
    try:
        assert launch.pdl_options(torch.device("cuda", 0)) == expected
        assert launch.pdl_options(torch.device("cpu")) == {"USE_PDL": False}
    finally:
        launch._pdl_supported.cache_clear()
