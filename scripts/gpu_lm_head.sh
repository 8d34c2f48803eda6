#!/usr/bin/env bash
# The Mosaic GPU LM head on the GPU in one device call (run DB, docs/BENCHMARKS.md): its tests compiled, the read
# bandwidth of this machine, the kernel alone against the Triton one (4 copies of the 175 MB head), and the served
# decode step with the Triton head (base) and the tiled Mosaic head (lm_head_tiles) at batch 1 / 100K and batch 8 / 8K.
#   bash scripts/gpu_lm_head.sh        (repo root, through the device tool with carry=[".whl"]; writes under $OUT)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.mem --format=csv | tee "$OUT/gpu.txt"
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null
quiet() { grep -v "^W0\|^I0\|^E0" | cut -c1-600; }
FLINT_PALLAS_COMPILED=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_mosaic_nvfp4.py \
  tests/test_kernels_gemv.py -k "lm_head or logits" 2>&1 | tail -15 | tee "$OUT/tests.txt"
timeout 60 python3 -c "import sys; sys.path.insert(0, 'scripts'); import bench_decode, json; \
print(json.dumps(bench_decode.hbm_bandwidth()))" 2>&1 | quiet | tee "$OUT/bandwidth.txt"
timeout 150 python3 scripts/probe_mosaic_nvfp4.py --out "$OUT/probe" --layers 4 --shapes lm_head \
  --variants q1_st4_s2_f32 2>&1 | quiet
timeout 200 python3 scripts/profile_decode.py --out "$OUT/served_b1" --served --context 100000 \
  --variants base,lm_head_tiles 2>&1 | quiet | grep -v "^|"
timeout 150 python3 scripts/profile_decode.py --out "$OUT/served_b8" --served --batch 8 --context 8192 \
  --variants base,lm_head_tiles 2>&1 | quiet | grep -v "^|"
