"""The tokenize hop benchmark on a tiny run: both ways answer, and the report adds up."""

from __future__ import annotations

import re

import pytest

from benchmarks import tokenize_hop_bench

pytestmark = pytest.mark.slow


def test_tokenize_hop_bench_reports_both_ways_and_their_ratio(capsys) -> None:
    # Enough requests for /proc's 10 ms CPU tick to see the tokenizer's share of each way.
    argv = ["--requests", "100", "--rounds", "2", "--pause-ms", "0"]
    assert tokenize_hop_bench.main(argv) == 0
    out = capsys.readouterr().out
    rounds = re.findall(r"(call|session) round \d: round trip median ([\d.]+) ms", out)
    assert sorted(way for way, _ in rounds) == ["call", "call", "session", "session"]
    assert all(float(ms) > 0 for _, ms in rounds)
    assert re.search(r"session / call: round trip [\d.]+, tokenizer CPU [\d.]+", out)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        tokenize_hop_bench.main(["--requests", "0"])
