"""benchmarks.engine_bench: prompt mix, table rows, and the hand-over to the GPU benchmark."""

from __future__ import annotations

import json

import pytest

import benchmarks.engine_bench as bench
from services.engine.model_runner import default_dtype


def test_prompts_have_mixed_lengths_within_bounds():
    prompts = bench.make_prompts(8, 16, 192, vocab=49152, seed=0)
    lengths = sorted(len(prompt) for prompt in prompts)
    assert lengths[0] == 16 and lengths[-1] == 192 and len(set(lengths)) == 8
    assert all(100 <= token < 49151 for prompt in prompts for token in prompt)
    assert bench.make_prompts(8, 16, 192, 49152, 0) == prompts  # reproducible
    assert [len(p) for p in bench.make_prompts(1, 16, 192, 49152, 0)] == [16]


def test_row_ratio_and_table_line():
    row = bench.Row(8, "generate", 800, 256, sluice_s=2.0, transformers_s=6.0)
    assert row.sluice_tokens_per_s == 128.0 and row.transformers_tokens_per_s == 256 / 6
    assert row.ratio == 3.0
    assert "3.00" in bench.format_row(row)
    prefill = bench.Row(8, "prefill", 800, 8, sluice_s=1.0, transformers_s=2.0)
    assert prefill.sluice_tokens_per_s == 800.0


def test_cuda_is_handed_to_the_gpu_benchmark(monkeypatch):
    import benchmarks.gpu_bench

    seen = {}
    monkeypatch.setattr(
        benchmarks.gpu_bench, "main", lambda argv: seen.setdefault("argv", argv) and 7
    )
    assert bench.main(["--device", "cuda", "--batch-sizes", "1"]) == 7
    assert seen["argv"] == ["--device", "cuda", "--batch-sizes", "1"]


def test_unknown_device_is_an_error(capsys):
    assert bench.main(["--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err


def test_dtype_warmup_and_repeats_reach_the_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--model", "dummy:tiny", "--skip-transformers", "--batch-sizes", "2"]
    argv += ["--max-tokens", "3", "--dtype", "float32", "--repeats", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32"
    assert result["warmup_runs"] == 1 and result["repeats"] == 2
    assert [(row["phase"], row["generated_tokens"]) for row in result["rows"]] == [
        ("generate", 6),
        ("prefill", 2),
    ]
    assert "dtype: float32 (both sides)" in capsys.readouterr().out


def test_auto_dtype_is_the_engines_choice_and_bad_dtype_is_refused(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--model", "dummy:tiny", "--skip-transformers", "--batch-sizes", "1"]
    assert bench.main([*argv, "--max-tokens", "2", "--out", str(out)]) == 0
    expected = str(default_dtype("cpu")).removeprefix("torch.")
    assert json.loads(out.read_text())["dtype"] == expected
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--dtype", "int8"])
