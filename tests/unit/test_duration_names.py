"""Every duration a user or a caller sets names its unit (`shutdown_grace_s`, `stream_max_hold_ms`).

Read from the source of services/, loadtest/ and benchmarks/, not by importing it: each
dataclass field typed float, and each argparse flag of type float, whose name speaks of time
(timeout, grace, interval, TTL, backoff, ...) must end in a unit suffix. Config dataclass fields
become `--flags` and `SLUICE_*` variables by their name (services/common/config.py), so this
also covers those.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "loadtest", "benchmarks")
# Words of a name (split on "_" or "-") that make it a duration; "retry after" is one too.
TIME_WORDS = frozenset(
    [
        "grace",
        "timeout",
        "interval",
        "ttl",
        "backoff",
        "delay",
        "duration",
        "lease",
        "period",
        "poll",
        "linger",
        "cooldown",
        "expiry",
        "warmup",
        "hold",
        "wait",
    ]
)
UNIT_SUFFIX = re.compile(r"[_-](s|ms|us|ns)$")


def _names_a_duration(name: str) -> bool:
    words = set(re.split(r"[_-]+", name.lower()))
    return bool(words & TIME_WORDS) or {"retry", "after"} <= words


def _sources() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    )


def _is_float(annotation: ast.expr | None) -> bool:
    return annotation is not None and "float" in ast.unparse(annotation)


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def _unitless_durations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _is_dataclass(node):
            for item in node.body:
                if (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and _is_float(item.annotation)
                    and _names_a_duration(item.target.id)
                    and not UNIT_SUFFIX.search(item.target.id)
                ):
                    found.append(f"{node.name}.{item.target.id}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("--")
        ):
            flag = str(node.args[0].value)
            typed_float = any(
                keyword.arg == "type" and ast.unparse(keyword.value) == "float"
                for keyword in node.keywords
            )
            if typed_float and _names_a_duration(flag) and not UNIT_SUFFIX.search(flag):
                found.append(flag)
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda path: str(path.relative_to(ROOT)))
def test_durations_carry_their_unit(path: Path) -> None:
    assert _unitless_durations(path) == []


def test_the_check_sees_a_unitless_field_and_flag(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class Config:\n"
        "    grace: float = 1.0\n"
        "    shutdown_grace_s: float = 1.0\n"
        "    stream_interval: int = 0\n"
        "    threshold: float = 0.5\n"
        "    retry_after: float = 1.0\n"
        "parser.add_argument('--timeout', type=float)\n"
        "parser.add_argument('--timeout-s', type=float)\n"
    )
    assert _unitless_durations(sample) == ["Config.grace", "Config.retry_after", "--timeout"]
