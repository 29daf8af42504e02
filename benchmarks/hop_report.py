"""Where a request's time to first token goes, hop by hop, from the spans of a traced run.

`stack_bench --hop-trace DIR` runs the stack with tracing on (services/common/tracing/): every
process writes its OpenTelemetry spans as JSON lines into DIR. This joins them into one row per
traced request (the stack_bench probe's) and prints, for each hop, the median, mean and p90 in
milliseconds:

    python -m benchmarks.hop_report /tmp/hops            # a table
    python -m benchmarks.hop_report /tmp/hops --json F   # and the figures as JSON

Joins: the probe's CLIENT span is the parent of the router's SERVER span of the same call (send,
arrival, the router's first response and the probe's first token); the router's request id
(`sluice.request_id` of that span) names the request in the hop spans of the engine and
detokenize streams, at both ends, and in the engine's step span; the tokenize batch is the first
one the router sent after the call arrived, followed by its sequence number.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

GENERATE = "sluice.v1.Router/Generate"
FIRST_TOKEN = "first_token"
STEP_SPAN = "engine step"
# (from, to, what the time between them is); `prompt_ready` is `tokenize_read`, or `arrive` for a
# prompt of token ids (no tokenizer).
HOPS = (
    ("client_send", "arrive", "client -> router: the call reaches the servicer"),
    ("arrive", "tokenize_sent", "router: prompt onto the tokenize stream"),
    ("tokenize_sent", "tokenize_in", "router -> tokenizer"),
    ("tokenize_in", "tokenize_out", "tokenizer: encode"),
    ("tokenize_out", "tokenize_read", "tokenizer -> router"),
    ("prompt_ready", "engine_sent", "router: resume, queue, place, onto the engine stream"),
    ("engine_sent", "submit", "router -> engine"),
    ("submit", "turn", "engine: waits for the step in flight"),
    ("turn", "step_end", "engine: the step with its prefill"),
    ("step_end", "step_out", "engine: step message to gRPC"),
    ("step_out", "step", "engine -> router"),
    ("step", "detok_sent", "router: token onto the detokenize stream"),
    ("detok_sent", "detok_in", "router -> tokenizer"),
    ("detok_in", "detok_out", "tokenizer: decode"),
    ("detok_out", "detok_read", "tokenizer -> router"),
    ("detok_read", "respond", "router: the request's servicer resumes"),
    ("respond", "client_first", "router -> client"),
)
ENGINE_SEGMENT = ("submit", "step_out")  # what the engine alone also pays
# Hop span name -> the event it marks; keyed by request id, or by sequence number (tokenize).
EVENTS_BY_REQUEST = {
    "EngineRequest sent": "engine_sent",
    "EngineRequest received": "submit",
    "EngineStep sent": "step_out",
    "EngineStep received": "step",
    "DetokenizeRequest sent": "detok_sent",
    "DetokenizeRequest received": "detok_in",
    "DetokenizeResponse sent": "detok_out",
    "DetokenizeResponse received": "detok_read",
}
EVENTS_BY_SEQUENCE = {
    "TokenizeRequest sent": "tokenize_sent",
    "TokenizeRequest received": "tokenize_in",
    "TokenizeResponse sent": "tokenize_out",
    "TokenizeResponse received": "tokenize_read",
}


def load(directory: Path) -> list[dict]:
    """Every span of the run (services/common/tracing/jsonl.py says what a line holds)."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans


