#!/bin/bash
# Issue 4 on the device machine: optional compiled test run, then the weight-streaming benchmark.
# Run from the repo root with the .whl folder carried:
#   TESTS=1 bash scripts/gpu_kernels_weights.sh --budget-s 180 --sweep
# Writes everything under $OUT (bench_kernels_weights.{json,md,log}, pytest.log, gpu.txt).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import flint_jax.pallas_kernels.gemv" 2>/dev/null || echo "note: package not importable; the bench maps the folders itself"
if [ "${TESTS:-0}" = "1" ]; then
  # The CI tests, compiled on the GPU instead of interpreted.
  PYTHONPATH=$PWD:${PYTHONPATH:-} FLINT_PALLAS_COMPILED=1 timeout "${TEST_TIMEOUT:-120}" \
    python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_gemv.py tests/test_kernels_moe.py 2>&1 | tee "$OUT/pytest.log" | tail -15
fi
python3 scripts/bench_kernels_weights.py --out "$OUT" "$@"
