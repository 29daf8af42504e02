"""The adapter load benchmark end to end on tiny shapes: every burst loads every adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import lora_load_bench


def test_a_burst_per_setting_is_timed_against_the_first(tmp_path: Path) -> None:
    out = tmp_path / "lora-load.json"
    argv = ["--model", "dummy:tiny", "--adapters", "3", "--rank", "4", "--workers", "1,3"]
    assert (
        lora_load_bench.main([*argv, "--repeats", "2", "--device", "cpu", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert report["adapters"] == 3 and report["bytes_each"] > 0
    assert report["command"].startswith("python -m benchmarks.lora_load_bench --model dummy:tiny")
    first, second = report["results"]
    assert (first["workers"], second["workers"]) == (1, 3)
    assert first["over_baseline"] == 1.0
    assert all(len(row["seconds"]) == 2 and min(row["seconds"]) > 0 for row in (first, second))


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit):
        lora_load_bench.main(["--workers", "0"])
