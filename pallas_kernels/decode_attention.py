"""Decode attention (T = 1) with learned sinks over ring and full caches, and the whole decode attention block.

One kernel body, three modes (Pallas, Triton lowering):

* `decode_attention(q, cache, positions, sinks, ...)`: q ready, the cache already holds this token.
* fused (used by `attention_block_decode`): takes the raw Q/K/V projection of `qkv_projection`, finishes Q/K
  (head RMSNorm, RoPE on sliding layers: `attention_prologue.finish_heads`), writes K/V into the cache in place,
  and attends. The new token enters the online softmax as its initial state instead of being read back from the
  cache, so no program reads memory that another program of the same launch writes (a ring's slot p % W held
  position p - W, which the window masks; a full cache's row p is past the old keys).

Grid (B, KV, splits). A program takes the Hq/KV query heads of one KV head together (rows padded to 16, the
tensor-core tile) and streams that KV head's keys in blocks of BLOCK_K: sliding layers read the ring (`W` slots,
masked by the stored positions) in RING_SPLITS static slices (`ring_geometry`), full layers split the keys
[0, length) into chunks computed from the length at run time (`split_geometry`: lengths are data, one compiled
kernel for every length up to max_len). With one split the kernel folds in the sink and writes o; with several it
writes (acc, max, sum) partials, and either the last-arriving split folds them and the sink together
(COMBINE_IN_KERNEL, for at most MAX_SPLITS_IN_KERNEL splits; off by default: slower) or the `combine` kernel
does (the default).

`attention_block_decode` = qkv_projection + fused attention + combine + output projection with the residual: four
kernels per layer (three where one split suffices or the fold is in the kernel).
`model_attention_block` is the same behind `model.attention_block`'s signature (T = 1), ready for `model.Blocks`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax import layer_stack
from flint_jax import layers as L
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels.attention_prologue import (ROWS, check_cache, finish_heads, load_raw_heads, load_rope,
                                                         qkv_projection, rope_cos_sin, rope_tables, store_kv)
from flint_jax.pallas_kernels.weight_tiles import pow2_rows
from flint_jax.state import FullCache, RingCache, through_cache, values_transposed

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
NEG_INF = float("-inf")

BLOCK_K = 64  # keys per step
NUM_WARPS, NUM_STAGES = 4, 3
# Warps of the ring (sliding-layer) kernels: its programs are latency-bound and 8 warps shorten their chain. Run BD
# (docs/BENCHMARKS.md, NVFP4, 100K, in the step): ring 10.3 -> 9.3 us per layer with 8 warps, while the full layers
# streaming 200 MB of K/V got slower with 8 (51.7 -> 56.7 us), so they keep NUM_WARPS.
RING_NUM_WARPS = 8
# Full layers: at most this many (b, kv, split) programs, one wave at 2 programs per SM on the H200's 132 SMs. Run O
# (docs/BENCHMARKS.md), 100K at B = 1: 64 splits (256 programs) 52.7 us per layer, 128 splits (512 programs, two
# waves) 69.6 us.
TARGET_PROGRAMS = 264
MAX_SPLITS = 128
# Full layers folded by the `combine` kernel may split any number of ways (its partials are padded to a power of
# two, which Triton's block shapes need). True makes B = 1 use 66 splits (264 programs) instead of 64: measured
# slower on the H200 (run AK, 100K: 56.7 us against 55.0-55.3 with 64; 8K: 13.1 against 10.6-10.7), so off.
ANY_SPLITS = False
MIN_CHUNK = 256  # keys per split at least: short contexts use fewer splits (fewer partials written and combined)
# Full layers launch no more splits than a split of MIN_CHUNK keys each could fill in the cache (`default_splits`'
# max_len): a cache of 2,048 slots (the engine's default max_len) runs 8 splits instead of 64, one of 8,200 slots
# (profile_decode.py's at --context 8192) 64 instead of 128 on an H200's FP8 setting. The same chunks for every
# length, so the same keys per program; the programs past them only ever stored neutral partials, which `combine`
# then folded. False: splits by the program target alone (the form before; the profiler variant
# `splits_past_max_len`). Measured on an H100 (run FJ, NVFP4 step on a 2,048-slot BF16 cache): step span 1.732 ->
# 1.707-1.709 ms, the full-layer kernel 8.0 -> 7.7 us and its combine 2.3 -> 1.6 us.
SPLITS_FIT_MAX_LEN = True
# Fold the split partials inside the attention kernel, in the program that arrives last at a per-(sequence, KV
# head) atomic counter (True), instead of launching `combine` (False, the default). Memory ordering: every thread's
# partial stores, then a CTA barrier, then one acq_rel atomic per program; the last program reads the partials with
# volatile loads (interpret mode cannot show ordering races: the compiled tests on the GPU check it). One launch
# fewer per layer, yet slower: the barrier, the atomic and the second round of dependent loads cost more than one
# more launch in XLA's command buffer (~1 us, scripts/probe_kernel_floor.py). Measured on the H200 (runs DE, DF,
# docs/BENCHMARKS.md): the sliding layers' ring kernel 9.15 us with the fold, 6.21 us with no fold at all, 6.14 +
# 1.50 us with `combine` (probe over 35 rings); in the NVFP4 step at 100K, batch 1, 2.390 -> 2.335 ms; at 8K,
# batch 4 (the full layers fold 16 splits) 4.357 -> 4.330 ms.
COMBINE_IN_KERNEL = False
# Splits of a sliding layer's ring (513 slots on Flint): 8 programs per (sequence, KV head) instead of one program
# walking 9 blocks serially (17.9 us per layer on the H200 at one split: the loop is
# latency-bound, docs/BENCHMARKS.md).
RING_SPLITS = 8
# Ring splits of one BLOCK_K block each load that block into registers before the query (RING_PRELOAD), so the two
# loads' latencies overlap; the slots past RING_SPLITS blocks (Flint: 513 = 8 x 64 + 1), at most MAX_EXTRA_SLOTS of
# them, split 0 reads one by one. Splits of several blocks loop over them instead (loads pipelined through shared
# memory): preloading two blocks in registers spilled (run O: 17.1 us per layer against 14.8 looping, run G).
RING_PRELOAD = True
MAX_EXTRA_SLOTS = 4
# Sliding layers read RoPE's cos/sin from a [B, 2, D/2] table that XLA computes once per step
# (`attention_prologue.rope_cos_sin`, loaded with the first loads) instead of evaluating them in every program after
# the head norm (their large angles take the slow range reduction). Measured on the H200 (run DI, docs/BENCHMARKS.md,
# NVFP4 step at 100K, batch 1): ring kernel 6.3 -> 5.6 us, step 2.333 -> 2.309 ms, for one more XLA kernel per step
# (the table, ~1.1 us; XLA's CSE keeps one for the 35 layers).
ROPE_TABLE = True
# The values' dot p @ V: "tf32" (the default) rounds p to TF32 (10 mantissa bits) and takes V as FP32; "bf16x2"
# splits p into two BF16 parts (hi + lo: about 16 bits, finer than TF32) and runs two BF16 dots on V as BF16 (exact
# for BF16 and FP8 caches), so V needs no FP32 copy and the dots run at twice TF32's rate; "bf16" rounds p to BF16
# (one dot; coarser than the reference's rounding: a probe for the profiler, not for use). Measured on the H200 (run
# EM, docs/BENCHMARKS.md, full layers at 100K, batch 1): BF16 caches 52.4 / 51.8 / 51.6 us, FP8 caches 53.7 / 83.6 /
# 43.9 us (then with the PTX decode), so "tf32" stays.
PV_MODES = ("tf32", "bf16x2", "bf16")
PV_MODE = "tf32"
# Full layers: each split loads its first key block (keys, values) before the query's loads and head norms, as the
# ring splits do (RING_PRELOAD), so the block's latency overlaps the prologue's instead of following it; the loop
# then starts at the second block. Without it the loop's pipelined loads are issued only once the prologue's chain
# (raw q/k/v loads, head norms, the new token's K/V write) is done. A split with no keys attends a fully masked
# block (a no-op on its state). Off: measured slower on an H100 (run FB, docs/BENCHMARKS.md, NVFP4 step at 100K,
# batch 1, profiler variant `full_preload`): FP8 caches 40.3 -> 41.2 us per full layer (span 2.178 -> 2.210 ms),
# BF16 caches 71.1 -> 71.7 us. The block held in registers across the prologue costs more than the latency it hides:
# with one wave of 256 programs streaming ~1,600 keys each, the loop's own ramp is not what sets the time.
FULL_PRELOAD = False
# The last-arriving program folds at most this many splits (FOLD_VALUES below per load); more splits (full layers at
# long contexts: 64 at B = 1) go to the `combine` kernel, which folds them in parallel over (sequence, head)
# programs: one program folding 128 splits cost 113 us per layer at 100K on the H200 (docs/BENCHMARKS.md).
MAX_SPLITS_IN_KERNEL = 16
# Every split of a full layer stores its partials, those past the data too (theirs are neutral: m = -inf, l = 0,
# acc = 0), so `combine` loads all of them at once (True) instead of first loading the sequence's position and
# computing which splits hold data (False: one dependent round of loads more in each full layer's combine).
NEUTRAL_PARTIALS = True
# The fold loads the partials of as many splits at once as keep [heads, splits, D] within FOLD_VALUES f32 values
# (64 per thread at 4 warps): a ring's 8 splits of 8 heads in one load.
FOLD_VALUES = 8192


def _as_vector(cond, n: int):
    """A scalar condition as an [n] bool vector: the Triton lowering wants masks and selects of the operand's
    shape."""
    return (jnp.zeros((n,), jnp.int32) + cond.astype(jnp.int32)) > 0


# FP8 (E4M3) cache tiles to BF16 / FP32, used where the FP16 dots below are off: by Triton's casts (FP8_PTX =
# False, the default) or by inline PTX (True). The PTX works on 32-bit registers of two BF16 lanes, as weight_tiles'
# NVFP4 decode does: per 2 bytes one byte permute puts each byte in its lane's high byte, a shift and two masks
# place the magnitude bits (e e e e m m m) in BF16 bits 10..4 and keep the sign in bit 15, which is exactly E4M3(x) *
# 2^-120 (E4M3's subnormals become BF16 subnormals), and one BF16x2 FMA multiplies by 2^120 (exact: the product is
# the E4M3 value). Values for the FP32 operand take their BF16 lane into the high half of a register. Same values as
# the casts, yet slower: measured in one run on the H200 (run EO, docs/BENCHMARKS.md, NVFP4 step at 100K), the
# full-layer kernel took 53.6 us per layer with the PTX and 48.8 us with the casts at batch 1, 390 and 350 us at
# batch 8 (BF16 caches: 52.5 us at batch 1). Triton places its own casts after the tile is in the dot's operand
# layout, likely, while the inline assembly is pinned to the layout the tile is loaded in (not checked in the IR).
FP8_PTX = False
_BF16_2POW120 = "0x7B807B80"  # 2^120 in both BF16 lanes
# FP8 caches: the dots in FP16 instead of BF16 (scores) and TF32 (values). Every E4M3 value is a normal FP16 value,
# so an FP16 tile holds the cache exactly, and E4M3 -> FP16 is one conversion per two values (cvt.rn.f16x2.e4m3x2,
# sm_89 on), where BF16 and FP32 take a further conversion. FP8_HALF_SCORES: q . k on FP16 operands; q (BF16) is
# exact in FP16 for 2^-14 <= |q| < 65520: smaller elements become FP16 subnormals (absolute error <= 2^-25), and
# a head-normed q stays below sqrt(head_dim) * max|q_norm| (11.4 * max|q_norm| for Flint: no overflow while the norm
# weights stay below 5,700). FP8_HALF_VALUES: p @ V with p scaled by P_SCALE = 2^15 and rounded to FP16: 11
# significant bits, like TF32's (p <= 1: no overflow; p below 2^-29 of the running maximum keeps fewer bits, below
# 2^-40 none), V exact; the product is scaled back by 2^-15, exactly. `check_fp16_scores` refuses a model whose
# q_norm weights could overflow. FP8_BLOCK_K: keys per block of a full layer on an FP8 cache (a multiple of BLOCK_K;
# the rings and BF16 caches keep BLOCK_K): 128 FP8 keys are the bytes of 64 BF16 ones. Measured on the H200 (runs
# EQ, ER, docs/BENCHMARKS.md; NVFP4 step at 100K, FP8 caches, full-layer kernel per layer): batch 1 48.9 us (BF16
# scores, TF32 values, 64 keys) -> 44.1 (FP16 values) / 43.9 (FP16 scores) / 40.2 (both) / 38.2 (both, 128 keys;
# 256 keys: 76.3; 8 warps: 51.8), step 2.252 -> 2.110 ms; batch 8 351 -> 238 us, step 9.79 -> 8.21 ms.
FP8_HALF_SCORES = True
FP8_HALF_VALUES = True
P_SCALE = 2.0 ** 15
# An FP8 cache's full layers take their program shape by the GPU's kind: keys per loop block, warps per program and
# the programs' target (the split count as TARGET_PROGRAMS sets it for BF16 caches). FP8_BLOCK_K, FP8_NUM_WARPS and
# FP8_TARGET_PROGRAMS override the table on every device where they are not None. Kinds are matched by substring of
# jax's device_kind ("NVIDIA H100 80GB HBM3", "NVIDIA H200"); a kind not listed, or a trace without a GPU (interpret
# mode, lowering on a CPU host), takes 128-key blocks, NUM_WARPS and TARGET_PROGRAMS. What the measurements picked:
# - H100: 64-key blocks (runs EX-EY, scripts/profile_decode.py, NVFP4 step at 100K, batch 1: 45.4 -> 41.5 us per
#   layer, span 2.253 -> 2.200 ms; the kernel alone 46.7 -> 44.0 us); there 2 warps were neutral in the step (run
#   FE), twice the programs slower (run FD), and both together slower alone (run FD's sweep: 44.7 against 43.0 us).
# - H200: 64-key blocks in 2-warp programs, 528 programs (128 splits at batch 1, 16 at batch 8). Run FI
#   (docs/BENCHMARKS.md), NVFP4 step at 100K on FP8 caches, against 128-key blocks in 4-warp programs, 264 programs
#   (run ER's choice): batch 1 38.4 -> 36.2 us per layer, span 2.114 -> 2.092 ms; batch 8 233.4 -> 219.3 us, span
#   8.164 -> 7.983 ms; the kernel alone (run FH's sweep) 42.0 -> 37.7 us and 245.1 -> 226.4 us. Not re-measured
#   at other contexts (at 8K most of the 128 splits hold no keys and store neutral partials).
FP8_BLOCK_K: int | None = None
FP8_NUM_WARPS: int | None = None
FP8_TARGET_PROGRAMS: int | None = None
FP8_FULL_BY_DEVICE = {"H100": {"block_k": 64}, "H200": {"block_k": 64, "num_warps": 2, "target_programs": 528}}
FP8_BLOCK_K_DEFAULT = 128
# Full layers on a cache whose V is stored transposed (FP8 with state.FP8_V_TRANSPOSED on, a profiler variant:
# state.values_transposed) run the keys on the dots' M dimension (`keys_as_m`). False: the query heads on M as
# elsewhere (padded to ROWS), V^T taken by the values dot's trans_b (a profiler variant).
KEYS_AS_M = True


def _fp8_pair_ptx(src: str, sel: str) -> str:
    """PTX: two bytes of `src` (prmt selector `sel`) -> register r as BF16x2, the bytes' E4M3 values."""
    return (f"prmt.b32 t, {src}, z, {sel};\n"
            "shr.b32 a, t, 4; and.b32 a, a, 0x07F007F0; and.b32 s, t, 0x80008000; or.b32 a, a, s;\n"
            f"fma.rn.bf16x2 r, a, c, n;\n")