class _Index:
    """Event times (seconds) by (event, key), time-ordered, for 'the first one after t'."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, object], list[float]] = defaultdict(list)

    def add(self, event: str, key: object, at: float) -> None:
        self._times[(event, key)].append(at)

    def sort(self) -> None:
        for times in self._times.values():
            times.sort()

    def first(self, event: str, key: object, after: float) -> float | None:
        times = self._times.get((event, key), ())
        index = bisect.bisect_left(times, after)
        return times[index] if index < len(times) else None


def _seconds(ns: int) -> float:
    return ns / 1e9


def _first_token(span: dict) -> float | None:
    for event in span["events"]:
        if event["name"] == FIRST_TOKEN:
            return _seconds(event["time_ns"])
    return None


def rows(spans: list[dict]) -> list[dict[str, float]]:
    """One row per traced request: event name -> wall-clock seconds."""
    index = _Index()
    tokenize_sends: dict[object, list[tuple[float, int]]] = defaultdict(list)  # by router pid
    turns: dict[str, list[tuple[float, float]]] = defaultdict(list)  # request id -> step spans
    clients: dict[tuple[str, str], dict] = {}
    servers: list[dict] = []
    for span in spans:
        name, attributes = span["name"], span["attributes"]
        at = _seconds(span["start_ns"])
        if name == GENERATE:
            if span["kind"] == "CLIENT":
                clients[(span["trace_id"], span["span_id"])] = span
            elif span["kind"] == "SERVER":
                servers.append(span)
        elif name in EVENTS_BY_REQUEST:
            for request_id in attributes.get("sluice.request_ids", ()):
                index.add(EVENTS_BY_REQUEST[name], request_id, at)
        elif name in EVENTS_BY_SEQUENCE:
            sequence = attributes.get("sluice.sequence_number")
            index.add(EVENTS_BY_SEQUENCE[name], sequence, at)
            if name == "TokenizeRequest sent":
                tokenize_sends[span["pid"]].append((at, sequence))
        elif name == STEP_SPAN:
            for internal_id in attributes.get("sluice.request_ids", ()):
                request_id = internal_id.rpartition("/")[2]  # the engine's <session>/<id>
                turns[request_id].append((at, _seconds(span["end_ns"])))
    index.sort()
    for sends in tokenize_sends.values():
        sends.sort()
    for steps in turns.values():
        steps.sort()
    result = []
    for server in servers:
        row = _row(server, index, tokenize_sends.get(server["pid"], []), turns)
        if row is None:
            continue
        client = clients.get((server["trace_id"], server["parent_span_id"]))
        if client is not None:
            row["client_send"] = _seconds(client["start_ns"])
            first = _first_token(client)
            if first is not None:
                row["client_first"] = first
        result.append(row)
    return sorted(result, key=lambda row: row["arrive"])


def _row(
    server: dict,
    index: _Index,
    tokenize_sends: list[tuple[float, int]],
    turns: dict[str, list[tuple[float, float]]],
) -> dict[str, float] | None:
    request_id = server["attributes"].get("sluice.request_id")
    respond = _first_token(server)
    if not request_id or respond is None:
        return None
    arrive = _seconds(server["start_ns"])
    row = {"arrive": arrive, "respond": respond}

    def take(event: str, key: object, after: float) -> float | None:
        found = index.first(event, key, after)
        if found is not None:
            row[event] = found
        return found

    if server["attributes"].get("sluice.input") == "prompt_token_ids":
        row["prompt_ready"] = arrive
    else:
        position = bisect.bisect_left(tokenize_sends, (arrive, -1))
        if position < len(tokenize_sends):
            sent, sequence = tokenize_sends[position]
            row["tokenize_sent"] = sent
            inbound = take("tokenize_in", sequence, sent)
            if inbound is not None:
                take("tokenize_out", sequence, inbound)
            if take("tokenize_read", sequence, sent) is not None:
                row["prompt_ready"] = row["tokenize_read"]
    if take("engine_sent", request_id, arrive) is None:
        return None
    submit = take("submit", request_id, arrive)
    if submit is not None:
        for started, ended in turns.get(request_id, ()):
            if started >= submit:
                row["turn"], row["step_end"] = started, ended
                break
    take("step_out", request_id, arrive)
    if take("step", request_id, arrive) is None:
        return None
    detok = take("detok_sent", request_id, arrive)
    if detok is None:
        return None
    inbound = take("detok_in", request_id, detok)
    if inbound is not None:
        take("detok_out", request_id, inbound)
    take("detok_read", request_id, detok)
    return row


def _stats(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {
        "n": len(values),
        "median_ms": statistics.median(values) * 1e3,
        "mean_ms": statistics.fmean(values) * 1e3,
        "p90_ms": values[min(len(values) - 1, int(0.9 * len(values)))] * 1e3,
    }


def summarize(table: list[dict[str, float]]) -> dict:
    """Per hop and in total: n, median, mean and p90 (ms) over the rows that have both ends."""
    hops = []
    for start, end, what in HOPS:
        values = [row[end] - row[start] for row in table if start in row and end in row]
        if values:
            hops.append({"from": start, "to": end, "what": what, **_stats(values)})
    summary: dict = {"requests": len(table), "hops": hops}
    whole = [r["client_first"] - r["client_send"] for r in table if "client_first" in r]
    if whole:
        summary["total"] = _stats(whole)
    start, end = ENGINE_SEGMENT
    engine = [r[end] - r[start] for r in table if start in r and end in r]
    if engine and whole:
        summary["engine_segment"] = _stats(engine)
        outside = [
            (r["client_first"] - r["client_send"]) - (r[end] - r[start])
            for r in table
            if "client_first" in r and start in r and end in r
        ]
        summary["outside_engine"] = _stats(outside)
    return summary


def format_summary(summary: dict) -> str:
    lines = [
        f"hops of {summary['requests']} traced requests' first tokens (ms: median / mean / p90)"
    ]
    for hop in summary["hops"]:
        lines.append(
            f"  {hop['from']:>13} -> {hop['to']:<13} {hop['median_ms']:6.2f} "
            f"{hop['mean_ms']:6.2f} {hop['p90_ms']:6.2f}  {hop['what']}"
        )
    for name, label in (
        ("total", "client send -> first token"),
        ("engine_segment", "engine: submit received -> step out"),
        ("outside_engine", "everything else"),
    ):
        if name in summary:
            s = summary[name]
            lines.append(
                f"  {label:<36} {s['median_ms']:6.2f} {s['mean_ms']:6.2f} {s['p90_ms']:6.2f}"
            )
    return "\n".join(lines)


def report(directory: Path) -> dict:
    return summarize(rows(load(directory)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hop_report",
        description="Per-hop times to first token from the spans of a traced run.",
    )
    parser.add_argument("directory", type=Path, help="the run's trace directory (SLUICE_TRACE_DIR)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    summary = report(args.directory)
    if not summary["requests"]:
        print(f"no traced request in {args.directory}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
