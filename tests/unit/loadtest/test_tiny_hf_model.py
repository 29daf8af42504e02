"""tiny_hf_model: a dummy shape as a Hugging Face directory the engine loads like any other."""

from __future__ import annotations

import json

import pytest

from loadtest import tiny_hf_model
from services.common.model_files import resolve_model
from services.engine.loader.dummy_shapes import dummy_config
from services.engine.sampling_params import SamplingParams


def test_the_directory_is_a_model_of_that_shape_with_the_tokenizer(tmp_path) -> None:
    directory = tiny_hf_model.write(tmp_path / "tiny")
    files = resolve_model(str(directory))
    assert files.weights_dir == files.tokenizer_dir == directory.resolve()
    config = json.loads((directory / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert config[key] == dummy_config("tiny")[key]
    from services.engine.llm import LLM

    llm = LLM(str(directory), kv_cache_bytes=8 * 1024 * 1024)
    (output,) = llm.generate(["Hello there"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.token_ids) == 4


def test_an_existing_directory_or_unknown_shape_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        tiny_hf_model.main([str(tmp_path)])  # exists
    assert tiny_hf_model.main([str(tmp_path / "new"), "--shape", "nope"]) == 1
    assert "unknown dummy shape" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
