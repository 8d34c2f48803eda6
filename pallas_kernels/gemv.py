"""Small-batch GEMV (M = 1..8 rows) on NVFP4 or BF16 weights, with an optional fused RMSNorm prologue and residual
epilogue; an FP32-output variant for the LM head; a fused gate/up + SwiGLU variant for the dense MLP.

    gemv(x, w)                 = residual + linear(rmsnorm(x, norm_weight), w)      BF16 [M, N]
    gemv_logits(x, w)          = rmsnorm(x, norm_weight) @ W.T * global_scale       FP32 [M, N]   (logits_from_hidden)
    gemv_swiglu(x, gate, up)   = swiglu(linear(xn, gate), linear(xn, up))           BF16 [M, I]

Grid: one program per block of BN output rows; each program loops over K (weight_tiles.stream_rows), decodes NVFP4
in registers, accumulates in FP32 and applies the global scale to the accumulator. The norm of the (short) input row
is recomputed by every program: M x K bf16 is a few KB, read from L2. Numerics: see weight_tiles (summation order
is the only difference from the reference; products are exact).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax import layer_stack, layers
from flint_jax.params import Linear
from flint_jax.pallas_kernels import weight_tiles as wt

F32, BF16 = jnp.float32, jnp.bfloat16
NUM_SMS = 132  # H200; used only to keep at least two programs per SM in the block table


class Blocks(NamedTuple):
    bn: int  # output rows per program
    bk: int  # K values per loop step
    num_warps: int
    num_stages: int
    dot: bool = False  # tensor-core path: rows padded to 16, each K tile decoded to BF16 and fed to a dot
    elementwise: bool = False  # full-tile FP32 accumulator, one reduction after the K loop (FMA path)
    prefetch: bool = False  # load K step t+1 while computing step t (FMA path; see weight_tiles.stream_rows)


# Table knobs (module state read at trace time, so a benchmark can try variants: scripts/profile_decode.py).
TABLE_BK = 512  # K values per loop step
TABLE_PREFETCH = False  # register double buffer of the next K step (weight_tiles.stream_rows)
LARGE_N = 65536  # outputs from which an NVFP4 weight streams with the LM head's blocks
# Rows from which the tensor-core path (Blocks.dot: weight tiles decoded to BF16 as the MMA's left operand, x the
# right one, rows padded to 8) streams a single weight (gemv, qkv_projection), with DOT_BLOCK; None: never.
# Measured in the batch-8 step at 8K on the H200 (scripts/profile_decode.py, device time, docs/BENCHMARKS.md runs
# BH-BI). In the SASS of the O projection at 8 rows (scripts/kernel_sass.py) the FMA path spends 38 instructions per
# NVFP4 weight value (8 FMAs and 8 activation conversions per value), the dot path 7.8 (weight_tiles.decode_packed).
# NVFP4: QKV 30.3 -> 13.0 us and O projection
# 20.0 -> 13.1 us per layer, step 7.013 -> 5.801 ms; BF16 step 9.178 -> 7.004 ms (16-row blocks). At 4 rows (padded
# to 8) it was slower, 4.083 -> 5.087 ms (XLA pad and slice kernels; QKV 14.4 -> 29.7 us), so it starts at 8 rows.
TABLE_DOT_MIN_ROWS = 8
# (bn, bk, warps, stages): two warps of 16 weight rows each, 256 K values per step. Runs BH-BI, batch 8, device ms
# per step: 5.801; (16, 256, 1) 6.118-6.123; (64, 256, 4) 6.052; (16, 128, 1) 6.435; (16, 512, 1) 6.651.
DOT_BLOCK = (32, 256, 2, 3)
# BF16 weights at M <= 2, one weight per kernel: (bn, bk, warps, prefetch) for K >= 4096 ("long_k": O projection,
# dense down) and shorter K ("short_k": QKV); None: the generic rows below. Measured on the H200
# (scripts/tune_weight_kernels.py --weights bf16, 24 distinct layers, docs/BENCHMARKS.md run BB): the whole row
# in one step of 4 rows with 8 warps, O projection 8.93 -> 5.98 us; QKV 8.99 -> 7.78 us. The generic rows' 512-value
# K tiles keep too few bytes in flight per program: a BF16 GEMV has no decode to hide behind.
BF16_TABLE: dict | None = {"long_k": (4, 4096, 8, False), "short_k": (4, 2048, 4, False)}
# NVFP4 weights on the FMA path, by rows padded to a power of two: (bn, bk, warps) for K >= 4096 ("long_k": O
# projection, dense down) and shorter K ("short_k": QKV, dense gate/up); a missing entry takes the generic blocks
# (16 rows, 512-value K tiles, 4 warps). Measured on the H200 with scripts/tune_weight_kernels.py (24 distinct
# layers): 1 row (run D): thin blocks with long K tiles, 8 warps and the whole K in one step for K >= 4096 (O
# projection 7.5 -> 4.5 us), two 1024-value steps for K = 2048 (QKV 7.5 -> 6.2 us; 2048-value steps with 8 warps:
# 7.1). 2 and 4 rows (run DP): QKV with two 1024-value steps of 4 warps took 15.3 us at 2 rows and the generic
# blocks 22.9 us at 4; one 2048-value step of 8 warps 9.9 and 15.8 us. In the step (run DQ, scripts/profile_decode.py,
# 8K, device time; variant nvfp4_fma_before_DP): batch 2 2.830 -> 2.556 ms; batch 4 4.346 -> 3.994 ms with the QKV
# entry, 3.838 with the long-K one too (O projection 12.0 -> 8.9 us; the dense down unchanged, 28.0 -> 28.6).
# Blocks of 16-32 rows with long tiles spill registers (12-49 us).
NVFP4_FMA_TABLE: dict = {1: {"long_k": (8, 4096, 8), "short_k": (8, 1024, 4)},
                         2: {"long_k": (8, 4096, 8), "short_k": (8, 2048, 8)},
                         4: {"long_k": (8, 4096, 8), "short_k": (8, 2048, 8)}}


def pick_blocks(spec: wt.WeightSpec, m: int, n_weights: int = 1, allow_dot: bool = True) -> Blocks:
    """Block sizes from a small table (tuned on the H200, docs/KERNELS.md), then shrunk so that N/BN >= 2 x SMs.
    allow_dot=False: FMA-path blocks only (kernels without a tensor-core path)."""
    bk, prefetch = TABLE_BK, TABLE_PREFETCH
    if allow_dot and TABLE_DOT_MIN_ROWS is not None and m >= TABLE_DOT_MIN_ROWS and n_weights == 1:
        return dot_blocks(spec)
    if spec.kind == "nvfp4":
        entry = nvfp4_fma_entry(spec, m, n_weights)
        if entry is None:
            bn, warps, stages = 16, 4, 3
        else:
            bn, entry_bk, warps = entry
            bk, stages = max(bk, entry_bk), 3
    elif m <= 2 and n_weights == 1 and BF16_TABLE is not None:  # its 4-row blocks are at min_bn: not shrunk below
        bn, bk, warps, prefetch = BF16_TABLE["long_k" if spec.k >= 4096 else "short_k"]
        stages = 3
    else:
        bn, warps, stages = (16, 4, 3) if m <= 2 else (8, 4, 3)
    if n_weights > 1:
        bn = max(1, bn // 2)
    min_bn = 8 if spec.kind == "nvfp4" else 4  # thinner blocks waste the decode's and the reduction's lanes
    while bn > min_bn and spec.n // bn < 2 * NUM_SMS:
        bn //= 2
    bn = wt.largest_pow2_divisor(spec.n, bn)
    return Blocks(bn, wt.k_tile(spec, bk), warps, stages, prefetch=prefetch)


def dot_blocks(spec: wt.WeightSpec) -> Blocks:
    """The tensor-core path's blocks (DOT_BLOCK) fitted to the weight."""
    bn, bk, warps, stages = DOT_BLOCK
    bn = max(16, wt.largest_pow2_divisor(spec.n, bn))
    return Blocks(bn, wt.k_tile(spec, bk), warps, stages, dot=True)


