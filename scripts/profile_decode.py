"""Where a decode step's time goes: a device trace of the jitted Flint decode step, kernels grouped by name.

Builds the full-shape model with synthetic weights (as `bench_decode.py` does), compiles the decode forward for one
(weights, impl, batch, context), runs a few steps under `jax.profiler.trace`, and reads the GPU kernel events back
from the Perfetto trace: per kernel name the launches per step, the mean and total microseconds, and the share of
the step; the step's device time (first kernel start to last kernel end, flint_jax.device_trace) and its wall time
(which includes the host's dispatch when the host is the slower side).

    python scripts/profile_decode.py --out /tmp/prof --weights nvfp4 --impl pallas --context 8192
    python scripts/profile_decode.py --tiny --out /tmp/prof      # CPU smoke run (no GPU events: says so)

`--variants base,prefetch,...` profiles the Pallas step once per variant: a variant sets kernel-module knobs that
are read at trace time (VARIANTS below), so each kernel's time is compared inside the whole step, with the same
data and the same cache state, rather than in an isolated micro-benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The benchmark owns the GPU: let JAX take 92% of its memory rather than 75%. Flint's BF16 weights are 80 GB, and
# stacking them (layer_stack, one chunk at a time) ran out of memory on the H200 at 75% (runs BT, BU).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_decode import count_kernels, log, make_steps, random_state, time_steps, trace_steps  # noqa: E402
from flint_jax import device_trace  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from flint_jax.device_memory import model_shortfall  # noqa: E402


def _variants():
    from flint_jax.pallas_kernels import attention_prologue as AP
    from flint_jax.pallas_kernels import decode_attention as DA
    from flint_jax.pallas_kernels import gemv as G
    from flint_jax.pallas_kernels import grid_sync as GS
    from flint_jax.pallas_kernels import moe_experts as ME
    from flint_jax.pallas_kernels import moe_persistent as MP
    from flint_jax import pallas_path as PP
    from flint_jax.pallas_kernels import router as RT
    from flint_jax.pallas_kernels import weight_tiles as WT
    from flint_jax import state as ST
    FP8_AS_EP = [(DA, "FP8_HALF_SCORES", False), (DA, "FP8_HALF_VALUES", False), (DA, "FP8_BLOCK_K", 64),
                 (ST, "FP8_V_TRANSPOSED", False)]
    variants = {
        "base": [],
        "prefetch": [(G, "TABLE_PREFETCH", True), (ME, "GATE_UP_BLOCK", (8, 512, 4, 3, False, True))],
        "prefetch_gemv": [(G, "TABLE_PREFETCH", True)],  # QKV / O / dense only (run A: gate/up got slower)
        "ring_splits16": [(DA, "RING_SPLITS", 16)],  # one 64-key block per split, 9 of 16 splits hold keys
        "bk1024": [(G, "TABLE_BK", 1024), (ME, "GATE_UP_BLOCK", (8, 1024, 4, 3))],  # now the table for K < 4096
        "attn_bk128": [(DA, "BLOCK_K", 128)],
        "attn_warps8": [(DA, "NUM_WARPS", 8), (DA, "RING_NUM_WARPS", 8)],
        # full layers only (the rings keep RING_NUM_WARPS): fewer warps per program, no cross-warp reductions in a
        # key block's softmax; with attn_two_waves twice the programs (an FP8 cache's stages take half the shared
        # memory, so more programs fit on an SM)
        # (NUM_WARPS and TARGET_PROGRAMS reach BF16 caches, and FP8 ones only where decode_attention.FP8_FULL_BY_DEVICE
        # does not set them for the GPU: it does on an H200; the fp8_* variants set FP8_NUM_WARPS / FP8_TARGET_PROGRAMS)
        "attn_warps2": [(DA, "NUM_WARPS", 2)],
        # the values' dot (rings and full layers): two BF16 dots on p's hi and lo parts, V as BF16 (no FP32 copy);
        # or one BF16 dot (p rounded to BF16: coarser than the reference, a probe of what the dot costs)
        "attn_pv_bf16x2": [(DA, "PV_MODE", "bf16x2")],
        "attn_pv_bf16": [(DA, "PV_MODE", "bf16")],
        # an FP8 cache as runs EO-EP ran it (BF16 scores, TF32 values, 64-key blocks), its tiles decoded by Triton's
        # casts (EO-EP's default) or by inline PTX (the default of runs EK-EN)
        "fp8_casts": [(DA, "FP8_PTX", False), *FP8_AS_EP],
        "fp8_ptx": [(DA, "FP8_PTX", True), *FP8_AS_EP],
        # an FP8 cache's dots on FP16 operands (E4M3 -> FP16 is one conversion per two values): both (the default
        # since run ER, with 128-key blocks), or one of them
        "fp8_f16": [(DA, "FP8_HALF_SCORES", True), (DA, "FP8_HALF_VALUES", True)],
        "fp8_f16_scores": [(DA, "FP8_HALF_SCORES", True), (DA, "FP8_HALF_VALUES", False)],
        "fp8_f16_values": [(DA, "FP8_HALF_SCORES", False), (DA, "FP8_HALF_VALUES", True)],
        "fp8_bk64": [(DA, "FP8_BLOCK_K", 64)],  # an FP8 cache's full layers in 64-key blocks (like BF16's)
        "fp8_bk128": [(DA, "FP8_BLOCK_K", 128)],  # the same bytes per block as BF16's 64 keys
        "fp8_bk256": [(DA, "FP8_BLOCK_K", 256)],  # run EU's ran on V transposed: fp8_v_transposed+fp8_bk256 now
        "fp8_warps8": [(DA, "FP8_NUM_WARPS", 8)],  # full layers only (the rings keep RING_NUM_WARPS)
        # full layers' split chunks in whole blocks (before SPLIT_GRANULE: FP8 at 100K, B = 1: 61 splits of 1,664 keys)
        "split_blocks": [(DA, "SPLIT_GRANULE", None)],
        # full layers' splits past the data store nothing, and `combine` first loads the position to know which
        # splits to read (before NEUTRAL_PARTIALS)
        "partials_with_data": [(DA, "NEUTRAL_PARTIALS", False)],
        # full layers' splits load their first key block before the query's prologue (DA.FULL_PRELOAD)
        "full_preload": [(DA, "FULL_PRELOAD", True)],
        # full layers in fewer warps per program and as many more splits (the SMs as full; fewer cross-warp
        # reductions and barriers per key block), 64-key FP8 blocks so that 4 or 8 programs' stages fit an SM
        "fp8_warps2_splits": [(DA, "FP8_NUM_WARPS", 2), (DA, "FP8_TARGET_PROGRAMS", 528), (DA, "FP8_BLOCK_K", 64)],
        # full layers in 4-warp programs and twice the splits (528 programs): with 128 registers a thread four
        # 4-warp programs fit an SM, and 64-key FP8 blocks keep four programs' 3 stages in its shared memory; run
        # FC's ncu saw the default's 256 programs hold ~1.9 programs an SM, half the occupancy the registers allow
        "fp8_splits128": [(DA, "FP8_NUM_WARPS", 4), (DA, "FP8_TARGET_PROGRAMS", 528), (DA, "FP8_BLOCK_K", 64)],
        # full layers in 2-warp programs at the default splits (the best batch-1 point of runs EX and FD's sweep)
        "fp8_warps2": [(DA, "FP8_NUM_WARPS", 2), (DA, "FP8_TARGET_PROGRAMS", 264), (DA, "FP8_BLOCK_K", 64)],
        # an FP8 cache's full layers as the H200 ran them before run FI (its default since: 64-key blocks, 2 warps,
        # 528 programs): 128-key blocks in 4-warp programs, 264 programs
        "fp8_h200_before_FI": [(DA, "FP8_BLOCK_K", 128), (DA, "FP8_NUM_WARPS", 4), (DA, "FP8_TARGET_PROGRAMS", 264)],
        "fp8_warps1_splits": [(DA, "FP8_NUM_WARPS", 1), (DA, "FP8_TARGET_PROGRAMS", 1056), (DA, "MAX_SPLITS", 256),
                              (DA, "FP8_BLOCK_K", 64), (DA, "NUM_STAGES", 2)],
        # an FP8 cache's V key-major like K (the default: runs EJ-ET's layout; state built in the variant), or
        # transposed with the keys on the dots' M dimension (run EU's default), or transposed with the query heads on M
        "fp8_v_key_major": [(ST, "FP8_V_TRANSPOSED", False)],
        "fp8_v_transposed": [(ST, "FP8_V_TRANSPOSED", True)],
        "fp8_heads_on_m": [(ST, "FP8_V_TRANSPOSED", True), (DA, "KEYS_AS_M", False)],
        "ring_warps4": [(DA, "RING_NUM_WARPS", 4)],  # the ring kernels as before run BD
        "attn_splits64": [(DA, "MAX_SPLITS", 64)],  # run O's variant; the default since (one wave at B = 1)
        "attn_stages4": [(DA, "NUM_STAGES", 4)],
        # full layers below 16K: smaller split chunks (MIN_CHUNK 256 gives 8K 32 splits of 256 keys; not yet measured)
        "attn_min_chunk128": [(DA, "MIN_CHUNK", 128)],
        "attn_min_chunk64": [(DA, "MIN_CHUNK", 64)],
        # full layers split by the program target alone, also past the splits a short cache can fill (before
        # SPLITS_FIT_MAX_LEN: this script's 8,200-slot cache at --context 8192, on the H200's FP8 setting, 128 splits
        # instead of 64)
        "splits_past_max_len": [(DA, "SPLITS_FIT_MAX_LEN", False)],
        "hot_weights": [],  # no knobs: its parameters differ (PARAM_VARIANTS)
        "lm_head_tiles": [],  # served step: the LM head tiled for the Mosaic GPU kernel (PARAM_VARIANTS)
        "ring_splits4": [(DA, "RING_SPLITS", 4)],
        "ring_loop": [(DA, "RING_PRELOAD", False)],  # splits of two blocks, a loop over them (run G's kernel)
        "attn_two_waves": [(DA, "TARGET_PROGRAMS", 528)],  # full layers: 128 splits at B = 1 (before run O)
        # the split partials folded by the last-arriving program (the default before run DF): the rings, and the
        # full layers at B >= 4 (16 or 8 splits)
        "fold_in_kernel": [(DA, "COMBINE_IN_KERNEL", True)],
        "rope_table": [(DA, "ROPE_TABLE", True)],  # sliding layers: cos/sin from a per-step XLA table (default, DI)
        "rope_in_kernel": [(DA, "ROPE_TABLE", False)],  # cos/sin evaluated in every ring program (before run DI)
        "topk_per_program": [(ME, "ROUTE_IN_ROUTER", False)],  # the default since run G
        "topk_in_router": [(ME, "ROUTE_IN_ROUTER", True)],
        "topk_kernel": [(ME, "TOPK_KERNEL_MIN_ROWS", 1)],  # the top-k in a kernel of its own at every batch
        "topk_in_programs": [(ME, "TOPK_KERNEL_MIN_ROWS", None)],  # every routed gate/up program's own top-k
        "topk_w1": [(RT, "TOPK_SLOTS_WARPS", 1)],  # the top-k kernel on one warp (no cross-warp reductions)
        "topk_w2": [(RT, "TOPK_SLOTS_WARPS", 2)],
        "topk_w8": [(RT, "TOPK_SLOTS_WARPS", 8)],
        "topk_rows1": [(RT, "TOPK_SLOTS_ROWS", 1)],  # one program per token
        "down_many4": [(ME, "DOWN_MANY_ROWS", 4)],  # DOWN_BLOCK_MANY from 4 tokens on
        "down_block_every_batch": [(ME, "DOWN_MANY_ROWS", None)],  # DOWN_BLOCK at every batch (before run DW)
        # expert kernel blocks (bn, bk, warps, stages) other than the batch-1 tuned ones, for batches 4-8
        "gu_bn16": [(ME, "GATE_UP_BLOCK", (16, 1024, 4, 3))],
        "gu_bn16_w8": [(ME, "GATE_UP_BLOCK", (16, 1024, 8, 3))],
        "gu_bk2048": [(ME, "GATE_UP_BLOCK", (8, 2048, 4, 3))],
        # batch 1: Flint's gate/up runs 7 x 128 programs of 8 rows; at the default's 94 registers a thread five fit an
        # SM (660 at once on 132 SMs), so ~1.4 waves. 512-value K tiles take 72 registers (seven an SM: one wave, but
        # four K steps); 16 rows of 512 values 120 registers, one wave of 448 programs; 4 rows of 1024 values 56
        # registers, 1,792 programs (offline SASS, scripts/kernel_sass.py --moe). Run FL (H100, 100K): gate/up 8.8 us
        # per layer by default, 9.2 / 8.9 / 10.1 us in these: one wave is not faster (docs/BENCHMARKS.md)
        "gu_bk512": [(ME, "GATE_UP_BLOCK", (8, 512, 4, 3))],
        "gu_bn4": [(ME, "GATE_UP_BLOCK", (4, 1024, 4, 3))],
        "gu_bn16_bk512": [(ME, "GATE_UP_BLOCK", (16, 512, 4, 3))],
        "down_bn16": [(ME, "DOWN_BLOCK", (16, 512, 4, 1))],
        "down_bn16_w8": [(ME, "DOWN_BLOCK", (16, 512, 8, 1))],
        "down_recomputes_topk": [(ME, "ROUTING_TO_DOWN", False)],
        "topk_two_reductions": [(RT, "TOPK_ARGMAX", False)],  # max then lowest index per round (before run BR)
        "norm_before_loads": [(WT, "NORM_AFTER_LOADS", False)],  # the norm prologue first (before run BS)
        "late_epilogue_loads": [(WT, "EARLY_EPILOGUE_LOADS", False)],  # scales and residual after the K loop
        # BF16 weights with the blocks from before run BB's sweep
        "bf16_generic_tables": [(G, "BF16_TABLE", None), (ME, "BF16_GATE_UP_BLOCK", (8, 1024, 4, 3)),
                                (ME, "BF16_DOWN_BLOCK", (8, 512, 4, 1))],
        "fma_rows": [(G, "TABLE_DOT_MIN_ROWS", None)],  # every row count on the FMA path (before run BG)
        "lm_head_rows8": [(PP, "LM_HEAD_KERNEL_MAX_ROWS", 8)],  # served step: the LM-head kernel up to 8 rows
        "sort_sampling": [(PP, "TOP_K_SAMPLING", False)],  # served step: sampling by the vocabulary sort (before CE)
        "dot_rows4": [(G, "TABLE_DOT_MIN_ROWS", 4)],  # run BH: slower at batch 4 (rows padded to 8)
        "dot_rows2": [(G, "TABLE_DOT_MIN_ROWS", 2)],  # batches 2-7 on the tensor cores too (rows padded to 8)
        # NVFP4 FMA blocks at 2 and 4 rows as before run DP (2 rows: the 1-row entry; 4 rows: the generic blocks)
        "nvfp4_fma_before_DP": [(G, "NVFP4_FMA_TABLE", {1: G.NVFP4_FMA_TABLE[1], 2: G.NVFP4_FMA_TABLE[1]})],
        # 4 rows: the O projection and the dense down with the generic blocks (run DQ: 3.994 against 3.838 ms)
        "nvfp4_rows4_generic_long_k": [(G, "NVFP4_FMA_TABLE", {**G.NVFP4_FMA_TABLE, 4: {
            "short_k": G.NVFP4_FMA_TABLE[4]["short_k"]}})],
        # 3-4 rows: the QKV projection on the FMA path (before run DR; the default since: tensor cores, x's rows
        # repeated to 8 columns in the kernel; run DR at batch 4: QKV 15.8 -> 11.9 us)
        "qkv_fma_rows4": [(AP, "QKV_DOT_MIN_ROWS", None)],
        "dot_bk512": [(G, "DOT_BLOCK", (16, 512, 1, 3))],  # run BH: QKV 30 us per layer at batch 8 (19.5 at 256)
        "dot_bk128": [(G, "DOT_BLOCK", (16, 128, 1, 3))],
        "dot_bn16_w1": [(G, "DOT_BLOCK", (16, 256, 1, 3))],
        "dot_bn64_w4": [(G, "DOT_BLOCK", (64, 256, 4, 3))],
        "moe_persistent": [(ME, "PERSISTENT", True)],  # router, gate/up, down in one launch (run H: slower)
        "persistent_1_per_sm": [(ME, "PERSISTENT", True), (GS, "PROGRAMS_PER_SM", 1)],
        "poll_atomic": [(ME, "PERSISTENT", True), (GS, "POLL", "atomic")],
        # diagnostic: wrong results; what the barriers cost
        "persistent_no_barrier": [(ME, "PERSISTENT", True), (MP, "BARRIERS", False)],
    }
    variants["moe_bn16"] = variants["gu_bn16_bk512"] + variants["down_bn16"]  # both expert kernels in 16-row blocks
    return variants


def hot_weights(params, cfg: FlintConfig):
    """The `hot_weights` variant's parameters: the dense layers as they are, every later layer the first MoE
    layer's weights (the same buffers, so the same synthetic values each layer)."""
    k = cfg.first_k_dense_replace
    return dataclasses.replace(params, layers=params.layers[:k] + (params.layers[k],) * (len(params.layers) - k))


