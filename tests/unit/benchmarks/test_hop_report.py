"""benchmarks.hop_report joins the spans of a traced run into one row per traced request."""

from __future__ import annotations

import json

import pytest

from benchmarks import hop_report

ROUTER, TOKENIZER, ENGINE, PROBE = 200, 300, 400, 100


def span(name, pid, start_s, end_s=None, kind="INTERNAL", trace="t0", span_id="s0", parent=None,
         events=(), **attributes):  # fmt: skip
    """One JSON line as services/common/tracing/jsonl.py writes it (times in seconds here)."""
    return {
        "name": name,
        "kind": kind,
        "trace_id": trace,
        "span_id": span_id,
        "parent_span_id": parent,
        "start_ns": round(start_s * 1e9),
        "end_ns": round((start_s if end_s is None else end_s) * 1e9),
        "service": {ROUTER: "sluice-router"}.get(pid, "other"),
        "pid": pid,
        "attributes": attributes,
        "events": [{"name": n, "time_ns": round(t * 1e9), "attributes": {}} for n, t in events],
    }


def hop(name, pid, at, ids=None, sequence=None, step=None):
    attributes = {"rpc.method": "/sluice.v1.X/Y"}
    if ids is not None:
        attributes["sluice.request_ids"] = ids
    if sequence is not None:
        attributes["sluice.sequence_number"] = sequence
    if step is not None:
        attributes["sluice.step_index"] = step
    return span(name, pid, at, **attributes)


GENERATE = "sluice.v1.Router/Generate"
# Two probes: r1 (a text prompt, through the tokenizer) at 10 s and r2 (token ids) at 20 s; r9
# is a load request (not traced) whose hops are recorded too and must not be joined to r1.
SPANS = [
    span(
        GENERATE,
        PROBE,
        10.000,
        10.020,
        kind="CLIENT",
        trace="t1",
        span_id="c1",
        events=[("first_token", 10.020)],
    ),
    span(
        GENERATE,
        ROUTER,
        10.001,
        10.018,
        kind="SERVER",
        trace="t1",
        span_id="v1",
        parent="c1",
        events=[("first_token", 10.017)],
        **{"sluice.request_id": "r1", "sluice.input": "prompt"},
    ),
    hop("TokenizeRequest sent", ROUTER, 9.990, sequence=3),  # before r1 arrived: not its batch
    hop("TokenizeRequest sent", ROUTER, 10.002, sequence=4),
    hop("TokenizeRequest received", TOKENIZER, 10.0025, sequence=4),
    hop("TokenizeResponse sent", TOKENIZER, 10.003, sequence=4),
    hop("TokenizeResponse received", ROUTER, 10.004, sequence=4),
    hop("EngineRequest sent", ROUTER, 10.0055, ids=["r9", "r1"]),
    hop("EngineRequest received", ENGINE, 10.006, ids=["r9", "r1"]),
    span("engine step", ENGINE, 10.005, 10.0075, **{"sluice.request_ids": ["s1/r8"]}),
    span(
        "engine step",
        ENGINE,
        10.008,
        10.012,
        **{"sluice.request_ids": ["s1/r9", "s1/r1"], "sluice.step_index": 7},
    ),
    hop("EngineStep sent", ENGINE, 10.0125, ids=["r9", "r1"], step=7),
    hop("EngineStep received", ROUTER, 10.013, ids=["r9", "r1"], step=7),
    hop("DetokenizeRequest sent", ROUTER, 10.0135, ids=["r9", "r1"], sequence=9),
    hop("DetokenizeRequest received", TOKENIZER, 10.014, ids=["r9", "r1"], sequence=9),
    hop("DetokenizeResponse sent", TOKENIZER, 10.015, ids=["r9", "r1"], sequence=9),
    hop("DetokenizeResponse received", ROUTER, 10.016, ids=["r9", "r1"], sequence=9),
    span(
        GENERATE,
        PROBE,
        20.000,
        20.030,
        kind="CLIENT",
        trace="t2",
        span_id="c2",
        events=[("first_token", 20.030)],
    ),
    span(
        GENERATE,
        ROUTER,
        20.002,
        20.027,
        kind="SERVER",
        trace="t2",
        span_id="v2",
        parent="c2",
        events=[("first_token", 20.026)],
        **{"sluice.request_id": "r2", "sluice.input": "prompt_token_ids"},
    ),
    hop("TokenizeRequest sent", ROUTER, 20.0025, sequence=5),  # another request's prompt
    hop("EngineRequest sent", ROUTER, 20.0035, ids=["r2"]),
    hop("EngineRequest received", ENGINE, 20.004, ids=["r2"]),
    span("engine step", ENGINE, 20.006, 20.018, **{"sluice.request_ids": ["s1/r2"]}),
    hop("EngineStep sent", ENGINE, 20.019, ids=["r2"], step=12),
    hop("EngineStep received", ROUTER, 20.020, ids=["r2"], step=12),
    hop("DetokenizeRequest sent", ROUTER, 20.0205, ids=["r2"], sequence=10),
    hop("DetokenizeRequest received", TOKENIZER, 20.021, ids=["r2"], sequence=10),
    hop("DetokenizeResponse sent", TOKENIZER, 20.022, ids=["r2"], sequence=10),
    hop("DetokenizeResponse received", ROUTER, 20.025, ids=["r2"], sequence=10),
    # A traced call that failed before its first token: no row.
    span(GENERATE, ROUTER, 30.0, 30.001, kind="SERVER", trace="t3", span_id="v3"),
]


@pytest.fixture
def trace_dir(tmp_path):
    by_pid: dict[int, list[dict]] = {}
    for item in SPANS:
        by_pid.setdefault(item["pid"], []).append(item)
    for pid, items in by_pid.items():
        lines = "".join(json.dumps(item) + "\n" for item in items)
        (tmp_path / f"{items[0]['service']}-{pid}.jsonl").write_text(lines)
    return tmp_path


def test_rows_join_every_hop_of_each_traced_request(trace_dir) -> None:
    first, second = hop_report.rows(hop_report.load(trace_dir))
    assert first == pytest.approx(
        {
            "client_send": 10.0,
            "arrive": 10.001,
            "tokenize_sent": 10.002,  # the first batch after the arrival
            "tokenize_in": 10.0025,
            "tokenize_out": 10.003,
            "tokenize_read": 10.004,
            "prompt_ready": 10.004,
            "engine_sent": 10.0055,
            "submit": 10.006,
            "turn": 10.008,  # the step that took r1 in, not the one before
            "step_end": 10.012,
            "step_out": 10.0125,
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
    assert "tokenize_sent" not in second and second["prompt_ready"] == second["arrive"]
    assert second["client_send"] == 20.0 and second["client_first"] == pytest.approx(20.03)
    assert second["turn"] == pytest.approx(20.006) and second["step_out"] == pytest.approx(20.019)


def test_summary_gives_each_hop_and_the_engine_share(trace_dir) -> None:
    summary = hop_report.report(trace_dir)
    assert summary["requests"] == 2
    hops = {(h["from"], h["to"]): h for h in summary["hops"]}
    assert hops[("client_send", "arrive")]["n"] == 2
    assert hops[("client_send", "arrive")]["median_ms"] == pytest.approx(1.5)
    assert hops[("tokenize_in", "tokenize_out")]["n"] == 1
    assert hops[("prompt_ready", "engine_sent")]["median_ms"] == pytest.approx(1.5)  # 1.5, 1.5
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
