#!/usr/bin/env bash
# Everything GPU-side in one packed device call, each part under its own time limit, in the order given.
#   bash scripts/gpu_session.sh TOTAL_SECONDS [PART ...]
# Parts (default: tests profile decode prefill weights):
#   tests     the kernel tests compiled on the GPU (FLINT_PALLAS_COMPILED=1): attention, GEMV, MoE, prefill
#   tests_all every kernel test file compiled on the GPU (attention, GEMV, MoE, the Pallas path, sampling, Mosaic
#             NVFP4, prefill attention, grouped GEMMs; ~330 cases; junit XML in the pack)
#   tests_attention  the compiled attention-kernel and Pallas decode-path test files (junit XML in the pack)
#   tests_moe  only the compiled router / MoE-block tests (top-k in the router's last program, persistent kernel)
#   tests_fold  only the compiled tests of the split-partials fold (in-kernel combine, split rings)
#   profile   device trace of the NVFP4 Pallas decode step at 100K, once per kernel-knob variant ($PROFILE_VARIANTS):
#             per-kernel time inside the whole step (scripts/profile_decode.py)
#   profile_bf16  the same for BF16, Pallas and the XLA reference
#   decode    end-to-end decode benchmark (issue 6): NVFP4 and BF16, both impls, batch 1 and 8, 8K..262K
#             (DECODE_SERVED_STEPS=0 skips the engine-burst point: compiling and timing its 4-step program
#             took 114 s in run F)
#   decode8   the same for NVFP4 Pallas at batch 8 (8K, 32K, 100K)
#   prefill   8K prefill and 100K TTFT (issue 7), kernels checked against references first
#   prefill_check  only the prefill kernels against their references (incl. grouped_matmul.NVFP4_LINEAR_LHS)
#   tune      device time of each weight-streaming kernel over a grid of block settings (scripts/tune_weight_kernels.py)
#   dispatch  host dispatch cost of the decode step at Flint's buffer count (scripts/dispatch_overhead.py)
#   weights   the weight-streaming kernel benchmark (issue 4)
#   attention the attention kernel benchmark and its sweeps (issue 5)
#   tests_fp8    the compiled tests of FP8 full caches (both V layouts, keys on the dots' M, FP16 dots, prefill reads)
#   profile_fp8  the NVFP4 step at 100K on FP8 full caches, batch 1 then 8: the default kernel (V key-major) against
#                V transposed with the keys on M (run EU's first default). $PROFILE_FP8_VARIANTS adds batch-1 variants
#                (run EU also timed V transposed with fp8_heads_on_m, fp8_bk256, attn_two_waves: slower; five
#                variants took 360 s on an H100)
#   decode_fp8   bench_decode on FP8 full caches: batch 1 at 100K, 262K and 8K (with the engine burst at 100K)
#                ($DECODE_FP8_WEIGHTS=nvfp4,bf16 adds BF16 weights: an H200 only, they do not fit an H100;
#                $DECODE_FP8_CONTEXTS, $DECODE_FP8_SERVED_STEPS=0 and $DECODE_FP8_XLA_POINTS= shorten it)
#   fp8sweep     the FP8 full-layer kernel alone over its warps / stages / block / splits grid, batch 1 and 8 at 100K
#                (scripts/bench_kernels_attention.py --sections bw,fp8sweep; run EX timed it on an H100)
#   ttft_fp8     the 100K TTFT on the engine's path with FP8 full caches (bench_prefill.py --kv-dtype fp8)
#   splits_fit   decode_attention.SPLITS_FIT_MAX_LEN: its compiled tests, then the NVFP4 step on a 2,040-token BF16
#                cache (8 against 64 full-layer splits) and, on an H200, on an 8,192-token FP8 cache (64 against 128)
#   splits_fit_8k  only the latter
#   persistent   scripts/probe_pdl.py's persistent Mosaic GPU chain against one kernel per layer, one process per
#                variant ($PERSISTENT_VARIANTS; default: the two not yet run after runs FM-FO, their base, `mosaic`)
# Run from the repo root through the device tool with carry=[".whl"] (the gguf wheel), e.g.
#   bash scripts/gpu_session.sh 560 tests profile
# Each part writes under a work folder; at the end everything is packed into $OUT/gpu_session.tgz (the device tool
# returns at most 8 files) and the Markdown summaries are copied beside it.
set -u
total=${1:-540}
shift || true
parts=${*:-tests profile decode prefill weights}
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
git status --short >> "$work/commit.txt" 2>/dev/null || true