def lm_head_tiles(params, cfg: FlintConfig):
    """The `lm_head_tiles` variant's parameters: the NVFP4 LM head as pallas_path.engine_layout leaves it (tiled for
    pallas_kernels/mosaic_nvfp4.py), the layers as they are."""
    del cfg
    from flint_jax import pallas_path
    return dataclasses.replace(params, lm_head=pallas_path.tiled_lm_head(params.lm_head))


# Variants that change the parameters rather than kernel knobs. hot_weights is a diagnostic: every MoE layer uses the
# same weights (one layer's QKV, O, router and shared expert stay in L2), i.e. what the weight kernels would cost if
# their weights were prefetched into L2. lm_head_tiles: the engine's LM head (Mosaic GPU) against the base's Triton one.
PARAM_VARIANTS = {"hot_weights": hot_weights, "lm_head_tiles": lm_head_tiles}


class variant:
    """Context manager: set a variant's module attributes, restore them on exit."""

    def __init__(self, name: str):
        table = _variants()
        parts = name.split("+")  # "a+b": both variants' knobs (parameter variants do not combine)
        for part in parts:
            if part not in table or (len(parts) > 1 and part in PARAM_VARIANTS):
                raise SystemExit(f"unknown variant {part!r} in {name!r}; known: {', '.join(table)} "
                                 "(knob variants combine with '+')")
        self.sets = [s for part in parts for s in table[part]]

    def __enter__(self):
        self.old = [(m, a, getattr(m, a)) for m, a, _ in self.sets]
        for m, a, v in self.sets:
            setattr(m, a, v)

    def __exit__(self, *exc):
        for m, a, v in self.old:
            setattr(m, a, v)