def _fp8_ptx(to_f32: bool) -> str:
    """PTX for 4 E4M3 bytes (pack=4; byte i = element i): to BF16 ($0, $1: two lanes each; input $2) or to FP32
    ($0..$3; input $4). prmt 0x1404 puts byte 0 in the high byte of lane 0 and byte 1 in lane 1's, 0x3424 bytes 2
    and 3; the shift right by 4 moves no set bit across lanes (each lane's low byte is zero)."""
    src = "$4" if to_f32 else "$2"
    body = ""
    for i, sel in enumerate(("0x1404", "0x3424")):
        body += _fp8_pair_ptx(src, sel)
        if to_f32:
            body += f"shl.b32 ${2 * i}, r, 16; and.b32 ${2 * i + 1}, r, 0xFFFF0000;\n"
        else:
            body += f"mov.b32 ${i}, r;\n"
    return ("{\n.reg .b32 t, a, s, r, z, n, c;\nmov.b32 z, 0;\nmov.b32 n, 0x80008000;\n"
            f"mov.b32 c, {_BF16_2POW120};\n" + body + "}")


def _from_cache(x, dtype, ptx: bool):
    """A cache tile as `dtype` (a dot's operand type: BF16, FP16 or FP32): BF16 tiles by a cast, FP8 tiles (an FP8
    full cache) exactly, to BF16 or FP32 by inline PTX where `ptx` (compiled) and FP8_PTX, else by a cast."""
    if x.dtype == BF16 or dtype == F16 or not (ptx and FP8_PTX):
        return x.astype(dtype)
    n_out = 4 if dtype == F32 else 2
    out = jax.ShapeDtypeStruct(x.shape, dtype)
    return plgpu.elementwise_inline_asm(_fp8_ptx(dtype == F32), args=[jax.lax.bitcast_convert_type(x, jnp.uint8)],
                                        constraints=",".join(["=r"] * n_out + ["r"]), pack=4,
                                        result_shape_dtypes=[out])[0]


