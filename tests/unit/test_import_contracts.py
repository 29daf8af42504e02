"""The import rules of the tree: import-linter's contracts, and what a process really loads.

`[tool.importlinter]` in pyproject.toml holds the layers (cli -> launchers and tools -> router |
tokenizer | engine -> common -> protos) and the forbidden imports; scripts/test.sh runs them too.
The contracts see every import, lazy or not, so what they cannot say is checked here by
importing in a fresh interpreter: the router and tokenizer servers load neither the engine
package nor torch, and the CLI loads the load-test harness only when `sluice bench` runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("services.router.server", ("services.engine", "torch")),
        ("services.tokenizer.server", ("services.engine", "torch")),
        ("services.cli", ("loadtest", "services.engine", "torch")),
    ],
)
def test_a_process_loads_only_its_own_layers(module: str, absent: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        f"loaded = sorted(m for m in sys.modules "
        f"if any(m == a or m.startswith(a + '.') for a in {absent!r}))\n"
        "print(loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
