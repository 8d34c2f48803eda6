#!/usr/bin/env bash
# Nsight Compute over one decode step's kernels (scripts/ncu_decode.py: a few full-width Flint layers, Pallas path).
#   bash scripts/ncu_decode.sh OUT_DIR [ncu_decode.py arguments...]
# Writes OUT_DIR/ncu_raw.csv (every collected metric, a row per kernel launch), OUT_DIR/ncu_details.csv (the
# sections as ncu prints them), OUT_DIR/ncu.md (scripts/ncu_table.py's summary) and OUT_DIR/ncu_run.log.
# $NCU_KERNELS (a regex over kernel names), $NCU_SKIP / $NCU_COUNT (launches of matching kernels to skip, then to
# profile; default: skip the warm-up step's 26 of the default 4 layers, profile the next step's 26) change what is
# profiled. WarpStateStats collects the per-reason stall metrics (smsp__average_warps_issue_stalled_*), which
# the raw page lists. XLA's command buffers are turned off so that every kernel is launched, and replayed, on its own.
set -u
out=${1:?usage: bash scripts/ncu_decode.sh OUT_DIR [ncu_decode.py arguments...]}
shift
mkdir -p "$out"
NCU=${NCU:-ncu}
kernels=${NCU_KERNELS:-qkv_projection|decode_attention|linear_nvfp4|router_logits|moe_gate_up|moe_down|swiglu}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
# Kernel replay saves, before a kernel's first pass, every allocation the kernel can reach: with XLA's preallocated
# pool that is most of the GPU's memory. One allocation per buffer keeps it to what the few layers use.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
export XLA_PYTHON_CLIENT_ALLOCATOR=${XLA_PYTHON_CLIENT_ALLOCATOR:-platform}
# In run FC (2026-12-06) ncu crashed (exit 139) as it attached on a freshly started machine, and the same command ran
# through when repeated: a crash that leaves no report is tried once more. A report left by an earlier run in the
# same folder is removed first, so that neither the retry test nor the import below can take it for this run's.
rm -f "$out/ncu.ncu-rep"
for attempt in 1 2; do
  "$NCU" --kernel-name "regex:$kernels" --launch-skip "${NCU_SKIP:-26}" --launch-count "${NCU_COUNT:-26}" \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    --export "$out/ncu" --force-overwrite python3 scripts/ncu_decode.py "$@" > "$out/ncu_run.log" 2>&1
  rc=$?
  echo "ncu exit $rc (attempt $attempt)"; tail -5 "$out/ncu_run.log"
  [ "$rc" -ge 128 ] && [ ! -f "$out/ncu.ncu-rep" ] || break
done
[ -f "$out/ncu.ncu-rep" ] || exit 1
"$NCU" --import "$out/ncu.ncu-rep" --csv --page raw > "$out/ncu_raw.csv"
"$NCU" --import "$out/ncu.ncu-rep" --csv --page details > "$out/ncu_details.csv"
python3 scripts/ncu_table.py "$out/ncu_raw.csv" > "$out/ncu.md" && cat "$out/ncu.md"
