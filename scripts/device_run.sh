#!/usr/bin/env bash
# The one command the GPU device call runs (issue 5): environment report, the gpu-marked
# kernel/model tests, then the full benchmark. Everything lands in $OUT; the JSON report is
# also written to loadtest/results/engine-h100.json on the device (copy it back from $OUT).
# Usage on the device, from the repository root: bash scripts/device_run.sh [gpu_bench args]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sluice-device-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu -q -p no:cacheprovider \
    > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests exit: $?"
  tail -25 "$OUT/gpu-tests.log"
fi
timeout "${BENCH_TIMEOUT:-420}" python3 -m loadtest.gpu_bench --copy-to "$OUT/engine-h100.json" \
  "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^ *$" | tail -80