left() { echo $(( total - ($(date +%s) - start) )); }
part() {  # part NAME SECONDS COMMAND...: run with a limit that never exceeds what is left
  local name=$1 want=$2; shift 2
  local budget; budget=$(left); [ "$want" -lt "$budget" ] && budget=$want
  if [ "$budget" -lt 30 ]; then echo "[$name] skipped: no time left" | tee -a "$work/summary.txt"; return; fi
  echo "[$name] up to ${budget}s: $*" | tee -a "$work/summary.txt"
  timeout "$budget" "$@" > "$work/$name.log" 2>&1
  echo "[$name] exit $? after $(( $(date +%s) - start ))s total" | tee -a "$work/summary.txt"
  grep -v '^|' "$work/$name.log" | tail -30
}

compiled_tests() {  # compiled_tests NAME SECONDS PYTEST_ARGS...: kernel tests on the GPU, junit XML in the pack
  local name=$1 want=$2; shift 2
  part "$name" "$want" env FLINT_PALLAS_COMPILED=1 python3 -m pytest -q -rfE -p no:cacheprovider \
    --junitxml="$work/$name.xml" "$@"
}
splits_fit_step() {  # splits_fit_step NAME CONTEXT KV_DTYPE: the NVFP4 step with and without SPLITS_FIT_MAX_LEN
  part "$1" ${SPLITS_FIT_LIMIT:-150} python3 scripts/profile_decode.py --out "$work/$1" --weights nvfp4 \
    --impls pallas --context "$2" --kv-dtype "$3" --variants base,splits_past_max_len,base
}

