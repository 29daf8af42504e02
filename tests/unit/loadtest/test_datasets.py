"""Datasets: synthetic lengths, ShareGPT parsing, shared prefixes, adapter mixes, cancels."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadtest.datasets import DatasetOptions, build_requests, load_sharegpt, words_text
from services.common.errors import InvalidArgumentError, NotFoundError


def test_synthetic_lengths_follow_the_normal_distribution_clipped_at_one() -> None:
    options = DatasetOptions(input_mean=200, input_stdev=40, output_mean=3, output_stdev=5, seed=2)
    specs = build_requests(options, 3000)
    inputs = np.array([s.input_tokens for s in specs])
    outputs = np.array([s.output_tokens for s in specs])
    assert inputs.mean() == pytest.approx(200, rel=0.03)
    assert inputs.std() == pytest.approx(40, rel=0.08)
    assert outputs.min() == 1  # N(3, 5) is often below 1: clipped
    for spec in specs[:50]:
        assert len(spec.prompt_token_ids) == spec.input_tokens
        assert all(100 <= t < options.vocab_limit for t in spec.prompt_token_ids)
        assert len(spec.prompt_text.split(" ")) == spec.input_tokens


def test_zero_stdev_gives_exact_lengths_and_seed_repeats() -> None:
    options = DatasetOptions(input_mean=17, output_mean=9, seed=4)
    specs = build_requests(options, 10)
    assert {(s.input_tokens, s.output_tokens) for s in specs} == {(17, 9)}
    assert specs == build_requests(options, 10)


def test_sharegpt_takes_first_human_and_following_gpt_turn(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "What is a sluice?"},
                           {"from": "gpt", "value": "A gate " * 20}]},
        {"conversations": [{"from": "gpt", "value": "orphan answer"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "x", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello there"},
                                      {"from": "human", "value": "later turn"}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    assert load_sharegpt(path) == [("What is a sluice?", "A gate " * 20), ("Hi", "Hello there")]
    specs = build_requests(DatasetOptions(dataset="sharegpt", dataset_path=str(path)), 5)
    assert {s.prompt_text for s in specs} == {"What is a sluice?", "Hi"}
    by_prompt = {s.prompt_text: s for s in specs}
    assert by_prompt["What is a sluice?"].output_tokens == len("A gate " * 20) // 4
    assert all(s.prompt_token_ids is None for s in specs)


def test_sharegpt_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        load_sharegpt(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgumentError):
        load_sharegpt(bad)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(InvalidArgumentError):
        load_sharegpt(empty)
    with pytest.raises(InvalidArgumentError):
        build_requests(DatasetOptions(dataset="sharegpt"), 1)


def test_shared_prefix_groups_share_their_prefix() -> None:
    options = DatasetOptions(
        dataset="shared-prefix", num_prefix_groups=3, prefix_len=50, input_mean=10, seed=1
    )
    specs = build_requests(options, 60)
    prefixes = Counter(s.prompt_token_ids[:50] for s in specs)
    assert len(prefixes) == 3
    assert all(count >= 5 for count in prefixes.values())
    assert all(s.input_tokens == 60 for s in specs)
    assert len({s.prompt_token_ids for s in specs}) == 60  # suffixes differ


def test_uniform_and_zipf_adapter_mixes() -> None:
    names = ("a", "b", "c", "d")
    uniform = Counter(s.adapter for s in build_requests(DatasetOptions(adapters=names), 4000))
    assert all(count == pytest.approx(1000, rel=0.1) for count in uniform.values())
    zipf_options = DatasetOptions(adapters=names, adapter_dist="zipf", zipf_s=1.0)
    zipf = Counter(s.adapter for s in build_requests(zipf_options, 4000))
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    for rank, name in enumerate(names, start=1):
        assert zipf[name] / 4000 == pytest.approx(1 / rank / harmonic, abs=0.025)
    assert {s.adapter for s in build_requests(DatasetOptions(), 5)} == {""}


def test_cancel_rate_marks_that_fraction_mid_stream() -> None:
    specs = build_requests(DatasetOptions(output_mean=50, cancel_rate=0.3, seed=8), 2000)
    cancelled = [s for s in specs if s.cancel_after_tokens is not None]
    assert len(cancelled) / 2000 == pytest.approx(0.3, abs=0.04)
    assert all(10 <= s.cancel_after_tokens <= 40 for s in cancelled)


@pytest.mark.parametrize(
    "options",
    [
        DatasetOptions(dataset="nope"),
        DatasetOptions(adapter_dist="pareto", adapters=("a",)),
        DatasetOptions(cancel_rate=1.5),
        DatasetOptions(input_mean=0),
        DatasetOptions(output_stdev=-1),
    ],
)
def test_bad_options_are_invalid(options: DatasetOptions) -> None:
    with pytest.raises(InvalidArgumentError):
        build_requests(options, 1)


def test_words_text_has_one_word_per_id() -> None:
    assert len(words_text(range(37)).split(" ")) == 37
