"""Export of a model's batchful segments (backends/segments.py) to ONNX, cached on disk.

Each segment kind is traced once (torch.onnx's dynamo exporter, one dynamic token dimension);
every decoder layer's graph is that same graph with the layer's own weights substituted, saved
as `<kind>.<layer>.onnx` with its weights beside it as external data (`<kind>.<layer>.data`),
so a graph file stays small and one layer's weights load without parsing the others.

The cache lives under `env.cache_dir()/onnx/`, one directory per key: the model's identity (name,
config.json, weight file sizes and times; name and seed for random weights), dtype, opset and
the exporter's version (this module's EXPORTER_VERSION, torch's and onnx's). A directory is
written under a temporary name and renamed into place under a file lock, so two engines starting
at once export once and a crash never leaves half a cache. `manifest.json` records each file's
size and sha256 (backends/onnx_cache.py); a file that does not match (truncated, overwritten)
is found at load and the export is redone, or with `repair=False` reported as a
FailedPreconditionError naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.common import env
from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.common.files import file_lock
from services.common.model_files import ModelFiles
from services.engine.backends import segments
from services.engine.backends.onnx_cache import SegmentGraphs, read_graphs, verify, write_manifest
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# Bumped when the graphs or the layout of an export directory change.
EXPORTER_VERSION = 1
OPSET = 18
# Largest token count the traced graphs are declared for (the dimension stays symbolic).
MAX_TRACE_TOKENS = 1 << 20
# torch dtype -> ONNX TensorProto element type
ONNX_DTYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}


def model_identity(files: ModelFiles, config: ModelConfig, seed: int) -> dict[str, Any]:
    """What names a model's weights without reading them."""
    if files.weights_dir is None:
        return {"name": files.name, "dummy_shape": files.dummy_shape, "seed": seed}
    weights_dir = Path(files.weights_dir)
    stats = []
    for path in sorted(weights_dir.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".json") and path.is_file():
            info = path.stat()
            stats.append([path.name, info.st_size, info.st_mtime_ns])
    return {"name": files.name, "path": str(weights_dir.resolve()), "files": stats}


def export_key(identity: dict[str, Any], dtype: torch.dtype, opset: int = OPSET) -> dict:
    """The cache key: model identity, dtype, opset and exporter versions."""
    import onnx

    return {
        "model": identity,
        "dtype": str(dtype).removeprefix("torch."),
        "opset": opset,
        "exporter": EXPORTER_VERSION,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
    }


