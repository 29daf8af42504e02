"""The requests of a run: prompts, output lengths, adapters and which ones get cancelled.

Every dataset yields `RequestSpec`s, drawn with one seeded generator so a run repeats exactly.
- ``synthetic``: input and output lengths in tokens from normal distributions (clipped to >= 1),
  like TensorRT-LLM's benchmark_core_model. The prompt is random token ids (sent as
  ``prompt_token_ids`` to Sluice) and a text of as many common words (sent to OpenAI targets,
  about one token per word; with ``tokenizer`` the ids are decoded instead).
- ``sharegpt``: a ShareGPT JSON file (a list of ``{"conversations": [{"from": "human", "value":
  ...}, {"from": "gpt", ...}]}``); the first human turn is the prompt, the first gpt turn after it
  sets the output length. Token counts come from ``tokenizer`` when given, else about 4
  characters per token.
- ``shared-prefix``: ``num_prefix_groups`` groups each sharing a random prefix of ``prefix_len``
  tokens, followed by a per-request suffix of synthetic length (exercises prefix caching).
Output lengths are honoured by sending ``ignore_eos`` with ``max_tokens`` = the output length.
Adapters are mixed uniformly or by a Zipf law (weight of the k-th name ∝ 1 / k^s); a
``cancel_rate`` fraction of requests is cancelled after a random 20-80 % of its output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import InvalidArgumentError, NotFoundError

DATASETS = ("synthetic", "sharegpt", "shared-prefix")
ADAPTER_DISTRIBUTIONS = ("uniform", "zipf")

# Common English words; each is one token (with its leading space) in Llama-family vocabularies.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her it an were are which this "
    "be or has had not but first one their its new after who they have two been more other "
    "also into all she time can during year only would over world city school him these "
    "most some made war may about well part used many later he when there where state such "
    "then what both them life three high through long home people work water while under "
    "found each day house same small own play west east north south great old name took left"
)
_WORDS = tuple(_WORD_TEXT.split(" "))


@dataclass(frozen=True)
class RequestSpec:
    """One request of the run, before it is sent."""

    index: int
    input_tokens: int
    output_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    adapter: str = ""
    cancel_after_tokens: int | None = None


@dataclass(frozen=True)
class DatasetOptions:
    """What `build_requests` needs; mirrors the bench flags."""

    dataset: str = "synthetic"
    dataset_path: str | None = None
    input_mean: float = 128.0
    input_stdev: float = 0.0
    output_mean: float = 64.0
    output_stdev: float = 0.0
    num_prefix_groups: int = 4
    prefix_len: int = 256
    vocab_limit: int = 10_000
    adapters: tuple[str, ...] = ()
    adapter_dist: str = "uniform"
    zipf_s: float = 1.1
    cancel_rate: float = 0.0
    seed: int = 0


def build_requests(
    options: DatasetOptions, count: int, tokenizer: object | None = None
) -> list[RequestSpec]:
    """`count` request specs for the chosen dataset (deterministic in `options.seed`)."""
    _validate(options)
    rng = np.random.default_rng(options.seed)
    decode = _decoder(tokenizer)
    if options.dataset == "synthetic":
        prompts = [_synthetic_prompt(rng, options, decode) for _ in range(count)]
    elif options.dataset == "shared-prefix":
        prompts = _shared_prefix_prompts(rng, options, count, decode)
    else:
        prompts = _sharegpt_prompts(rng, options, count, tokenizer)
    adapters = choose_adapters(rng, options.adapters, options.adapter_dist, options.zipf_s, count)
    specs = []
    for index, (ids, text, input_tokens, output_tokens) in enumerate(prompts):
        cancel_after = None
        if options.cancel_rate > 0 and rng.random() < options.cancel_rate:
            cancel_after = max(1, int(output_tokens * rng.uniform(0.2, 0.8)))
        specs.append(
            RequestSpec(
                index=index,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                prompt_token_ids=ids,
                prompt_text=text,
                adapter=adapters[index],
                cancel_after_tokens=cancel_after,
            )
        )
    return specs


def choose_adapters(
    rng: np.random.Generator, names: Sequence[str], distribution: str, zipf_s: float, count: int
) -> list[str]:
    """An adapter name per request ("" = base model when no names are given)."""
    if not names:
        return [""] * count
    if distribution == "uniform":
        weights = np.ones(len(names))
    else:
        weights = 1.0 / np.arange(1, len(names) + 1) ** zipf_s
    picks = rng.choice(len(names), size=count, p=weights / weights.sum())
    return [names[i] for i in picks]


def normal_lengths(rng: np.random.Generator, mean: float, stdev: float, count: int) -> list[int]:
    """Lengths from N(mean, stdev), rounded and clipped to >= 1."""
    values = rng.normal(mean, stdev, size=count) if stdev > 0 else np.full(count, mean)
    return [max(1, int(round(v))) for v in values]


def words_text(ids: Sequence[int]) -> str:
    """A text of len(ids) common words chosen by the ids (about one token per word)."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