for p in $parts; do
  case $p in
    tests) part tests 100 env FLINT_PALLAS_COMPILED=1 python3 -m pytest -q -p no:cacheprovider \
             tests/test_kernels_attention.py tests/test_kernels_gemv.py tests/test_kernels_moe.py tests/test_mosaic_nvfp4.py ;;
    tests_all) compiled_tests tests_all ${TESTS_ALL_LIMIT:-540} tests/test_kernels_attention.py \
             tests/test_kernels_gemv.py tests/test_kernels_moe.py tests/test_pallas_path.py tests/test_kernels_sampling.py \
             tests/test_mosaic_nvfp4.py tests/test_kernels_prefill_attention.py tests/test_kernels_grouped_matmul.py ;;
    tests_attention) compiled_tests tests_attention ${TESTS_ATTENTION_LIMIT:-300} tests/test_kernels_attention.py \
             tests/test_pallas_path.py ;;
    tests_moe) part tests_moe ${TESTS_MOE_LIMIT:-60} env FLINT_PALLAS_COMPILED=1 python3 -m pytest -q -p no:cacheprovider \
             tests/test_kernels_moe.py -k "route or moe_block or persistent" ;;
    tests_fold) part tests_fold 50 env FLINT_PALLAS_COMPILED=1 python3 -m pytest -q -p no:cacheprovider \
             tests/test_kernels_attention.py -k "combine or split_ring or ring_split" ;;
    profile) part profile ${PROFILE_LIMIT:-250} python3 scripts/profile_decode.py --out "$work/profile" --weights nvfp4 \
             --impls pallas --context 100000 --variants "${PROFILE_VARIANTS:-base,prefetch,bk1024,attn_bk128,attn_splits64}" ;;
    profile_bf16) part profile_bf16 120 python3 scripts/profile_decode.py --out "$work/profile_bf16" \
             --weights bf16 --impls pallas,xla --context 100000 ;;
    decode) part decode ${DECODE_LIMIT:-330} python3 scripts/bench_decode.py --out "$work/decode" --weights nvfp4,bf16 \
             --impls ${DECODE_IMPLS:-pallas,xla} --batches ${DECODE_BATCHES:-1,8} --contexts 100000,8192,32768,262144 \
             --xla-points 1:100000 --served-steps ${DECODE_SERVED_STEPS:-4} --budget-s ${DECODE_BUDGET:-300} ;;
    decode8) part decode8 ${DECODE8_LIMIT:-120} python3 scripts/bench_decode.py --out "$work/decode8" --weights nvfp4 \
             --impls pallas --batches 8 --contexts 100000,8192,32768 --served-steps 0 --budget-s ${DECODE8_BUDGET:-100} ;;
    prefill_check) part prefill_check ${PREFILL_CHECK_LIMIT:-120} python3 scripts/bench_prefill.py --check \
             --out "$work/prefill_check" --skip moe,attn,prefill,ttft,jax --no-sweep --budget-s 100 ;;
    prefill) part prefill ${PREFILL_LIMIT:-200} python3 scripts/bench_prefill.py ${PREFILL_ARGS:---check} --no-sweep \
             --skip ${PREFILL_SKIP:-moe,attn} --out "$work/prefill" --budget-s ${PREFILL_BUDGET:-180} ;;
    tune) part tune ${TUNE_LIMIT:-240} python3 scripts/tune_weight_kernels.py --out "$work/tune" \
             --budget-s $(( ${TUNE_LIMIT:-240} - 20 )) ;;
    dispatch) part dispatch ${DISPATCH_LIMIT:-90} sh -c 'python3 scripts/dispatch_overhead.py --impl pallas && python3 scripts/dispatch_overhead.py --impl xla' ;;
    weights) part weights 90 env TESTS=0 OUT="$work/weights" bash scripts/gpu_kernels_weights.sh --budget-s 60 ;;
    attention) part attention 150 python3 scripts/bench_kernels_attention.py --out "$work/attention" --skip-tests ;;
    tests_fp8) part tests_fp8 ${TESTS_FP8_LIMIT:-180} env FLINT_PALLAS_COMPILED=1 python3 -m pytest -q -p no:cacheprovider \
             tests/test_kernels_attention.py tests/test_kernels_prefill_attention.py tests/test_pallas_path.py \
             -k "fp8 or fp16 or values_dot or transposed or layouts or granules or attention_block_decode_steps or full_attention_matches" ;;
    profile_fp8) part profile_fp8 ${PROFILE_FP8_LIMIT:-360} sh -c "python3 scripts/profile_decode.py \
             --out $work/profile_fp8 --weights nvfp4 --impls pallas --context 100000 --kv-dtype fp8 \
             --variants ${PROFILE_FP8_VARIANTS:-base,fp8_v_transposed} && \
             python3 scripts/profile_decode.py --out $work/profile_fp8_b8 --weights nvfp4 --impls pallas \
             --context 100000 --kv-dtype fp8 --batch 8 --variants base,fp8_v_transposed" ;;
    decode_fp8) part decode_fp8 ${DECODE_FP8_LIMIT:-330} python3 scripts/bench_decode.py --out "$work/decode_fp8" \
             --weights ${DECODE_FP8_WEIGHTS:-nvfp4} --impls pallas:stacked --batches 1 \
             --contexts ${DECODE_FP8_CONTEXTS:-100000,262144,8192} --served-steps ${DECODE_FP8_SERVED_STEPS:-4} \
             ${DECODE_FP8_XLA_POINTS+--xla-points "$DECODE_FP8_XLA_POINTS"} --kv-dtype fp8 --budget-s ${DECODE_FP8_BUDGET:-300} ;;
    fp8sweep) part fp8sweep ${FP8SWEEP_LIMIT:-200} python3 scripts/bench_kernels_attention.py --out "$work/fp8sweep" \
             --skip-tests --sections bw,fp8sweep ;;
    ttft_fp8) part ttft_fp8 ${TTFT_FP8_LIMIT:-150} python3 scripts/bench_prefill.py --out "$work/ttft_fp8" \
             --weights nvfp4 --kv-dtype fp8 --skip moe,attn,jax,extras,prefill,routing --no-sweep \
             --budget-s $(( ${TTFT_FP8_LIMIT:-150} - 15 )) ;;
    splits_fit) compiled_tests splits_fit_tests 90 tests/test_kernels_attention.py \
             -k "fit_the_cache or attention_block_decode_steps or decode_attention_full"
             splits_fit_step splits_fit_2k 2040 bf16  # the engine's 2,048-slot cache: 8 full-layer splits, not 64
             grep -q H200 "$work/gpu.txt" && splits_fit_step splits_fit_8k 8192 fp8 ;;  # 64, not 128
    splits_fit_8k) splits_fit_step splits_fit_8k 8192 fp8 ;;
    persistent) for v in ${PERSISTENT_VARIANTS:-persistent_stacked_gpu_split persistent_stacked_gpu_split_xfirst \
                   persistent_stacked_gpu mosaic}; do  # one process each: a hung kernel costs only its limit
                  part "persistent_$v" ${PERSISTENT_LIMIT:-90} python3 scripts/probe_pdl.py \
                    --out "$work/persistent_$v" --variants "$v" --steps 20
                done ;;
    *) echo "unknown part $p" | tee -a "$work/summary.txt" ;;
  esac
done

tar czf "$OUT/gpu_session.tgz" -C "$work" .
cp "$work/summary.txt" "$OUT/"
for f in profile/profile.md profile_bf16/profile.md decode/results.md decode8/results.md prefill/bench_prefill.md \
         prefill_check/bench_prefill.md splits_fit_2k/profile.md splits_fit_8k/profile.md profile_fp8/profile.md \
         profile_fp8_b8/profile.md decode_fp8/results.md ttft_fp8/bench_prefill.md; do
  [ -f "$work/$f" ] && cp "$work/$f" "$OUT/$(dirname "$f").md"
  [ -f "$work/$(dirname "$f")/results.json" ] && cp "$work/$(dirname "$f")/results.json" "$OUT/$(dirname "$f").json"
done
[ -f "$work/fp8sweep/attention_bench.json" ] && cp "$work/fp8sweep/attention_bench.json" "$OUT/fp8sweep.json"
cat "$work/summary.txt"