def export_directory(key: dict, root: Path | None = None) -> Path:
    """The cache directory of `key` under `root` (default: the engine's cache dir)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key["model"]["name"])
    base = Path(root) if root is not None else Path(env.cache_dir()) / "onnx"
    return base / f"{name}-{key['dtype']}-{digest}"


def load_or_export(
    model: torch.nn.Module,
    config: ModelConfig,
    files: ModelFiles,
    *,
    dtype: torch.dtype,
    seed: int = 0,
    root: Path | None = None,
    repair: bool = True,
    progress: bool | None = None,
) -> SegmentGraphs:
    """The model's segment graphs from the cache, exported first where missing or corrupt."""
    segments.check_exportable(config, model)
    if dtype not in ONNX_DTYPES:
        raise InvalidArgumentError(f"cannot export dtype {dtype} to ONNX")
    key = export_key(model_identity(files, config, seed), dtype)
    target = export_directory(key, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.exists():
            problem = verify(target)
            if problem is None:
                return read_graphs(target, dtype)
            if not repair:
                raise FailedPreconditionError(
                    f"ONNX export cache {target} is corrupt ({problem}); delete it to export again"
                )
            logger.warning("ONNX export cache %s is corrupt (%s): exporting again", target, problem)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            export_segments(model, config, tmp, key=key, progress=progress)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return read_graphs(target, dtype)


def export_segments(
    model: torch.nn.Module,
    config: ModelConfig,
    directory: Path,
    *,
    key: dict | None = None,
    progress: bool | None = None,
) -> dict:
    """Write every segment graph of `model` into `directory` and its manifest; returns it."""
    import onnx
    from tqdm.auto import tqdm

    segments.check_exportable(config, model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    parameter = next(model.parameters())
    plan = [
        (spec.kind, layer)
        for spec in segments.SEGMENTS
        for layer in (range(config.num_layers) if spec.per_layer else (0,))
    ]
    templates: dict[str, onnx.ModelProto | None] = {}
    graphs: dict[str, list[str]] = {spec.kind: [] for spec in segments.SEGMENTS}
    bar = tqdm(plan, desc="export ONNX segments", unit="graph", disable=progress is False)
    for kind, layer in bar:
        module = segments.segment_module(model, kind, layer)
        if kind not in templates:
            traced = trace_segment(module, config, kind, parameter)
            # Where the exporter folded a weight into a new constant (a cast to float32 in
            # half precision), no initializer carries its name: trace every layer instead.
            templates[kind] = traced if _names_every_weight(traced, module) else None
            proto = traced
        elif templates[kind] is None:
            proto = trace_segment(module, config, kind, parameter)
        else:
            proto = with_weights(templates[kind], module)
        stem = f"{kind}.{layer:03d}" if segments.spec(kind).per_layer else kind
        onnx.save_model(
            proto,
            str(directory / f"{stem}.onnx"),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{stem}.data",
            size_threshold=1024,
        )
        graphs[kind].append(f"{stem}.onnx")
    bar.close()
    manifest = write_manifest(directory, key or {}, graphs)
    return manifest


def trace_segment(
    module: torch.nn.Module, config: ModelConfig, kind: str, like: torch.Tensor
) -> Any:
    """One segment module traced to an ONNX ModelProto with a dynamic token dimension."""
    spec = segments.spec(kind)
    example = segments.segment_inputs(config, kind, 3, dtype=like.dtype, device=like.device)
    tokens = torch.export.Dim("tokens", min=1, max=MAX_TRACE_TOKENS)
    with (
        warnings.catch_warnings(),
        open(os.devnull, "w") as sink,
        contextlib.redirect_stdout(sink),
        _quiet_loggers(),
    ):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            example,
            dynamo=True,
            opset_version=OPSET,
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            dynamic_shapes=tuple({0: tokens} for _ in spec.inputs),
            verbose=False,
        )
    return program.model_proto


def with_weights(template: Any, module: torch.nn.Module) -> Any:
    """A copy of `template` whose parameter initializers hold `module`'s own weights."""
    import onnx

    proto = onnx.ModelProto()
    proto.CopyFrom(template)
    params = dict(module.named_parameters())
    found = set()
    for tensor in proto.graph.initializer:
        if tensor.name not in params:
            continue
        weight = params[tensor.name].detach().contiguous().cpu()
        if list(tensor.dims) != list(weight.shape):
            raise FailedPreconditionError(
                f"segment weight {tensor.name!r} has shape {tuple(weight.shape)}, "
                f"its graph {tuple(tensor.dims)}"
            )
        tensor.ClearField("external_data")
        tensor.data_location = onnx.TensorProto.DEFAULT
        for typed in ("float_data", "int32_data", "double_data"):
            tensor.ClearField(typed)
        tensor.data_type = ONNX_DTYPES[weight.dtype]
        tensor.raw_data = weight.view(torch.uint8).numpy().tobytes()
        found.add(tensor.name)
    missing = set(params) - found
    if missing:
        raise FailedPreconditionError(
            f"the traced segment graph holds no initializer for {sorted(missing)}"
        )
    return proto


def _names_every_weight(proto: Any, module: torch.nn.Module) -> bool:
    names = {tensor.name for tensor in proto.graph.initializer}
    return all(name in names for name, _ in module.named_parameters())


@contextlib.contextmanager
def _quiet_loggers() -> Iterator[None]:
    """Silence the exporter's pass-by-pass INFO logs and registration warnings."""
    names = ("onnx_ir", "onnxscript", "torch.onnx", "torch.onnx._internal.exporter._registration")
    loggers = [logging.getLogger(name) for name in names]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)
