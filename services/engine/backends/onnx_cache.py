"""The on-disk side of the ONNX export cache: manifest, verification and locking.

An export directory (backends/onnx_export.py) holds the segment graphs, their external weight
files and `manifest.json`: which graph files serve which segment kind, and each file's size and
sha256. `verify` checks every file against it (a truncated or overwritten file, a missing or
unreadable manifest) so that a corrupt cache is found before onnxruntime or TensorRT reads it;
`read_graphs` turns a verified directory into SegmentGraphs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.files import sha256_of

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class SegmentGraphs:
    """Where an export's graphs are: graph paths per segment kind (one per layer, or one)."""

    directory: Path
    graphs: dict[str, list[Path]]
    dtype: torch.dtype
    digests: dict[str, str] = field(default_factory=dict)  # file name -> sha256

    def path(self, kind: str, layer: int = 0) -> Path:
        return self.graphs[kind][layer]


def write_manifest(directory: Path, key: dict, graphs: dict[str, list[str]]) -> dict:
    """Record every file of `directory` (size, sha256) and the graphs of each segment kind."""
    files = {
        path.name: {"size": path.stat().st_size, "sha256": sha256_of(path)}
        for path in sorted(Path(directory).iterdir())
        if path.name != MANIFEST
    }
    manifest = {"key": key, "graphs": graphs, "files": files}
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify(directory: Path) -> str | None:
    """What is wrong with an export directory (a file's size or checksum), or None."""
    manifest_path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        graphs = manifest["graphs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    for name in (name for names in graphs.values() for name in names):
        if name not in files:
            return f"graph {name} is not in {MANIFEST}"
    for name, expected in files.items():
        path = Path(directory) / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size} bytes, expected {expected.get('size')}"
        if sha256_of(path) != expected.get("sha256"):
            return f"{name} does not match its sha256"
    return None


def read_graphs(directory: Path, dtype: torch.dtype) -> SegmentGraphs:
    """The graphs an export directory's manifest lists."""
    manifest = json.loads((directory / MANIFEST).read_text())
    graphs = {
        kind: [directory / name for name in names] for kind, names in manifest["graphs"].items()
    }
    digests = {name: entry["sha256"] for name, entry in manifest["files"].items()}
    return SegmentGraphs(directory=directory, graphs=graphs, dtype=dtype, digests=digests)