def check_fp16_scores(params, cfg: FlintConfig) -> None:
    """Refuse, where FP8_HALF_SCORES, a model whose full layers' q may overflow FP16 on an FP8 cache: a head-normed
    q element is at most sqrt(head_dim) * |q_norm| (the normed vector's RMS is 1; BF16 rounding adds 2^-8)."""
    if not FP8_HALF_SCORES:
        return
    f16_max = float(jnp.finfo(F16).max)
    layers = cfg.full_layers
    w_max = jnp.stack([jnp.max(jnp.abs(layer_stack.value(params.layers[i].attn.q_norm).astype(F32)))
                       for i in layers])
    for i, w in zip(layers, np.asarray(w_max).tolist()):  # one transfer for every layer
        bound = w * math.sqrt(cfg.head_dim) * (1 + 2.0 ** -8)
        if not bound < f16_max:
            raise ValueError(
                f"layer {i} self_attn.q_norm: max |weight| {w:g} lets q reach {bound:g}, past FP16's {f16_max:g}; "
                "kv_dtype='fp8' computes a full layer's scores in FP16 (decode_attention.FP8_HALF_SCORES): use "
                "kv_dtype='bf16', or set FP8_HALF_SCORES = False")


def _value_dtype(cache_dtype=BF16):
    """The dtype the values' dot takes V in: FP16 for an FP8 cache where FP8_HALF_VALUES, else as PV_MODE says."""
    if PV_MODE not in PV_MODES:
        raise ValueError(f"decode_attention.PV_MODE must be one of {PV_MODES}, got {PV_MODE!r}")
    if cache_dtype != BF16 and FP8_HALF_VALUES:
        return F16
    return F32 if PV_MODE == "tf32" else BF16


def _score_dtype(cache_dtype=BF16):
    """The dtype of the score dot's operands (q and the K tiles): FP16 for an FP8 cache where FP8_HALF_SCORES."""
    return F16 if cache_dtype != BF16 and FP8_HALF_SCORES else BF16


def _values_dot(p, vb, order: str = "pv"):
    """The values' dot in FP32, by `order`: "pv" p [R, BK] @ vb [BK, D]; "pvt" p @ vb^T, vb [D, BK] (a transposed
    cache's tile); "vtp" vb [D, BK] @ p [BK, R] -> [D, R] (`keys_as_m`). On FP16 V (an FP8 cache), p * P_SCALE rounded
    to FP16 and the product scaled back (exact: powers of two); otherwise rounded as PV_MODE says."""
    def dot(p_op, v_op, **kw):
        if order == "vtp":
            return plgpu.dot(v_op, p_op, **kw)
        return plgpu.dot(p_op, v_op, trans_b=order == "pvt", **kw)
    if vb.dtype == F16:
        return dot((p * P_SCALE).astype(F16), vb) * (1.0 / P_SCALE)
    if _value_dtype() == F32:
        return dot(p, vb.astype(F32), allow_tf32=True)
    vb = vb.astype(BF16)
    p_hi = p.astype(BF16)
    pv = dot(p_hi, vb)
    if PV_MODE == "bf16x2":
        pv = pv + dot((p - p_hi.astype(F32)).astype(BF16), vb)
    return pv


def keys_as_m(cache_dtype, ring: bool) -> bool:
    """Whether a kernel on this cache runs its dots transposed: scores^T = K q^T [BK, R] and o^T = V^T p^T [D, R],
    the keys on the MMA's M dimension and the query heads on N (R = `query_rows`). Full layers on a transposed-V
    cache (FP8, state.values_transposed) do where KEYS_AS_M: V^T is then a plain tile, and R = 8 heads fill an N of
    8 where the key-major form pads them to a 16-row M tile."""
    return KEYS_AS_M and not ring and values_transposed(cache_dtype)


def query_rows(G: int, transposed: bool) -> int:
    """Rows of a program's query tile: the G heads of one KV head padded to the MMA's smallest tile, ROWS (16) on M,
    or 8 on N (`keys_as_m`)."""
    return max(8, pow2_rows(G)) if transposed else ROWS