Prompt = tuple[tuple[int, ...] | None, str | None, int, int]


def _synthetic_ids(rng: np.random.Generator, options: DatasetOptions, length: int) -> list[int]:
    return rng.integers(100, options.vocab_limit, size=length).tolist()


def _synthetic_prompt(
    rng: np.random.Generator, options: DatasetOptions, decode: Callable[[list[int]], str]
) -> Prompt:
    input_len = normal_lengths(rng, options.input_mean, options.input_stdev, 1)[0]
    output_len = normal_lengths(rng, options.output_mean, options.output_stdev, 1)[0]
    ids = _synthetic_ids(rng, options, input_len)
    return tuple(ids), decode(ids), input_len, output_len


def _shared_prefix_prompts(
    rng: np.random.Generator,
    options: DatasetOptions,
    count: int,
    decode: Callable[[list[int]], str],
) -> list[Prompt]:
    prefixes = [
        _synthetic_ids(rng, options, options.prefix_len) for _ in range(options.num_prefix_groups)
    ]
    prompts = []
    for _ in range(count):
        prefix = prefixes[int(rng.integers(options.num_prefix_groups))]
        suffix_len = normal_lengths(rng, options.input_mean, options.input_stdev, 1)[0]
        output_len = normal_lengths(rng, options.output_mean, options.output_stdev, 1)[0]
        ids = prefix + _synthetic_ids(rng, options, suffix_len)
        prompts.append((tuple(ids), decode(ids), len(ids), output_len))
    return prompts


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: first human turn and the first gpt turn after it."""
    file = Path(path)
    if not file.is_file():
        raise NotFoundError(f"ShareGPT file not found: {file}")
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"{file} is not a ShareGPT JSON file: {exc}") from exc
    if not isinstance(entries, list):
        raise InvalidArgumentError(f"{file}: expected a JSON list of conversations")
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        prompt = None
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                continue
            role = turn.get("from")
            if prompt is None and role in ("human", "user") and turn["value"].strip():
                prompt = turn["value"]
            elif prompt is not None and role in ("gpt", "assistant", "chatgpt"):
                if turn["value"].strip():
                    pairs.append((prompt, turn["value"]))
                break
    if not pairs:
        raise InvalidArgumentError(f"{file}: no conversation with a human then a gpt turn")
    return pairs


def _sharegpt_prompts(
    rng: np.random.Generator, options: DatasetOptions, count: int, tokenizer: object | None
) -> list[Prompt]:
    pairs = load_sharegpt(options.dataset_path or "")
    order = rng.permutation(len(pairs)).tolist()
    prompts = []
    for i in range(count):
        prompt, answer = pairs[order[i % len(order)]]
        if tokenizer is not None:
            ids = tokenizer.encode(prompt, add_special_tokens=False)  # type: ignore[attr-defined]
            output_len = len(tokenizer.encode(answer, add_special_tokens=False))  # type: ignore[attr-defined]
            prompts.append((tuple(ids), prompt, len(ids), max(1, output_len)))
        else:
            prompts.append((None, prompt, max(1, len(prompt) // 4), max(1, len(answer) // 4)))
    return prompts


def _decoder(tokenizer: object | None) -> Callable[[list[int]], str]:
    if tokenizer is None:
        return words_text
    return lambda ids: tokenizer.decode(ids)  # type: ignore[attr-defined]


def _validate(options: DatasetOptions) -> None:
    if options.dataset not in DATASETS:
        raise InvalidArgumentError(f"dataset must be one of {DATASETS}, got {options.dataset!r}")
    if options.dataset == "sharegpt" and not options.dataset_path:
        raise InvalidArgumentError("--dataset sharegpt needs --dataset-path FILE")
    if options.adapter_dist not in ADAPTER_DISTRIBUTIONS:
        raise InvalidArgumentError(
            f"adapter-dist must be one of {ADAPTER_DISTRIBUTIONS}, got {options.adapter_dist!r}"
        )
    if options.input_mean < 1 or options.output_mean < 1:
        raise InvalidArgumentError("input-mean and output-mean must be >= 1 token")
    if options.input_stdev < 0 or options.output_stdev < 0:
        raise InvalidArgumentError("input-stdev and output-stdev must be >= 0")
    if not 0.0 <= options.cancel_rate <= 1.0:
        raise InvalidArgumentError(f"cancel-rate must be in [0, 1], got {options.cancel_rate}")
    if options.num_prefix_groups < 1 or options.prefix_len < 1:
        raise InvalidArgumentError("num-prefix-groups and prefix-len must be >= 1")
    if options.vocab_limit <= 100:
        raise InvalidArgumentError(f"vocab-limit must be > 100, got {options.vocab_limit}")
    if options.zipf_s <= 0:
        raise InvalidArgumentError(f"zipf-s must be > 0, got {options.zipf_s}")
