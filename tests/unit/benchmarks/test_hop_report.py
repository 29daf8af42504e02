"""benchmarks.hop_report joins the per-process hop files into one row per traced request."""

from __future__ import annotations

import json

import pytest

from benchmarks import hop_report

# Two probes (send at 10.000 and 20.000 s), each through router, tokenizer and engine 1. Engine
# 2 also ran a step with the index of probe 0's step, and ended it first: it must not be joined.
# Nor must engine 1's message of that step to another session (router), s2, sent first.
PROBE = """client_send 0 10.000000
client_first 0 10.020000
client_send 1 20.000000
client_first 1 20.030000
"""
ROUTER = """arrive r1 10.001000
tokenize_sent r1 4 10.002000
tokenize_read r1 4 10.004000
tokenized r1 10.0045
placed r1 10.005000
engine_sent r1 10.0055
step r1 7 10.013000
detok_sent r1 9 10.0135
detok_read r1 10.016000
respond r1 10.017000
arrive r2 20.002000
placed r2 20.003000
engine_sent r2 20.0035
step r2 12 20.020000
detok_sent r2 10 20.0205
detok_read r2 20.025000
respond r2 20.026000
"""
TOKENIZER = """tokenize_in 4 10.0025
tokenize_out 4 10.003000
detok_in 9 10.014000
detok_out 9 10.015000
detok_in 10 20.021000
detok_out 10 20.022000
"""
ENGINE_1 = """submit r1 10.006000
turn 7 s1/r0 s1/r1 10.008000
step_end 7 10.012000
step_out 7 s2 10.0121
step_out 7 s1 10.0125
submit r2 20.004000
turn 12 s1/r2 20.006000
step_end 12 20.018000
step_out 12 s1 20.019000
"""
ENGINE_2 = """step_end 7 10.0115
step_out 7 s1 10.0118
"""


@pytest.fixture
def trace_dir(tmp_path):
    for name, text in (
        ("100", PROBE),
        ("200", ROUTER),
        ("300", TOKENIZER),
        ("400", ENGINE_1),
        ("500", ENGINE_2),
    ):
        (tmp_path / f"{name}.log").write_text(text)
    return tmp_path


def test_rows_join_every_hop_of_each_traced_request(trace_dir) -> None:
    first, second = hop_report.rows(hop_report.load(trace_dir))
    assert first == pytest.approx(
        {
            "client_send": 10.0,
            "arrive": 10.001,
            "tokenize_sent": 10.002,
            "tokenize_in": 10.0025,
            "tokenize_out": 10.003,
            "tokenize_read": 10.004,
            "tokenized": 10.0045,
            "placed": 10.005,
            "engine_sent": 10.0055,
            "submit": 10.006,
            "turn": 10.008,
            "step_end": 10.012,  # engine 1's step 7, not engine 2's
            "step_out": 10.0125,  # session s1's message, not s2's
            "step": 10.013,
            "detok_sent": 10.0135,
            "detok_in": 10.014,
            "detok_out": 10.015,
            "detok_read": 10.016,
            "respond": 10.017,
            "client_first": 10.02,
        }
    )
    # A prompt of token ids has no tokenize hops; the rest joins the same way.
    assert "tokenize_sent" not in second
    assert second["client_send"] == 20.0 and second["client_first"] == 20.03
    assert second["turn"] == 20.006 and second["step_out"] == 20.019


def test_summary_gives_each_hop_and_the_engine_share(trace_dir) -> None:
    summary = hop_report.report(trace_dir)
    assert summary["requests"] == 2
    hops = {(h["from"], h["to"]): h for h in summary["hops"]}
    assert hops[("client_send", "arrive")]["n"] == 2
    assert hops[("client_send", "arrive")]["median_ms"] == pytest.approx(1.5)
    assert hops[("tokenize_in", "tokenize_out")]["n"] == 1
    assert hops[("turn", "step_end")]["median_ms"] == pytest.approx(8.0)  # 4 and 12 ms
    assert summary["total"]["median_ms"] == pytest.approx(25.0)  # 20 and 30 ms
    assert summary["engine_segment"]["median_ms"] == pytest.approx(10.75)  # 6.5 and 15
    assert summary["outside_engine"]["median_ms"] == pytest.approx(14.25)  # 13.5 and 15
    text = hop_report.format_summary(summary)
    assert "client send -> first token" in text and "tokenizer: encode" in text


def test_command_line_writes_json_and_says_when_nothing_was_traced(
    trace_dir, tmp_path_factory, capsys
) -> None:
    out = tmp_path_factory.mktemp("out") / "hops.json"
    assert hop_report.main([str(trace_dir), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 2
    assert "router -> engine" in capsys.readouterr().out
    empty = tmp_path_factory.mktemp("empty")
    assert hop_report.main([str(empty)]) == 1
    assert "no traced request" in capsys.readouterr().err