def _load_ring_row(k_ref, v_ref, kpos_ref, b, kv, slot: int, read, dh: int, D: int):
    """One ring slot (static index) where `read` (a scalar condition) holds: (position [1], K halves [dh], V [D]);
    position -1 and zeros otherwise."""
    kp = plgpu.load(kpos_ref.at[b, pl.ds(slot, 1)], mask=_as_vector(read, 1), other=-1)
    slot = jnp.asarray(slot, jnp.int32)  # a traced index (the load's indexer refuses a Python int beside slices)
    kr1 = plgpu.load(k_ref.at[b, kv, slot, pl.ds(0, dh)], mask=_as_vector(read, dh), other=0)
    kr2 = plgpu.load(k_ref.at[b, kv, slot, pl.ds(dh, dh)], mask=_as_vector(read, dh), other=0)
    vr = plgpu.load(v_ref.at[b, kv, slot, :], mask=_as_vector(read, D), other=0)
    return kp, kr1, kr2, vr


def _load_ring_block(k_ref, v_ref, kpos_ref, b, kv, t0, active, n_slots: int, dh: int):
    """One BLOCK_K block of a ring from slot t0: (positions, K halves, V). Slots past the ring, and every slot of
    an inactive row, are not read (position -1, zeros)."""
    idx = t0 + jnp.arange(BLOCK_K)
    ok = (idx < n_slots) & active
    kp = plgpu.load(kpos_ref.at[b, pl.ds(t0, BLOCK_K)], mask=ok, other=-1)
    rmask = ok[:, None]
    kb1 = plgpu.load(k_ref.at[b, kv, pl.ds(t0, BLOCK_K), pl.ds(0, dh)], mask=rmask, other=0)
    kb2 = plgpu.load(k_ref.at[b, kv, pl.ds(t0, BLOCK_K), pl.ds(dh, dh)], mask=rmask, other=0)
    vb = plgpu.load(v_ref.at[b, kv, pl.ds(t0, BLOCK_K), :], mask=rmask, other=0)
    return kp, kb1, kb2, vb


