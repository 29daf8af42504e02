"""`sluice bench [run] ...` and `sluice bench compare A.json B.json` (also `python -m loadtest`).

`run` computes the arrival schedule and the requests up front, scrapes `--metrics-url` while
the open-loop runner sends them, then prints a Markdown summary and, with `--out FILE.json`,
writes the report, the summary and the plots. Exit status: 0 when the run finished with at
least one successful request, 1 when none succeeded, 2 for bad flags or files, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tqdm import tqdm

from loadtest.arrivals import arrival_times
from loadtest.compare import format_comparison
from loadtest.config import BenchConfig
from loadtest.datasets import build_requests
from loadtest.records import RequestRecord
from loadtest.report import build_report, markdown, write_report
from loadtest.runner import run
from loadtest.scrape import Scraper
from services.common.config import add_arguments, from_layers
from services.common.errors import SluiceError

_DEFAULT_NUM_REQUESTS = 100


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench",
        description="Open-loop load test of a Sluice router or an "
        "OpenAI-compatible server. `sluice bench compare A.json B.json` compares two reports.",
    )
    add_arguments(parser, BenchConfig)
    return parser


def _load_tokenizer(path: str | None) -> object | None:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _fit_to_served_model(config: BenchConfig) -> BenchConfig:
    """Keep synthetic token ids inside a Sluice target's vocabulary (asked with ListModels)."""
    if config.target is None:
        return config
    from loadtest.grpc_client import served_model

    model = served_model(config.target, api_key=config.api_key)
    if model is None or not model.vocab_size or model.vocab_size >= config.vocab_limit:
        return config
    limit = max(101, model.vocab_size)
    tqdm.write(f"vocab-limit lowered to {limit}: {model.name} has {model.vocab_size} tokens")
    return dataclasses.replace(config, vocab_limit=limit)


def run_bench(config: BenchConfig) -> int:
    """Run one load test; print the summary; write the report when --out is set."""
    config = _fit_to_served_model(config)
    num_requests = config.num_requests
    if num_requests is None and config.duration_s is None:
        num_requests = _DEFAULT_NUM_REQUESTS
    times = arrival_times(
        config.arrival,
        config.rate,
        num_requests=num_requests,
        duration_s=config.duration_s,
        burstiness=config.burstiness,
        seed=config.seed,
    )
    specs = build_requests(
        config.dataset_options(), len(times), tokenizer=_load_tokenizer(config.tokenizer)
    )
    bar = tqdm(total=len(specs), unit="req", disable=not config.progress, file=sys.stderr)

    def progress(record: RequestRecord) -> None:
        bar.update(1)
        if record.status != "OK":
            bar.set_postfix_str(f"last error {record.status}", refresh=False)

    scraper = Scraper(list(config.metrics_url), config.scrape_interval_s)
    scraper.start()
    try:
        result = run(
            specs,
            times,
            config.client_options(),
            max_concurrency=config.max_concurrency,
            workers=config.workers,
            lag_warning_ms=config.lag_warning_ms,
            progress=progress,
            emit=lambda message: tqdm.write(message, file=sys.stderr),
        )
    finally:
        scrape_log = scraper.stop()
        bar.close()
    shown_config = {
        k: v for k, v in dataclasses.asdict(config).items() if k != "api_key" and v is not None
    }
    report = build_report(
        result.records,
        slo=config.slo_ms,
        config=shown_config,
        scrape_log=scrape_log if config.metrics_url else None,
        start_epoch_s=result.start_epoch_s,
        warnings=result.warnings,
    )
    print(markdown(report))
    if config.out:
        paths = write_report(
            report,
            config.out,
            result.records,
            scrape_log if config.metrics_url else None,
            result.start_epoch_s,
        )
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if report["details"]["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `sluice bench`; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "compare":
            parser = argparse.ArgumentParser(prog="sluice bench compare")
            parser.add_argument("a", help="baseline report (JSON)")
            parser.add_argument("b", help="report to compare with it (JSON)")
            parsed = parser.parse_args(args[1:])
            print(format_comparison(parsed.a, parsed.b))
            return 0
        if args and args[0] == "run":
            args = args[1:]
        flags = run_parser().parse_args(args)
        return run_bench(from_layers(BenchConfig, flags))
    except SluiceError as error:
        print(f"sluice bench: {error.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sluice bench: interrupted; no report written", file=sys.stderr)
        return 130
