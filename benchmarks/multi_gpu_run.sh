#!/usr/bin/env bash
# The several-GPU benchmark and the tensor-parallel GPU tests in one command, on a host with
# 2+ NVIDIA GPUs (on 4 x H200 the benchmark took 220 s and the tests 90 s):
#
#   bash benchmarks/multi_gpu_run.sh        # from the repository root
#
# Wheels and the dummy shapes' tokenizer as for benchmarks/gpu_stack_run.sh (.gpu_run/).
# Environment: OUT (default /tmp/sluice-multi-gpu), PYTHON (python3), BENCH_ARGS (extra flags
# of benchmarks.multi_gpu), BENCH_TIMEOUT and TEST_TIMEOUT (seconds), SKIP_TESTS=1.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off, in this shell and every child (see services/engine/parallel).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/sluice-multi-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv \
  | tee "$OUT/nvidia-smi.txt" || { echo "error: nvidia-smi failed" >&2; exit 2; }
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh
started=$SECONDS
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-390}" "$PYTHON" -m benchmarks.multi_gpu --out "$OUT/multi-gpu.json" \
  ${BENCH_ARGS:-} > "$OUT/multi-gpu.log" 2>&1
echo "== multi_gpu: exit $? after $((SECONDS - started)) s"
grep -v "^ *$" "$OUT/multi-gpu.log" | tail -n 30
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  # One pytest process per file: the 70B test needs the GPUs to itself.
  for name in test_tensor_parallel test_tensor_parallel_fp8 test_tensor_parallel_70b; do
    started=$SECONDS
    timeout "${TEST_TIMEOUT:-240}" "$PYTHON" -m pytest "tests/gpu/$name.py" -q -p no:cacheprovider \
      --durations=5 -rA -o faulthandler_timeout=200 > "$OUT/$name.log" 2>&1
    echo "== tests/gpu/$name.py: exit $? after $((SECONDS - started)) s"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E |passed|failed" "$OUT/$name.log" | tail -n 20
  done
fi