def default_splits(batch: int, kv_heads: int, sliding: bool, cache_dtype=BF16, max_len: int | None = None,
                   min_chunk: int | None = None) -> int:
    """Splits of the key range per (sequence, KV head). Sliding layers: RING_SPLITS. Full layers: as many as keep
    the programs within the cache's target (`full_target_programs`: TARGET_PROGRAMS, one wave, on a BF16 cache), a
    power of two where the kernel folds the splits itself (its fold loads whole power-of-two groups); the `combine`
    kernel takes any count, used with ANY_SPLITS (B = 1: 66). Given the cache's `max_len` (and the `min_chunk` keys
    a split takes at least, whole units; default MIN_CHUNK) and SPLITS_FIT_MAX_LEN, no more splits than
    `max_splits_with_keys`: the rest could never hold a key."""
    if sliding:
        return RING_SPLITS
    fit = min(MAX_SPLITS, max(1, full_target_programs(cache_dtype) // (batch * kv_heads)))
    pow2 = 1 << (fit.bit_length() - 1)
    if not ANY_SPLITS or (COMBINE_IN_KERNEL and pow2 <= MAX_SPLITS_IN_KERNEL):
        fit = pow2
    if max_len is not None and SPLITS_FIT_MAX_LEN:
        needed = max_splits_with_keys(max_len, MIN_CHUNK if min_chunk is None else min_chunk)
        fit = min(fit, needed if ANY_SPLITS else pl.next_power_of_2(needed))
    return fit


def max_splits_with_keys(max_len: int, min_chunk: int) -> int:
    """The most splits of a full layer that can hold keys in a cache of `max_len` slots: a split takes at least
    `min_chunk` keys (`split_geometry`). Any split count S >= this gives every length the same chunks (min_chunk
    each, since ceil(length / S) <= min_chunk), so the splits past it only ever store neutral partials."""
    return max(1, -(-max_len // min_chunk))


def ring_chunk(n_slots: int, splits: int) -> int:
    """Ring slots per split (static): whole BLOCK_K blocks."""
    per_split = -(-n_slots // splits)
    return -(-per_split // BLOCK_K) * BLOCK_K


def ring_geometry(n_slots: int, splits: int) -> tuple[int, int, bool]:
    """(chunk, extra, preload): ring slots per split (whole BLOCK_K blocks), the slots past splits * chunk that
    split 0 reads one by one, and whether each split preloads its single block (RING_PRELOAD)."""
    if RING_PRELOAD:
        chunk = BLOCK_K * max(1, n_slots // (splits * BLOCK_K))
        extra = max(0, n_slots - splits * chunk)
        if chunk == BLOCK_K and extra <= MAX_EXTRA_SLOTS:
            return chunk, extra, True
    return ring_chunk(n_slots, splits), 0, False


def full_block_keys(cache_dtype) -> int:
    """Keys per block of a full layer's loop: FP8_BLOCK_K (`fp8_block_keys`) on an FP8 cache, else BLOCK_K."""
    return BLOCK_K if cache_dtype == BF16 else fp8_block_keys()


def gpu_kind() -> str:
    """jax's first device's kind ("NVIDIA H200") where the backend is a GPU, else "" (interpret mode, or lowering
    for CUDA on a CPU host)."""
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else ""


def _fp8_full_setting(name: str, override, default, device_kind: str | None):
    """One of an FP8 full layer's program settings: `override` where not None, else FP8_FULL_BY_DEVICE's entry for
    the GPU (`device_kind`, default `gpu_kind()`), else `default`."""
    if override is not None:
        return override
    if device_kind is None:
        device_kind = gpu_kind()
    for kind, settings in FP8_FULL_BY_DEVICE.items():
        if kind in device_kind and name in settings:
            return settings[name]
    return default


def fp8_block_keys(device_kind: str | None = None) -> int:
    """Keys per loop block of a full layer on an FP8 cache: FP8_BLOCK_K, else by the GPU's kind, else 128."""
    return _fp8_full_setting("block_k", FP8_BLOCK_K, FP8_BLOCK_K_DEFAULT, device_kind)


def full_num_warps(cache_dtype, device_kind: str | None = None) -> int:
    """Warps per program of a full layer: NUM_WARPS on a BF16 cache; on an FP8 cache FP8_NUM_WARPS, else by the
    GPU's kind, else NUM_WARPS."""
    if cache_dtype == BF16:
        return NUM_WARPS
    return _fp8_full_setting("num_warps", FP8_NUM_WARPS, NUM_WARPS, device_kind)


def full_target_programs(cache_dtype, device_kind: str | None = None) -> int:
    """The programs a full layer aims at (`default_splits`): TARGET_PROGRAMS on a BF16 cache; on an FP8 cache
    FP8_TARGET_PROGRAMS, else by the GPU's kind, else TARGET_PROGRAMS."""
    if cache_dtype == BF16:
        return TARGET_PROGRAMS
    return _fp8_full_setting("target_programs", FP8_TARGET_PROGRAMS, TARGET_PROGRAMS, device_kind)


# A full layer's split chunks are whole multiples of SPLIT_GRANULE keys (at most the block), not of whole blocks: a
# split's last block is masked at the split's end, its loads included, so no program reads past its chunk. With
# FP8's 128-key blocks at 100K and 64 splits, whole blocks gave 1,664-key chunks, so 61 splits held keys and the
# longest program read 1,664 keys; 64-key granules give 1,600-key chunks, 63 splits, 1,600 keys (4% less for the
# program that sets the kernel's time). Measured on an H100 (run EY, docs/BENCHMARKS.md): no faster (45.4 us per
# layer both ways, step span 2.253 against 2.258 ms): the program still runs 13 block iterations, and the batch-1
# loop is bound by its iterations, not its bytes. Kept because it is neutral and makes the split geometry independent
# of the block size. None: whole blocks (the form before; the profiler variant `split_blocks`).
SPLIT_GRANULE: int | None = BLOCK_K


def chunk_unit(block_k: int) -> int:
    """Keys per unit of a full layer's split chunk for a loop of `block_k`-key blocks (SPLIT_GRANULE)."""
    return block_k if SPLIT_GRANULE is None else min(block_k, SPLIT_GRANULE)


def split_geometry(pos, active, *, fused: bool, splits: int, min_chunk: int, unit: int):
    """How a full layer's keys are split, from the data: (length, chunk, active splits); chunks are whole multiples
    of `unit` keys (`chunk_unit`). Fused mode attends the old keys [0, pos) from the cache and the new token from
    registers (split 0); otherwise keys [0, pos]."""
    q_pos = jnp.where(active, pos, -1)
    length = jnp.maximum(q_pos if fused else q_pos + 1, 0)
    chunk = jnp.maximum(pl.cdiv(pl.cdiv(length, splits), unit) * unit, min_chunk)
    n_active = pl.cdiv(length, chunk)
    if fused:
        n_active = jnp.maximum(n_active, active.astype(jnp.int32))
    return length, chunk, n_active


def _attn_kernel(*refs, mode, ring, sliding, B, Hq, KV, G, D, window, n_slots, splits, min_chunk, block_k, unit,
                 eps, num_refs_in, combine_here, compiled, rope_table):
    ins, outs = refs[:num_refs_in], refs[num_refs_in:]
    if combine_here:
        ins = ins[:-1]  # the arrival counters' input; the kernel uses the aliased output
    dh = D // 2
    b, kv, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_ref, v_ref = ins[-3 if ring else -2], ins[-2 if ring else -1]
    transposed = keys_as_m(k_ref.dtype, ring)
    v_t = not ring and values_transposed(v_ref.dtype)  # V tiles come [D, BK]
    rows = query_rows(G, transposed)
    gmask = (jnp.arange(rows) < G)[:, None]
    inv_sqrt_d = 1.0 / math.sqrt(D)

    if mode == "fused":
        qkv_ref, qn_ref, kn_ref, rope_ref, pos_ref, act_ref, sink_ref, *cache_in = ins
    else:
        q_ref, pos_ref, act_ref, sink_ref, *cache_in = ins
    kpos_ref = cache_in[2] if ring else None
    pos = pos_ref[b]
    active = act_ref[b] != 0
    if not ring:  # this split's key range [lo, hi), from the data
        length, chunk, n_active = split_geometry(pos, active, fused=mode == "fused", splits=splits,
                                                 min_chunk=min_chunk, unit=unit)
        lo = s * chunk
        hi = jnp.minimum(length, lo + chunk)
        n_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)
        idx0 = jnp.arange(block_k)

        def load_full_block(t0):  # keys [t0, t0 + block_k) as stored, and which of them this split attends
            ok = (t0 + idx0) < hi  # this split's keys: a block may end past the split's chunk (chunk_unit)
            in_cache = ok & ((t0 + idx0) < n_slots)  # loaded: this split's keys, and only where the cache has them
            rmask = in_cache[:, None]
            # other=0.0, not 0: the Triton lowering casts `other` to the cache's dtype, and has no int -> FP8 cast
            kb1 = plgpu.load(k_ref.at[b, kv, pl.ds(t0, block_k), pl.ds(0, dh)], mask=rmask, other=0.0)
            kb2 = plgpu.load(k_ref.at[b, kv, pl.ds(t0, block_k), pl.ds(dh, dh)], mask=rmask, other=0.0)
            if v_t:  # V^T [D, block_k]
                vb = plgpu.load(v_ref.at[b, kv, :, pl.ds(t0, block_k)], mask=in_cache[None, :], other=0.0)
            else:
                vb = plgpu.load(v_ref.at[b, kv, pl.ds(t0, block_k), :], mask=rmask, other=0.0)
            return kb1, kb2, vb, ok

        if FULL_PRELOAD:  # issued before the query's loads: the two latencies overlap
            first_block = load_full_block(lo)
    if ring:
        chunk, extra, preload = ring_geometry(n_slots, splits)
        lo = s * chunk
        if preload:  # issued before the query's loads: the two latencies overlap
            ring_tile = _load_ring_block(k_ref, v_ref, kpos_ref, b, kv, lo, active, n_slots, dh)
            first_split = active & (s == 0)
            extra_rows = [_load_ring_row(k_ref, v_ref, kpos_ref, b, kv, splits * chunk + e, first_split, dh, D)
                          for e in range(extra)]
    if mode == "fused":
        rope = load_rope(rope_ref, b) if rope_table else rope_ref  # the table: loaded with the first loads
        q1, q2, k1, k2, v_new = load_raw_heads(qkv_ref, b, kv, Hq=Hq, KV=KV, G=G, D=D, rows=rows)
        q1, q2 = finish_heads(q1, q2, qn_ref, rope, pos, eps=eps, sliding=sliding)
        k1, k2 = finish_heads(k1, k2, kn_ref, rope, pos, eps=eps, sliding=sliding)
        if k_ref.dtype != BF16:  # an FP8 cache: the new token attends with the values the cache will hold
            k1, k2, v_new = (through_cache(x, k_ref.dtype) for x in (k1, k2, v_new))
    else:
        q1 = plgpu.load(q_ref.at[b, pl.ds(kv * G, rows), pl.ds(0, dh)], mask=gmask, other=0)
        q2 = plgpu.load(q_ref.at[b, pl.ds(kv * G, rows), pl.ds(dh, dh)], mask=gmask, other=0)
    if mode == "fused":
        k_out, v_out = outs[-3 if ring else -2], outs[-2 if ring else -1]
        pos_out = outs[-1] if ring else None

        @pl.when(active & (s == 0))
        def _():
            store_kv(k1, k2, v_new, k_out, v_out, pos_out, b, kv, pos, ring=ring, window=n_slots)

    # Online softmax state. Fused: the new token is the initial state of split 0 (it is not read from the cache).
    if mode == "fused":
        k1f, k2f = k1.astype(F32), k2.astype(F32)
        s_new = (jnp.sum(q1.astype(F32) * k1f, axis=1) + jnp.sum(q2.astype(F32) * k2f, axis=1)) * inv_sqrt_d
        take = _as_vector(active & (s == 0), rows)
        m = jnp.where(take, s_new, NEG_INF)
        l = jnp.where(take, 1.0, 0.0)
        acc = jnp.where(take[:, None], jnp.broadcast_to(v_new.astype(F32)[None, :], (rows, D)), 0.0)
    else:
        m = jnp.full((rows,), NEG_INF, F32)
        l = jnp.zeros((rows,), F32)
        acc = jnp.zeros((rows, D), F32)

    # Key range of this program. Old keys only in fused mode (the new one is already in the state).
    q_pos = jnp.where(active, pos, -1)

    score_dtype = _score_dtype(k_ref.dtype)
    qd1, qd2 = q1.astype(score_dtype), q2.astype(score_dtype)  # the score dot's q (rings: BF16 as computed)

    def attend_block(carry, kb1, kb2, vb, ok):
        m, l, acc = carry
        sc = (plgpu.dot(qd1, kb1, trans_b=True) + plgpu.dot(qd2, kb2, trans_b=True)) * inv_sqrt_d  # [ROWS, BK]
        sc = jnp.where(ok[None, :], sc, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe[:, None])
        pv = _values_dot(p, vb, "pvt" if v_t else "pv")
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    def attend_block_t(carry, kb1, kb2, vt, ok):  # keys_as_m: the same step on scores^T [BK, R], acc^T [D, R]
        m, l, acc_t = carry
        sc = (plgpu.dot(kb1, qd1, trans_b=True) + plgpu.dot(kb2, qd2, trans_b=True)) * inv_sqrt_d
        sc = jnp.where(ok[:, None], sc, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=0))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe[None, :])
        pv = _values_dot(p, vt, "vtp")
        return m_new, l * alpha + jnp.sum(p, axis=0), acc_t * alpha[None, :] + pv

    def ring_ok(kp):
        newest = kp < q_pos if mode == "fused" else kp <= q_pos
        return (kp >= 0) & newest & (q_pos - kp < window)

    if ring and preload:  # one block per split (loaded above), split 0 also the extra slots, row by row
        n_active = splits
        m, l, acc = attend_block((m, l, acc), *ring_tile[1:], ring_ok(ring_tile[0]))
        for kp, kr1, kr2, vr in extra_rows:
            sc = (jnp.sum(q1.astype(F32) * kr1.astype(F32)[None, :], axis=1)
                  + jnp.sum(q2.astype(F32) * kr2.astype(F32)[None, :], axis=1)) * inv_sqrt_d  # [ROWS]
            sc = jnp.where(jnp.broadcast_to(ring_ok(kp), (rows,)), sc, NEG_INF)
            m_new = jnp.maximum(m, sc)
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            alpha, p = jnp.exp(m - m_safe), jnp.exp(sc - m_safe)
            m, l = m_new, l * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vr.astype(F32)[None, :]
    elif ring:  # static split of the W slots, a loop over its blocks; every split stores its partials
        n_active = splits
        n_blocks = jnp.where(active, pl.cdiv(jnp.maximum(jnp.minimum(n_slots, lo + chunk) - lo, 0), BLOCK_K), 0)

        def body(i, carry):
            kp, kb1, kb2, vb = _load_ring_block(k_ref, v_ref, kpos_ref, b, kv, lo + i * BLOCK_K, active, n_slots,
                                                dh)
            return attend_block(carry, kb1, kb2, vb, ring_ok(kp))

        m, l, acc = jax.lax.fori_loop(0, n_blocks, body, (m, l, acc))
    else:
        def attend_full(carry, block):
            kb1, kb2, vb, ok = block
            kb1, kb2 = _from_cache(kb1, score_dtype, compiled), _from_cache(kb2, score_dtype, compiled)
            vb = _from_cache(vb, _value_dtype(k_ref.dtype), compiled)
            if transposed:
                return attend_block_t(carry, kb1, kb2, vb, ok)
            return attend_block(carry, kb1, kb2, vb, ok)

        def body(i, carry):
            return attend_full(carry, load_full_block(lo + i * block_k))

        carry, start = (m, l, acc.T if transposed else acc), 0
        if FULL_PRELOAD:
            carry, start = attend_full(carry, first_block), 1
        m, l, acc = jax.lax.fori_loop(start, n_blocks, body, carry)
        if transposed:
            acc = acc.T

    heads = pl.ds(kv * G, rows)
    if splits == 1:
        o_ref = outs[0]
        sink = plgpu.load(sink_ref.at[heads], mask=gmask[:, 0], other=0).astype(F32)
        big = jnp.maximum(m, sink)
        big = jnp.where(jnp.isfinite(big), big, 0.0)
        w = jnp.exp(m - big)
        denom = l * w + jnp.exp(sink - big)
        o = acc * (w / denom)[:, None]
        plgpu.store(o_ref.at[b, heads, :], o.astype(BF16), mask=gmask)
    else:
        acc_ref, m_ref, l_ref = outs[1:4] if combine_here else outs[:3]

        def store_partials():
            plgpu.store(acc_ref.at[b, heads, s, :], acc, mask=gmask)
            plgpu.store(m_ref.at[b, heads, s], m, mask=gmask[:, 0])
            plgpu.store(l_ref.at[b, heads, s], l, mask=gmask[:, 0])

        if NEUTRAL_PARTIALS and not combine_here:  # splits past the data store their neutral partials
            store_partials()
        else:  # splits past the data write nothing; the fold does not read them
            pl.when(s < n_active)(store_partials)

        if combine_here:
            o_ref, cnt_ref = outs[0], outs[4]
            if compiled:
                plgpu.debug_barrier()  # every thread's partial stores precede the release of the atomic
            ticket = plgpu.atomic_add(cnt_ref, (b, kv), jnp.ones((), jnp.int32))

            @pl.when(ticket == splits - 1)  # the last of this (sequence, KV head)'s splits folds them all
            def _():
                # Only the G real heads (padded to a power of two), not the ROWS of the dot tiles: so the whole
                # fold (every split's acc, m and l) is one round of loads when splits * FR * D fits FOLD_VALUES.
                # Volatile loads: the partials were written by other SMs during this launch (not via L1).
                FR = pow2_rows(G)
                fheads = pl.ds(kv * G, FR)
                fmask = (jnp.arange(FR) < G)[:, None]
                C = max(1, min(splits, FOLD_VALUES // (FR * D)))
                live = fmask & (jnp.arange(splits) < n_active)[None, :]

                def load_acc(c):  # C splits' partials in one [FR, C, D] load
                    idx = c * C + jnp.arange(C)
                    live2 = fmask & (idx < n_active)[None, :]
                    return plgpu.load(acc_ref.at[b, fheads, pl.ds(c * C, C), :], mask=live2[:, :, None], other=0,
                                      volatile=True)

                first = load_acc(0)  # issued with the m and l loads, before any arithmetic waits on them
                mm = plgpu.load(m_ref.at[b, fheads, :], mask=live, other=NEG_INF, volatile=True)
                ll = plgpu.load(l_ref.at[b, fheads, :], mask=live, other=0, volatile=True)
                sink = plgpu.load(sink_ref.at[fheads], mask=fmask[:, 0], other=0).astype(F32)
                big = jnp.maximum(jnp.max(mm, axis=1), sink)
                big = jnp.where(jnp.isfinite(big), big, 0.0)
                scale = jnp.exp(mm - big[:, None])  # [FR, splits]
                denom = jnp.sum(ll * scale, axis=1) + jnp.exp(sink - big)

                def fold(c, o, a):
                    idx = c * C + jnp.arange(C)
                    live2 = fmask & (idx < n_active)[None, :]
                    mi = plgpu.load(m_ref.at[b, fheads, pl.ds(c * C, C)], mask=live2, other=NEG_INF, volatile=True)
                    return o + jnp.sum(a * jnp.exp(mi - big[:, None])[:, :, None], axis=1)

                if splits <= C:
                    o = jnp.sum(first * scale[:, :, None], axis=1)
                else:
                    o = jax.lax.fori_loop(1, pl.cdiv(n_active, C), lambda c, o: fold(c, o, load_acc(c)),
                                          fold(0, jnp.zeros((FR, D), F32), first))
                plgpu.store(o_ref.at[b, fheads, :], (o / denom[:, None]).astype(BF16), mask=fmask)


def _combine_kernel(acc_ref, m_ref, l_ref, sink_ref, pos_ref, act_ref, o_ref, *, ring, fused, splits, min_chunk,
                    unit, batch):
    """splits: the attention kernel's split count; the partials' split axis may be longer (padded to a power of
    two); the first `splits` entries are read (without NEUTRAL_PARTIALS: the first n_active, those that hold data).
    Rows of o past `batch` (padding rows) get zeros."""
    b, h = pl.program_id(0), pl.program_id(1)

    def row():
        _combine_row(acc_ref, m_ref, l_ref, sink_ref, pos_ref, act_ref, o_ref, b, h, ring=ring, fused=fused,
                     splits=splits, min_chunk=min_chunk, unit=unit)

    if o_ref.shape[0] == batch:
        row()
        return
    pl.when(b < batch)(row)

    @pl.when(b >= batch)
    def _():
        o_ref[b, h, :] = jnp.zeros((o_ref.shape[-1],), BF16)


def _combine_row(acc_ref, m_ref, l_ref, sink_ref, pos_ref, act_ref, o_ref, b, h, *, ring, fused, splits,
                 min_chunk, unit):
    if ring or NEUTRAL_PARTIALS:  # every split's partials were stored (static count: no load waits for pos)
        n_active = splits
    else:
        _, _, n_active = split_geometry(pos_ref[b], act_ref[b] != 0, fused=fused, splits=splits,
                                        min_chunk=min_chunk, unit=unit)
    live = jnp.arange(m_ref.shape[-1]) < n_active
    m = plgpu.load(m_ref.at[b, h, :], mask=live, other=NEG_INF)
    l = plgpu.load(l_ref.at[b, h, :], mask=live, other=0)
    acc = plgpu.load(acc_ref.at[b, h, :, :], mask=live[:, None], other=0)
    sink = sink_ref[pl.ds(h, 1)].astype(F32)  # [1]
    big = jnp.maximum(jnp.max(m, axis=0, keepdims=True), sink)
    big = jnp.where(jnp.isfinite(big), big, 0.0)
    w = jnp.exp(m - big)  # [S]
    denom = jnp.sum(l * w, axis=0, keepdims=True) + jnp.exp(sink - big)
    o = jnp.sum(acc * w[:, None], axis=0) / denom
    o_ref[b, h, :] = o.astype(BF16)


def combine(acc, m, l, sinks, positions, active, *, ring: bool, fused: bool, min_chunk: int,
            interpret: bool = False, splits: int | None = None, out_rows: int | None = None, unit: int = BLOCK_K):
    """Fold split partials (acc [B, Hq, S, D], running max m and sum l [B, Hq, S]) and the sinks -> o bf16
    [out_rows, Hq, D] (default B; rows past B are zeros: the padding rows a decode step carries, model.Blocks.rows).
    Every one of the attention's `splits` is read (NEUTRAL_PARTIALS), or only those that `split_geometry` says
    hold data (min_chunk and unit: the attention's). splits: the attention's split count (default S; S may be padded
    past it to a power of two)."""
    B, Hq, S, D = acc.shape
    out_rows = out_rows or B
    kernel = functools.partial(_combine_kernel, ring=ring, fused=fused, splits=splits or S, min_chunk=min_chunk,
                               unit=unit, batch=B)
    operands, in_specs = layer_stack.kernel_args([acc, m, l, sinks.astype(F32), positions.astype(jnp.int32),
                                                  active.astype(jnp.int32)])
    return pl.pallas_call(
        kernel, grid=(out_rows, Hq), out_shape=jax.ShapeDtypeStruct((out_rows, Hq, D), BF16), in_specs=in_specs,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="decode_attention_combine",
    )(*operands)


def _attention_call(mode, first_args, cache, positions, active, sinks, cfg, sliding, splits, min_chunk, interpret,
                    out_rows=None):
    B = positions.shape[0]
    out_rows = out_rows or B
    Hq, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    check_cache(cache, cfg, B, sliding, interpret)
    ring = isinstance(cache, RingCache)
    n_slots = cache.k.shape[2]
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    if min_chunk < BLOCK_K or min_chunk % BLOCK_K:
        raise ValueError(f"min_chunk must be a multiple of BLOCK_K={BLOCK_K}, got {min_chunk}")
    block_k = BLOCK_K if ring else full_block_keys(cache.k.dtype)
    if block_k < BLOCK_K or block_k % BLOCK_K:
        raise ValueError(f"decode_attention.FP8_BLOCK_K must be a multiple of BLOCK_K={BLOCK_K}, got {block_k}")
    unit = chunk_unit(block_k)  # rings: block_k = BLOCK_K = the unit
    min_chunk = -(-min_chunk // unit) * unit  # whole units
    if splits is None:
        splits = default_splits(B, KV, ring, cache.k.dtype, max_len=n_slots, min_chunk=min_chunk)
        if splits == 1 and out_rows > B:  # a cache of <= min_chunk slots and a padded batch: `combine` writes the
            splits = 2                    # padding rows' zeros (one split would need an XLA pad after the kernel)
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive integer, got {splits!r}")
    cache_in = [cache.k, cache.v] + ([cache.pos] if ring else [])
    args = [*first_args, positions.astype(jnp.int32), active.astype(jnp.int32), sinks.astype(F32), *cache_in]
    # The kernel folds power-of-two split counts up to MAX_SPLITS_IN_KERNEL itself; any other count goes to combine.
    combine_here = splits > 1 and COMBINE_IN_KERNEL and splits <= MAX_SPLITS_IN_KERNEL and not splits & (splits - 1)
    s_pad = pl.next_power_of_2(splits)  # the combine kernel loads the split axis whole
    partials = [jax.ShapeDtypeStruct((B, Hq, s_pad, D), F32), jax.ShapeDtypeStruct((B, Hq, s_pad), F32),
                jax.ShapeDtypeStruct((B, Hq, s_pad), F32)]
    aliases = {}
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B, Hq, D), BF16)]
    elif combine_here:
        # o, the partials (scratch), and the arrival counters (zeros in, aliased out so XLA gives a fresh buffer)
        out_shape = [jax.ShapeDtypeStruct((B, Hq, D), BF16), *partials, jax.ShapeDtypeStruct((B, KV), jnp.int32)]
        args.append(jnp.zeros((B, KV), jnp.int32))
        aliases[len(args) - 1] = len(out_shape) - 1
    else:
        out_shape = partials
    out_specs = [pl.no_block_spec] * len(out_shape)
    if mode == "fused":
        n_out = len(out_shape)
        for x in cache_in:  # written in place (a layer of stacked caches: its stack, through a BlockSpec)
            shape, spec = layer_stack.aliased_output(x)
            out_shape.append(shape)
            out_specs.append(spec)
        first = len(args) - len(cache_in) - (1 if combine_here else 0)
        aliases.update({first + i: n_out + i for i in range(len(cache_in))})
    kernel = functools.partial(_attn_kernel, mode=mode, ring=ring, sliding=sliding, B=B, Hq=Hq, KV=KV,
                               G=cfg.q_per_kv, D=D, window=cfg.sliding_window, n_slots=n_slots, splits=splits,
                               min_chunk=min_chunk, block_k=block_k, unit=unit, eps=cfg.rms_norm_eps,
                               num_refs_in=len(args),
                               combine_here=combine_here, compiled=not interpret,
                               rope_table=mode == "fused" and first_args[3].ndim == 3)  # a [B, 2, D/2] table
    operands, in_specs = layer_stack.kernel_args(args)
    outs = pl.pallas_call(
        kernel, grid=(B, KV, splits), out_shape=out_shape, input_output_aliases=aliases, in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=RING_NUM_WARPS if ring else full_num_warps(cache.k.dtype),
                                             num_stages=NUM_STAGES),
        interpret=interpret, name=f"decode_attention_{mode}_{'ring' if ring else 'full'}",
    )(*operands)
    if splits == 1:
        o, rest = outs[0], outs[1:]
    elif combine_here:
        o, rest = outs[0], outs[5:]
    else:
        o = combine(*outs[:3], sinks, positions, active, ring=ring, fused=mode == "fused", min_chunk=min_chunk,
                    interpret=interpret, splits=splits, out_rows=out_rows, unit=unit)
        rest = outs[3:]
    if o.shape[0] < out_rows:  # o written by the attention kernel itself: pad to the caller's rows
        o = jnp.pad(o, ((0, out_rows - o.shape[0]), (0, 0), (0, 0)))
    if mode != "fused":
        return o, cache
    rest = [layer_stack.like(r, x) for r, x in zip(rest, cache_in)]
    new_cache = RingCache(k=rest[0], v=rest[1], pos=rest[2]) if ring else FullCache(k=rest[0], v=rest[1])
    return o, new_cache


def decode_attention(q: jax.Array, cache, positions: jax.Array, sinks: jax.Array, cfg: FlintConfig, sliding: bool,
                     active: jax.Array | None = None, splits: int | None = None, min_chunk: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """Attention of one new token per sequence over a cache that already holds it.
    q [B, Hq, D] bf16 (normed, RoPE'd), positions [B] (the token's position; keys <= position are read, and on a
    sliding layer only the last `sliding_window` of them), sinks [Hq] f32, active [B] bool (inactive rows read
    nothing). Returns o [B, Hq, D] bf16."""
    B = q.shape[0]
    if active is None:
        active = jnp.ones((B,), bool)
    o, _ = _attention_call("attend", [q], cache, positions, active, sinks, cfg, sliding, splits, min_chunk,
                           interpret)
    return o


def fused_decode_attention(qkv: jax.Array, attn, cache, positions: jax.Array, active: jax.Array, cfg: FlintConfig,
                           sliding: bool, splits: int | None = None, min_chunk: int | None = None,
                           interpret: bool = False):
    """From the raw projection qkv [B, Hq+2KV, D] (`qkv_projection`): finish Q/K, write K/V, attend.
    qkv may carry padding rows past B = len(positions) (model.Blocks.rows): o then has them too, as zeros.
    Returns (o [rows of qkv, Hq, D] bf16, new cache)."""
    rope = rope_cos_sin(positions, cfg) if sliding and ROPE_TABLE else rope_tables(cfg)
    return _attention_call("fused", [qkv, attn.q_norm, attn.k_norm, rope], cache, positions, active,
                           attn.sinks, cfg, sliding, splits, min_chunk, interpret, out_rows=qkv.shape[0])


def output_projection(o: jax.Array, w, h: jax.Array, interpret: bool = False) -> jax.Array:
    """`h + linear(o, Wo)`: the team's GEMV kernel (pallas_kernels/gemv.py) when present, else the reference."""
    try:
        from flint_jax.pallas_kernels.gemv import gemv
    except ImportError:
        return h + L.linear(o, w)
    return gemv(o, w, residual=h, interpret=interpret)


def attention_block_decode(h: jax.Array, layer, cache, positions: jax.Array, active: jax.Array, cfg: FlintConfig,
                           sliding: bool, splits: int | None = None, min_chunk: int | None = None,
                           interpret: bool = False):
    """`model.attention_block` for T = 1: h [B, H] bf16, positions [B] (= the sequence lengths before this token),
    active [B] bool. Returns (h + Wo(attention(rmsnorm(h))) [B, H] bf16, new cache). h may carry padding rows past
    B (model.Blocks.rows): they pass through every kernel without a pad or a slice (their attention output is zero,
    their result meaningless)."""
    B = h.shape[0]
    qkv = qkv_projection(h, layer.attn_norm, layer.attn, cfg, interpret=interpret)
    o, cache = fused_decode_attention(qkv, layer.attn, cache, positions, active, cfg, sliding, splits, min_chunk,
                                      interpret)
    return output_projection(o.reshape(B, -1), layer.attn.o, h, interpret=interpret), cache


def model_attention_block(h, layer, cache, positions, valid, lengths_after, cfg: FlintConfig, sliding: bool,
                          interpret: bool = False):
    """`attention_block_decode` behind `model.attention_block`'s signature (h [B, 1, H], positions/valid [B, 1]),
    for `model.Blocks.attention` in a decode (T = 1) step. `lengths_after` is implied by positions and valid."""
    del lengths_after
    if h.shape[1] != 1:
        raise ValueError(f"model_attention_block is the decode (T = 1) path, got T = {h.shape[1]}")
    out, cache = attention_block_decode(h[:, 0], layer, cache, positions[:, 0], valid[:, 0], cfg, sliding,
                                        interpret=interpret)
    return out[:, None], cache


# ---- references ------------------------------------------------------------------------------------------------

def decode_mask(cache, positions: jax.Array, active: jax.Array, cfg: FlintConfig, sliding: bool) -> jax.Array:
    """The mask of model.attention_block for one query per sequence over a cache that holds it: [B, 1, S]."""
    q_pos = jnp.where(active, positions, -1)[:, None]
    if sliding:
        return L.attention_mask(q_pos, cache.pos, cfg.sliding_window)
    S = cache.k.shape[2]
    t = jnp.arange(S)[None, :]
    return L.attention_mask(q_pos, jnp.where(t <= q_pos, t, -1), None)


def ref_decode_attention(q, cache, positions, sinks, cfg: FlintConfig, sliding: bool, active=None, splits=None,
                         min_chunk=None, interpret: bool = False):
    del splits, min_chunk, interpret
    if active is None:
        active = jnp.ones((q.shape[0],), bool)
    mask = decode_mask(cache, positions, active, cfg, sliding)
    values = cache.values() if isinstance(cache, FullCache) else cache.v
    return L.attend(q[:, None], cache.k, values, mask, sinks)[:, 0]


def ref_attention_block_decode(h, layer, cache, positions, active, cfg: FlintConfig, sliding: bool, splits=None,
                               min_chunk=None, interpret: bool = False):
    """model.attention_block with T = 1, for one token per sequence at `positions`."""
    from flint_jax.model import attention_block
    del splits, min_chunk, interpret
    out, cache = attention_block(h[:, None], layer, cache, positions[:, None], active[:, None],
                                 positions + active.astype(jnp.int32), cfg, sliding)
    return out[:, 0], cache
