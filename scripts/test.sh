#!/usr/bin/env bash
# The whole check that CI runs: lint, format, import contracts, then every test (gpu tests skip
# without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SLUICE_VENV:-.venv}/bin/python
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$(dirname "$PY")/lint-imports" --no-cache  # contracts: pyproject.toml [tool.importlinter]
"$PY" -m pytest -q "$@"
