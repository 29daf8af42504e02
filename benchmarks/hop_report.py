"""Where a request's time to first token goes, hop by hop, from `SLUICE_HOP_TRACE_DIR` files.

services/common/hop_trace.py says what each process records. This joins the files into one row
per traced request (the stack_bench probe's) and prints, for each hop, the median, mean and
p90 in milliseconds:

    python -m benchmarks.hop_report /tmp/hops            # a table
    python -m benchmarks.hop_report /tmp/hops --json F   # and the figures as JSON

Joins: the router's request id links its own events, the engine's submit and the step that
carried the first token (within that engine's file, by step index and session); the tokenize and
detokenize sequence numbers link the tokenizer's; the probe's sends pair with the router's
arrivals in time order (it sends one request at a time).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# (from, to, what the time between them is)
HOPS = (
    ("client_send", "arrive", "client -> router: the call reaches the servicer"),
    ("arrive", "tokenize_sent", "router: prompt onto the tokenize stream"),
    ("tokenize_sent", "tokenize_in", "router -> tokenizer"),
    ("tokenize_in", "tokenize_out", "tokenizer: encode"),
    ("tokenize_out", "tokenize_read", "tokenizer -> router"),
    ("tokenize_read", "tokenized", "router: the request resumes"),
    ("tokenized", "placed", "router: queue and placement"),
    ("placed", "engine_sent", "router: submit onto the engine stream"),
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


@dataclass
class _Process:
    """One file's events: by (event, first key) -> [(time, other keys)], time-ordered."""

    events: dict[tuple[str, str], list[tuple[float, list[str]]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # request id -> (time, step index, session) of the engine turn that took it
    turns: dict[str, tuple[float, str, str]] = field(default_factory=dict)

    def first(
        self, event: str, key: str, after: float, *rest: str
    ) -> tuple[float, list[str]] | None:
        """The earliest `event` for `key` at or after `after` whose next keys start with `rest`."""
        for item in self.events.get((event, key), ()):
            if item[0] >= after and tuple(item[1][: len(rest)]) == rest:
                return item
        return None


def load(directory: Path) -> list[_Process]:
    processes = []
    for path in sorted(directory.glob("*.log")):
        process = _Process()
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 2:
                continue
            event, stamp, keys = parts[0], float(parts[-1]), parts[1:-1]
            if event == "turn":  # step index, then the request ids it took (session/id)
                for internal_id in keys[1:]:
                    session, _, request_id = internal_id.rpartition("/")
                    process.turns.setdefault(request_id, (stamp, keys[0], session))
                continue
            key = keys[0] if keys else ""
            process.events[(event, key)].append((stamp, keys[1:]))
        for items in process.events.values():
            items.sort(key=lambda item: item[0])
        processes.append(process)
    return processes


def _find(processes: list[_Process], event: str, key: str, after: float):
    """(process, (time, keys)) of the earliest `event` for `key` at or after `after`."""
    best = None
    for process in processes:
        item = process.first(event, key, after)
        if item is not None and (best is None or item[0] < best[1][0]):
            best = (process, item)
    return best


def _turn_of(process: _Process, request_id: str, after: float) -> tuple[float, str, str] | None:
    found = process.turns.get(request_id)
    return found if found is not None and found[0] >= after else None


def rows(processes: list[_Process]) -> list[dict[str, float]]:
    """One row per traced request: event name -> time.monotonic() seconds."""
    sends = sorted(
        (stamp, key)
        for p in processes
        for (event, key), items in p.events.items()
        if event == "client_send"
        for stamp, _ in items
    )
    firsts = {
        key: [t for t, _ in items]
        for p in processes
        for (event, key), items in p.events.items()
        if event == "client_first"
    }
    send_times = [stamp for stamp, _ in sends]
    result = []
    for process in processes:
        for (event, request_id), items in process.events.items():
            if event != "arrive":
                continue
            row = _row(processes, request_id, items[0][0])
            if row is None:
                continue
            index = bisect.bisect_right(send_times, row["arrive"]) - 1
            if index >= 0:
                stamp, probe_index = sends[index]
                after = [t for t in firsts.get(probe_index, ()) if t >= row["respond"]]
                if after and row["arrive"] - stamp < 1.0:
                    row["client_send"] = stamp
                    row["client_first"] = after[0]
            result.append(row)
    return sorted(result, key=lambda row: row["arrive"])


def _row(processes: list[_Process], request_id: str, arrive: float) -> dict[str, float] | None:
    row = {"arrive": arrive}

    def take(event: str, key: str, after: float, name: str | None = None):
        found = _find(processes, event, key, after)
        if found is not None:
            row[name or event] = found[1][0]
        return found

    sent = take("tokenize_sent", request_id, arrive)
    if sent is not None:  # a prompt of token ids skips the tokenizer
        sequence = sent[1][1][0]
        inbound = take("tokenize_in", sequence, sent[1][0])
        if inbound is not None:
            take("tokenize_out", sequence, inbound[1][0])
        take("tokenize_read", request_id, sent[1][0])
        take("tokenized", request_id, sent[1][0])
    if take("placed", request_id, arrive) is None:
        return None
    take("engine_sent", request_id, arrive)
    submit = take("submit", request_id, arrive)
    if submit is not None:
        engine, (submitted, _) = submit
        turn = _turn_of(engine, request_id, submitted)
        if turn is not None:
            row["turn"], step_index, session = turn
            end = engine.first("step_end", step_index, turn[0])
            if end is not None:
                row["step_end"] = end[0]
                # Each session (router) gets its own message of the step.
                out = engine.first("step_out", step_index, end[0], session)
                if out is not None:
                    row["step_out"] = out[0]
    step = take("step", request_id, arrive)
    detok = take("detok_sent", request_id, arrive)
    if step is None or detok is None:
        return None
    sequence = detok[1][1][0]
    inbound = take("detok_in", sequence, detok[1][0])
    if inbound is not None:
        take("detok_out", sequence, inbound[1][0])
    take("detok_read", request_id, detok[1][0])
    if take("respond", request_id, detok[1][0]) is None:
        return None
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
        description="Per-hop times to first token from SLUICE_HOP_TRACE_DIR files.",
    )
    parser.add_argument("directory", type=Path, help="the SLUICE_HOP_TRACE_DIR of the run")
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