def nvfp4_fma_entry(spec: wt.WeightSpec, m: int, n_weights: int) -> tuple[int, int, int] | None:
    """NVFP4_FMA_TABLE's (bn, bk, warps) for an FMA-path call on `m` (padded) rows, or None for the generic
    blocks. The LM head (N >= LARGE_N: 16 rows, 2048-value K tiles; 103.6 -> 95.7 us, run J) and two fused weights
    (gemv_swiglu) keep the 1-row entry at 1-2 rows, as tuned; the 2- and 4-row entries were measured for one
    weight (QKV, O projection) only, so those calls on more rows take the generic blocks."""
    k_class = "long_k" if spec.k >= 4096 else "short_k"
    if spec.n >= LARGE_N or n_weights > 1:
        if m > 2:
            return None
        bn, bk, warps = NVFP4_FMA_TABLE[1][k_class]
        return (16, max(bk, 2048), warps) if spec.n >= LARGE_N else (bn, bk, warps)
    return NVFP4_FMA_TABLE.get(m, {}).get(k_class)


def dot_rows(mp: int) -> int:
    """Rows x is padded to on the tensor-core path: the MMA's N side (the weight tile is its M side) is at least 8."""
    return max(8, mp)


def resolve_blocks(spec, m, n_weights, block, allow_dot: bool = True) -> Blocks:
    """The blocks a kernel runs with: the table's (`pick_blocks`), or `block` fitted to the shape."""
    if block is None:
        return pick_blocks(spec, m, n_weights, allow_dot)
    b = Blocks(*block)
    b = b._replace(bn=wt.largest_pow2_divisor(spec.n, b.bn), bk=wt.k_tile(spec, b.bk))
    if b.dot and (b.bn < 16 or (b.bk // 2 if spec.kind == "nvfp4" else b.bk) < 16):
        raise ValueError(f"the tensor-core path needs bn >= 16 and 16 values per K tile, got {b}")
    return b


def _gemv_kernel(*refs, spec, n_weights, mp, blocks, has_norm, has_res, eps, mode, ptx):
    it = iter(refs)
    x_ref = next(it)
    nw_ref = next(it) if has_norm else None
    wrefs = [[next(it) for _ in range(spec.num_operands)] for _ in range(n_weights)]
    res_ref = next(it) if has_res else None
    o_ref = next(it)
    bn, bk = blocks.bn, blocks.bk
    n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
    xs = wt.XSource(x_ref, wt.x_kind(spec.kind, blocks.dot), nw_ref, eps)
    scales = [(wt.dot_scale if blocks.dot else wt.global_scale)(spec, r, 0) for r in wrefs]

    def epilogue(accs, res):
        ys = [wt.apply_global_scale(a, s) for a, s in zip(accs, scales)]
        if mode == "logits":
            return ys[0]
        if mode == "swiglu":
            return swiglu_f32(ys[0].astype(BF16), ys[1].astype(BF16))
        y = ys[0].astype(BF16)
        return y if res is None else (res.astype(F32) + y.astype(F32)).astype(BF16)

    weights = [(spec, r) for r in wrefs]
    if blocks.dot:
        inv = xs.inv_rms_block(spec.k) if has_norm else None
        accs = wt.stream_rows_dot(xs, weights, n0, bn, bk, inv, ptx=ptx)
        o_ref[...] = epilogue([a.T for a in accs], res_ref[...] if has_res else None)
        return
    inv = wt.row_norms(xs, mp, spec.k) if has_norm else None

    residual = wt.epilogue_loads(lambda: [res_ref[r, :] if has_res else None for r in range(mp)])
    accs = wt.stream_rows([xs] * mp, list(range(mp)), weights, [0] * n_weights, n0, bn, bk, inv,
                          elementwise=blocks.elementwise, prefetch=blocks.prefetch)
    res = residual()
    for r in range(mp):
        o_ref[r, :] = epilogue([accs[w * mp + r] for w in range(n_weights)], res[r])


def swiglu_f32(g: jax.Array, u: jax.Array) -> jax.Array:
    """layers.swiglu inside a kernel: bf16(bf16(silu(g)) * u), silu(g) = g / (1 + exp(-g)) in FP32."""
    gf = g.astype(F32)
    s = (gf / (1.0 + jnp.exp(-gf))).astype(BF16).astype(F32)
    return (s * u.astype(F32)).astype(BF16)


def _call(x, ws, *, norm_weight, eps, residual, interpret, mode, block):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got {x.shape}")
    m, k = x.shape
    specs_ops = [wt.weight_operands(w) for w in ws]
    spec = specs_ops[0][0]
    for s, _ in specs_ops:
        if (s.kind, s.n, s.k) != (spec.kind, spec.n, spec.k):
            raise ValueError("fused weights must have one kind and shape")
    if spec.k != k:
        raise ValueError(f"x has K={k} but the weight is [{spec.n}, {spec.k}]")
    if not 1 <= m <= 8:
        raise ValueError(f"gemv serves M = 1..8 rows, got {m}")
    mp = wt.pow2_rows(m)
    blocks = resolve_blocks(spec, mp, len(ws), block)
    if blocks.dot:
        mp = dot_rows(mp)
    x_kind = wt.x_kind(spec.kind, blocks.dot)
    operands = [wt.x_operand(wt.pad_rows(x.astype(BF16), mp), x_kind)]
    if norm_weight is not None:
        nw = norm_weight.astype(BF16)
        operands.append(nw.reshape(k // wt.GROUP, wt.GROUP) if x_kind == "nvfp4" else nw)
    for s, ops in specs_ops:
        operands.extend(wt.dot_operands(s, ops) if blocks.dot else ops)
    specs = [None] * len(operands)
    if residual is not None:
        operands.append(wt.pad_rows(residual.astype(BF16), mp))
        specs.append(pl.BlockSpec((mp, blocks.bn), lambda j: (0, j)))
    operands, in_specs = layer_stack.kernel_args(operands, specs)
    out_dtype = F32 if mode == "logits" else BF16
    kernel = functools.partial(_gemv_kernel, spec=spec, n_weights=len(ws), mp=mp, blocks=blocks,
                               has_norm=norm_weight is not None, has_res=residual is not None, eps=float(eps),
                               mode=mode, ptx=not interpret)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, spec.n), out_dtype),
        grid=(spec.n // blocks.bn,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((mp, blocks.bn), lambda j: (0, j)),
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"{mode}_{spec.kind}",
    )(*operands)
    return out[:m]


def gemv(x: jax.Array, w: Linear, *, norm_weight: jax.Array | None = None, eps: float = 1e-5,
         residual: jax.Array | None = None, interpret: bool = False, block=None) -> jax.Array:
    """`residual + linear(rmsnorm(x, norm_weight), w)`, each part optional. x [M, K] bf16 (M <= 8), w [N, K]
    (BF16 or NVFP4) -> [M, N] bf16. `block` = (bn, bk, num_warps, num_stages) overrides the block table."""
    return _call(x, [w], norm_weight=norm_weight, eps=eps, residual=residual, interpret=interpret, mode="linear",
                 block=block)


def ref_gemv(x: jax.Array, w: Linear, *, norm_weight: jax.Array | None = None, eps: float = 1e-5,
             residual: jax.Array | None = None, interpret: bool = False, block=None) -> jax.Array:
    del interpret, block
    a = x if norm_weight is None else layers.rmsnorm(x, norm_weight, eps)
    y = layers.linear(a, w)
    return y if residual is None else residual + y


def gemv_logits(x: jax.Array, w: Linear, *, norm_weight: jax.Array | None = None, eps: float = 1e-5,
                interpret: bool = False, block=None) -> jax.Array:
    """FP32 `rmsnorm(x, norm_weight) @ W.T * global_scale` (layers.logits_from_hidden): the LM head, no BF16
    rounding of the output. x [M, K] bf16, w [V, K] -> [M, V] f32."""
    return _call(x, [w], norm_weight=norm_weight, eps=eps, residual=None, interpret=interpret, mode="logits",
                 block=block)


def ref_gemv_logits(x, w, *, norm_weight=None, eps=1e-5, interpret=False, block=None):
    del interpret, block
    if norm_weight is not None:
        return layers.logits_from_hidden(x, norm_weight, w, eps)
    acc = jnp.einsum("mk,nk->mn", x.astype(BF16), layers.weight_values(w), preferred_element_type=F32)
    return acc * w.global_scale if hasattr(w, "global_scale") else acc


def gemv_swiglu(x: jax.Array, gate: Linear, up: Linear, *, norm_weight: jax.Array | None = None, eps: float = 1e-5,
                interpret: bool = False, block=None) -> jax.Array:
    """`swiglu(linear(xn, gate), linear(xn, up))` with xn = rmsnorm(x, norm_weight) (optional): both weights are
    streamed by the same program, so the MLP's hidden activations are written once. x [M, K] -> [M, I] bf16."""
    return _call(x, [gate, up], norm_weight=norm_weight, eps=eps, residual=None, interpret=interpret, mode="swiglu",
                 block=block)


def ref_gemv_swiglu(x, gate, up, *, norm_weight=None, eps=1e-5, interpret=False, block=None):
    del interpret, block
    a = x if norm_weight is None else layers.rmsnorm(x, norm_weight, eps)
    return layers.swiglu(layers.linear(a, gate), layers.linear(a, up))
