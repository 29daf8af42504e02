"""The decode attention sweep's command on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_attention_bench import build_parser, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-less answer")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert main(["--batch", "8", "--context", "32"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_its_defaults_are_the_h100_engines_decode_batch():
    args = build_parser().parse_args([])
    assert (args.batch, args.context, args.out) == (384, 640, None)
