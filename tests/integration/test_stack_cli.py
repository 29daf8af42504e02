"""`sluice generate` against the real stack: streamed text on stdout, errors on stderr."""

from __future__ import annotations

import subprocess
import sys

from services.client import SluiceClient


def sluice(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_generate_streams_the_same_text_as_the_client(router_address: str) -> None:
    result = sluice(
        "generate",
        "--target",
        router_address,
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "The capital of France is",
    )
    assert result.returncode == 0, result.stderr
    with SluiceClient(router_address, timeout_s=60.0) as client:
        expected = client.complete("The capital of France is", max_tokens=8, temperature=0.0)
    assert result.stdout == expected.text + "\n"
    assert expected.text.strip()


def test_generate_chat_answers(router_address: str) -> None:
    result = sluice(
        "generate",
        "--target",
        router_address,
        "--chat",
        "--max-tokens",
        "24",
        "--temperature",
        "0",
        "What is the capital of France?",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_bad_parameter_prints_status_and_fails(router_address: str) -> None:
    result = sluice("generate", "--target", router_address, "--max-tokens", "0", "Hello")
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.startswith("error: INVALID_ARGUMENT: "), result.stderr
    assert "max_tokens" in result.stderr
    result = sluice("generate", "--target", router_address, "--temperature", "-1", "Hello")
    assert result.returncode != 0
    assert result.stderr.startswith("error: INVALID_ARGUMENT: "), result.stderr
    assert "temperature" in result.stderr


def test_generate_unreachable_router_is_unavailable() -> None:
    result = sluice("generate", "--target", "127.0.0.1:1", "--timeout-s", "5", "Hello")
    assert result.returncode != 0
    assert result.stderr.startswith("error: UNAVAILABLE: "), result.stderr
