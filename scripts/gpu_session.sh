#!/usr/bin/env bash
# Everything GPU-side in one packed device call, each part under its own time limit, most important first:
#   1. the end-to-end decode benchmark (issue 6): NVFP4, both impls, batch 1, 100K / 8K / 32K / 262K
#   2. the attention kernels: compiled tests + benchmark (issue 5)
#   3. the prefill benchmark with its GPU check (issue 7)
#   4. the weight-streaming kernels: compiled tests + benchmark (issue 4)
#   5. the end-to-end decode benchmark again for BF16 and batches 2-8, if time is left
# Run from the repo root through the device tool with carry=[".whl"] (the gguf wheel), e.g.
#   bash scripts/gpu_session.sh 540
# Each part writes under a work folder; at the end everything is packed into $OUT/gpu_session.tgz (the device tool
# returns at most 8 files) and each part's Markdown summary is copied beside it.
set -u
total=${1:-540}
start=$(date +%s)
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
work=/tmp/gpu_session
rm -rf "$work"; mkdir -p "$work" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv > "$work/gpu.txt" 2>&1
git rev-parse HEAD > "$work/commit.txt" 2>/dev/null || true

left() { echo $(( total - ($(date +%s) - start) )); }
part() {  # part NAME SECONDS COMMAND...: run with a limit that never exceeds what is left
  local name=$1 want=$2; shift 2
  local budget; budget=$(left); [ "$want" -lt "$budget" ] && budget=$want
  if [ "$budget" -lt 30 ]; then echo "[$name] skipped: no time left" | tee -a "$work/summary.txt"; return; fi
  echo "[$name] up to ${budget}s: $*" | tee -a "$work/summary.txt"
  timeout "$budget" "$@" > "$work/$name.log" 2>&1
  echo "[$name] exit $? after $(( $(date +%s) - start ))s total" | tee -a "$work/summary.txt"
  tail -25 "$work/$name.log"
}

part decode_nvfp4 170 python3 scripts/bench_decode.py --out "$work/decode_nvfp4" --weights nvfp4 --impls pallas,xla \
  --batches 1 --contexts 100000,8192,32768,262144 --xla-points 1:100000 --budget-s 140
part attention 110 python3 scripts/bench_kernels_attention.py --out "$work/attention"
part prefill 110 python3 scripts/bench_prefill.py --check --out "$work/prefill" --budget-s 90
part weights 90 env TESTS=1 TEST_TIMEOUT=40 OUT="$work/weights" bash scripts/gpu_kernels_weights.sh --budget-s 45
part decode_more 150 python3 scripts/bench_decode.py --out "$work/decode_more" --weights bf16,nvfp4 --impls pallas \
  --batches 1,8 --contexts 100000,32768 --xla-points 1:100000 --budget-s 120

tar czf "$OUT/gpu_session.tgz" -C "$work" .
cp "$work/summary.txt" "$OUT/"
for f in decode_nvfp4/results.md decode_more/results.md; do
  [ -f "$work/$f" ] && cp "$work/$f" "$OUT/$(dirname "$f").md"
done
cat "$work/summary.txt"
