"""Requests refused with RESOURCE_EXHAUSTED go again after the server's retry-after."""

from __future__ import annotations

import asyncio
import time

from loadtest.datasets import RequestSpec
from loadtest.grpc_client import retry_after_s
from loadtest.metrics import details
from loadtest.schedule import run_schedule


class RefusingClient:
    """Refuses each request's first `refusals` sends (retry-after 10 ms), then streams."""

    def __init__(self, refusals: int, *, refuse_after_tokens: bool = False) -> None:
        self.refusals = refusals
        self.refuse_after_tokens = refuse_after_tokens
        self.sends: list[float] = []

    async def send(self, spec, record, clock) -> None:
        record.sent_s = clock()
        self.sends.append(record.sent_s)
        await asyncio.sleep(0)
        if self.refuse_after_tokens:
            record.add_chunk(clock(), 2)
        if len(self.sends) <= self.refusals:
            record.status, record.error = "RESOURCE_EXHAUSTED", "queue full"
            record.retry_after_s = 0.01
        else:
            record.add_chunk(clock(), 3)
            record.status = "OK"
        record.finished_s = clock()


def run(client: RefusingClient, retries: int):
    spec = RequestSpec(index=0, prompt_token_ids=(1, 2, 3), input_tokens=3, output_tokens=3)
    return asyncio.run(
        run_schedule([spec], [0.0], client, start_epoch_s=time.time(), retries=retries)
    )[0]


def test_a_refused_request_goes_again_and_its_ttft_counts_from_the_first_send() -> None:
    client = RefusingClient(refusals=2)
    record = run(client, retries=3)
    assert record.status == "OK" and record.retries == 2 and len(client.sends) == 3
    assert record.sent_s == client.sends[0]  # the wait for the retries is in the TTFT
    assert record.ttft_s >= client.sends[2] - client.sends[0] >= 0.02
    assert details([record])["retries"] == 2 and details([record])["retried_requests"] == 1


def test_retries_stop_at_the_limit_and_the_refusal_stands() -> None:
    client = RefusingClient(refusals=5)
    record = run(client, retries=1)
    assert record.status == "RESOURCE_EXHAUSTED" and record.retries == 1
    assert len(client.sends) == 2
    assert run(RefusingClient(refusals=1), retries=0).status == "RESOURCE_EXHAUSTED"


def test_a_stream_that_had_tokens_is_not_sent_again() -> None:
    client = RefusingClient(refusals=1, refuse_after_tokens=True)
    record = run(client, retries=3)
    assert record.status == "RESOURCE_EXHAUSTED" and record.retries == 0
    assert len(client.sends) == 1


def test_the_grpc_retry_after_hint_is_read_from_trailing_metadata() -> None:
    assert retry_after_s((("x-other", "1"), ("retry-after", "2.500"))) == 2.5
    assert retry_after_s((("retry-after", "soon"),)) is None
    assert retry_after_s(None) is None


def test_bench_takes_retries_into_its_client_options() -> None:
    import pytest

    from loadtest.config import BenchConfig
    from services.common.errors import InvalidArgumentError

    assert BenchConfig(target="localhost:1", retries=4).client_options().retries == 4
    with pytest.raises(InvalidArgumentError, match="--retries"):
        BenchConfig(target="localhost:1", retries=-1)
