#!/usr/bin/env bash
# The one command the GPU device call runs (issue 5): environment report, the standalone
# benchmark (loadtest.gpu_bench), the engine-level benchmark through LLMEngine
# (loadtest.gpu_bench_engine, merged into the same JSON), the bs=1 projection microbenchmark
# (loadtest.gpu_bench_gemv), then the gpu-marked tests. Each part
# has its own time limit and log under $OUT, so one failure or timeout keeps the others.
# The JSON report lands in $OUT/engine-h100.json (copy it to loadtest/results/).
# Needs .device/tokenizer (carried; made here by `python -m loadtest.gpu_bench_device_setup
# pack`): resolve_model("dummy:...") takes the default model's tokenizer, which the device lacks.
# Usage on the device, from the repository root: bash scripts/device_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=".:.device/pkgs${PYTHONPATH:+:$PYTHONPATH}"
export SLUICE_CACHE_DIR="${SLUICE_CACHE_DIR:-/tmp/sluice-device-cache}"
OUT=${OUT:-/tmp/sluice-device-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)"

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, report status
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  echo "== $name: exit $status after $((SECONDS - started)) s (limit $limit)"
  tail -n "${TAIL_LINES:-30}" "$OUT/$name.log" | grep -v "^ *$"
}

part setup 60 python3 -m loadtest.gpu_bench_device_setup unpack
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  part bench "${BENCH_TIMEOUT:-200}" python3 -m loadtest.gpu_bench \
    --copy-to "$OUT/engine-h100.json" --models "${MODELS:-llama-3-8b,llama-3.2-1b}"
fi
[ -f "$OUT/engine-h100.json" ] || cp loadtest/results/engine-h100.json "$OUT/engine-h100.json"
if [ "${SKIP_ENGINE:-0}" != "1" ]; then
  for shape in ${ENGINE_SHAPES:-llama-3-8b llama-3.2-1b}; do  # one process each: free memory
    part "engine-$shape" "${ENGINE_TIMEOUT:-150}" python3 -m loadtest.gpu_bench_engine \
      --shapes "$shape" --out "$OUT/engine-level-$shape.json" --merge-into "$OUT/engine-h100.json"
  done
fi
if [ "${SKIP_GEMV:-0}" != "1" ]; then  # bs=1 projection microbench (graph-timed), gemv.json
  part gemv "${GEMV_TIMEOUT:-150}" python3 -m loadtest.gpu_bench_gemv --json "$OUT/gemv.json"
fi
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  part gpu-tests "${TEST_TIMEOUT:-150}" python3 -m pytest tests/gpu -q -p no:cacheprovider \
    --durations=8
fi