def short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run")
    ap.add_argument("--weights", default="nvfp4", help="comma list: nvfp4,bf16")
    ap.add_argument("--impls", default="pallas", help="comma list: pallas,xla")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--served", action="store_true",
                    help="profile the served step (forward + LM head + sampling, Flint's defaults) instead")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                    help="element type of the full layers' KV caches (default: bf16; see state.KV_DTYPES)")
    ap.add_argument("--variants", default="base", help="comma list of kernel-knob variants (pallas impl only): "
                    + ", ".join(_variants()))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    context = min(args.context, 100) if args.tiny else args.context
    report = {"device": jax.devices()[0].device_kind, "batch": args.batch, "context": context,
              "kv_dtype": args.kv_dtype,
              "step": "served" if args.served else "forward", "runs": []}
    md = [f"Device {report['device']}, batch {args.batch}, context {context}, {args.kv_dtype} full KV caches, "
          f"{args.steps} traced {report['step']} steps.", ""]
    def save():
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "profile.md"), "w") as f:
            f.write("\n".join(md) + "\n")

    for weights in args.weights.split(","):
        why = model_shortfall(cfg, weights, batch=args.batch, max_len=context + 8, kv_dtype=args.kv_dtype)
        if why:  # e.g. BF16 Flint on an H100: say so now, not as an XLA allocation failure minutes later
            log(f"{weights}: skipped: {why}")
            report.setdefault("skipped", []).append({"weights": weights, "reason": why})
            md += [f"## {weights}: skipped", "", why + ".", ""]
            save()
            continue
        params = init_params(cfg, jax.random.key(1), weights)
        jax.block_until_ready(params)
        runs = [(impl, v) for impl in args.impls.split(",")
                for v in (args.variants.split(",") if impl == "pallas" else ["base"])]
        for impl, vname in runs:
            tag = f"{weights}/{impl}" + ("" if vname == "base" else f" [{vname}]")
            jax.clear_caches()  # module-level jitted functions (engine.decode) would reuse another variant's trace
            try:
                with variant(vname):
                    forward, served = make_steps(cfg, impl)
                    step = served if args.served else forward
                    state = random_state(cfg, args.batch, context + 8, context, jax.random.key(2), args.kv_dtype)
                    tokens = jnp.arange(args.batch, dtype=jnp.int32) + 7
                    extra = (jax.random.split(jax.random.key(3), args.batch),) if args.served else ()
                    t = time.time()
                    run_params = PARAM_VARIANTS[vname](params, cfg) if vname in PARAM_VARIANTS else params
                    compiled = step.lower(run_params, state, tokens, state.lengths, *extra).compile()
                    kernels = count_kernels(compiled)
                    log(f"{tag}: compiled in {time.time() - t:.1f}s, {kernels} kernel-launching ops")
                    # The AOT executable itself: calling `step` would compile the same program a second time.
                    ms, state = time_steps(compiled, run_params, state, tokens, extra, 20, context)
                    log(f"{tag}: {ms:.3f} ms per step")
                    tdir = os.path.join(args.out, f"trace_{weights}_{impl}_{vname}")
                    events, state = trace_steps(compiled, run_params, state, tokens, extra, context, tdir,
                                                args.steps)
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
                log(f"{tag}: failed: {type(e).__name__}: {str(e)[:500]}")
                md += [f"## {tag}: failed: {type(e).__name__}: {str(e)[:300]}", ""]
                continue
            s = device_trace.summarize(events, args.steps)
            dev = device_trace.device_ms(events, args.steps)
            if dev is None:
                log(f"{tag}: no device events in the trace")
            s.update(weights=weights, impl=impl, variant=vname, step_ms=ms, device_ms=dev, kernels=kernels)
            report["runs"].append(s)
            busy = statistics.median(s["step_busy_ms"]) if s["step_busy_ms"] else None
            s["busy_ms"] = busy
            # span (first kernel's start to last kernel's end) and busy (time with a kernel running) differ where
            # kernels overlap or the device idles inside the step
            dev_txt = (f"{dev:.3f} ms on the device (span; {busy:.3f} ms with a kernel running)" if dev is not None
                       else "no device trace")
            md += [f"## {tag}: {dev_txt} per step ({ms:.3f} ms wall clock), {kernels} kernel-launching ops in the "
                   f"program; trace: {s['launches_per_step']:.0f} kernels per step, {s['kernel_us_per_step']:.0f} us "
                   f"of kernel time per step", "",
                   "| kernel | per step | mean us | us per step | share |", "|---|---|---|---|---|"]
            for r in s["rows"][:25]:
                md.append(f"| `{short(r['name'])}` | {r['per_step']:.0f} | {r['mean_us']:.1f} | "
                          f"{r['us_per_step']:.0f} | {100 * r['share']:.1f}% |")
            md.append("")
            top = ", ".join(f"{r['name'][:28]} {r['us_per_step']:.0f}" for r in s["rows"][:8])
            log(f"{tag}: top kernels (us/step): {top}")
            save()
            del state
        del params
    return 0


if __name__ == "__main__":
    sys.exit(main())
