"""The LM-head micro-benchmark runs and prints one row of figures per row count."""

from __future__ import annotations

import pytest

from benchmarks import cpu_head_bench
from services.engine.kernels.cpu.cpu_native import cpu_kernels


def test_prints_a_row_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_greedy_head:
        pytest.skip("needs the native CPU kernels with AVX-512 BF16 (the bench refuses without)")
    argv = ["--rows", "1,9", "--hidden", "24", "--vocab", "100", "--threads", "1", "--repeats", "1"]
    assert cpu_head_bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "9"]
    assert all(len(row) == 5 and all(float(value) > 0 for value in row[1:]) for row in rows)
