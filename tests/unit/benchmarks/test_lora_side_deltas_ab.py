"""The in-line / beside LoRA decode A/B's arguments and cases (the run itself needs a GPU)."""

from __future__ import annotations

from benchmarks.lora_side_deltas_ab import CASES, build_parser, cases_for


def test_cases_fit_the_widest_graph() -> None:
    assert cases_for(256) == CASES
    assert cases_for(64) == ((64, 8), (64, 64))
    assert all(count <= rows for rows, count in CASES)  # every adapter has a row


def test_parser_defaults() -> None:
    args = build_parser().parse_args([])
    assert (args.rounds, args.max_rows, args.iterations) == (3, 256, 30)
    assert build_parser().parse_args(["--max-rows", "128"]).max_rows == 128
