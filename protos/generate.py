"""Regenerates the Python stubs from the .proto files (python -m protos.generate).

The stubs are committed so a fresh clone imports without a build step;
tests/unit/test_protos.py fails when they differ from what this script produces.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos") / "sluice" / "v1"


def proto_files() -> list[str]:
    return sorted(str(PROTO_DIR / p.name) for p in (ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir (mirrored)."""
    from grpc_tools import protoc  # build-time dependency (test extras)

    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_files(),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def main() -> None:
    generate(ROOT)
    print(f"generated stubs for {len(proto_files())} protos", file=sys.stderr)


if __name__ == "__main__":
    main()
