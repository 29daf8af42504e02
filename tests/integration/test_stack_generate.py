"""End to end through the real stack (router, tokenizer, engine processes) on the default model.

Chat answers, greedy parity with the offline `LLM`, stop strings and UTF-8-safe streaming.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.client import Completion, SluiceClient

PARITY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from services.common.model_files import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None).tokenizer_dir))


def stream(
    client: SluiceClient, prompt: str | None = None, **kwargs: Any
) -> tuple[list[str], Completion]:
    deltas: list[str] = []
    completion = Completion()
    for response in client.generate(prompt, **kwargs):
        deltas.append(response.text)
        completion.add(response)
    return deltas, completion


def test_chat_names_paris_and_streams(client: SluiceClient) -> None:
    deltas, completion = stream(
        client,
        chat=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0.0,
    )
    assert "Paris" in completion.text
    assert len([delta for delta in deltas if delta]) > 1, "the answer must arrive in pieces"
    assert completion.finish_reason in ("stop", "length")
    assert completion.completion_tokens == len(completion.token_ids) > 0
    assert completion.prompt_tokens > 5


def test_greedy_output_equals_the_offline_llm(client: SluiceClient) -> None:
    from services.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(kv_cache_bytes=32 * 1024 * 1024)
    # One prompt at a time, as the stack below serves them (same batch shapes, same numerics).
    offline = [llm.generate([prompt], params)[0] for prompt in PARITY_PROMPTS]
    for prompt, expected in zip(PARITY_PROMPTS, offline, strict=True):
        _, completion = stream(client, prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert completion.token_ids == expected.token_ids, prompt
        assert completion.text == expected.text, prompt
        assert completion.finish_reason == "length"


def test_stop_string_cuts_the_output_and_is_reported(client: SluiceClient) -> None:
    chat = [("user", "Write a haiku about the sea.")]
    _, full = stream(client, chat=chat, max_tokens=40, temperature=0.0)
    words = full.text.split()
    assert len(words) > 4, full.text
    stop = words[3]  # a word from the middle, matched wherever it first appears
    cut = full.text.index(stop)
    _, stopped = stream(client, chat=chat, max_tokens=40, temperature=0.0, stop=[stop])
    assert stopped.text == full.text[:cut]
    assert stopped.finish_reason == "stop_string"
    assert stopped.matched_stop == stop
    _, kept = stream(
        client,
        chat=chat,
        max_tokens=40,
        temperature=0.0,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept.text == full.text[: cut + len(stop)]


@pytest.mark.parametrize(
    "prompt",
    [
        "🎉🎉🎉🎉🎉🎉🎉🎉🎉🎉🎉🎉",
        "你好你好你好你好你好你好你好你好",
        "Emoji: 😀😃😄😁😆😅 again: 😀😃😄",
    ],
)
def test_unicode_deltas_concatenate_to_the_full_decode(
    client: SluiceClient, hf_tokenizer: Any, prompt: str
) -> None:
    deltas, completion = stream(client, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    full = hf_tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    # U+FFFD may only appear where the tokens themselves are not valid UTF-8 (e.g. a character
    # cut by max_tokens at the very end), never because a character was split across deltas.
    complete_prefix = full.rstrip("\ufffd")
    assert "\ufffd" not in complete_prefix
    assert any(ord(char) > 127 for char in full), full


def test_unicode_sampling_never_splits_characters(client: SluiceClient, hf_tokenizer: Any) -> None:
    """Random high-temperature tokens include byte-fallback pieces of multi-byte characters."""
    for seed in range(2):
        deltas, completion = stream(
            client,
            "日本語と絵文字 🎌🍣:",
            max_tokens=32,
            temperature=1.5,
            seed=seed,
            ignore_eos=True,
        )
        full = hf_tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert "".join(deltas) == full
        if "\ufffd" not in full:
            assert all("\ufffd" not in delta for delta in deltas)


def test_tokens_held_for_pacing_stream_the_same_text_and_stops_still_cut(
    stack_factory: Any, client: SluiceClient, hf_tokenizer: Any
) -> None:
    """With `--stream-interval 4` the router keeps each request's tokens as ids and has the
    tokenizer decode them 4 at a time (at least 4 a response between the first token and the
    end): the text must be what the shared stack (a response per token) streams and what a full
    decode gives, no character split; a request with stop strings
    is decoded every step and still ends at the stop."""
    paced_stack = stack_factory(router_args=("--stream-interval", "4"))
    cases = [
        ("日本語と絵文字 🎌🍣:", {"temperature": 0.0}),
        ("Emoji: 😀😃😄😁😆😅 again: 😀😃😄", {"temperature": 0.0}),
        ("日本語と絵文字 🎌🍣:", {"temperature": 1.5, "seed": 3}),  # byte-fallback pieces
    ]
    with SluiceClient(paced_stack.router_address, timeout_s=120.0) as paced:
        for prompt, sampling in cases:
            kwargs = {"max_tokens": 22, "ignore_eos": True, **sampling}
            _, reference = stream(client, prompt, **kwargs)
            responses = list(paced.generate(prompt, **kwargs))
            completion = Completion()
            for response in responses:
                completion.add(response)
            # The first token at once, then 4 at a time (two groups merged into one response
            # where the stream's reader falls behind, as on a loaded host), the rest at the end:
            # never fewer than 4 between the first and the last.
            sizes = [len(r.token_ids) for r in responses]
            assert sizes[0] == 1 and sum(sizes) == 22, sizes
            assert all(size >= 4 for size in sizes[1:-1]) and len(sizes) <= 7, sizes
            assert completion.token_ids == reference.token_ids, prompt
            full = hf_tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            assert completion.text == reference.text == full, prompt
            if "\ufffd" not in full:
                assert all("\ufffd" not in r.text for r in responses)
            assert (completion.finish_reason, completion.completion_tokens) == ("length", 22)

        chat = [("user", "Write a haiku about the sea.")]
        _, full_answer = stream(paced, chat=chat, max_tokens=40, temperature=0.0)
        stop = full_answer.text.split()[3]
        _, stopped = stream(paced, chat=chat, max_tokens=40, temperature=0.0, stop=[stop])
        assert stopped.text == full_answer.text[: full_answer.text.index(stop)]
        assert (stopped.finish_reason, stopped.matched_stop) == ("stop_string", stop)
