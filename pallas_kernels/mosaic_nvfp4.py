"""NVFP4 weight streaming on Mosaic GPU (wgmma, TMA): the in-register decode, and the LM-head kernel built on it.

The decode (`decode_tile`, written with `plgpu.inline_mgpu`: registers and PTX) turns one 64-byte step of 64 tile
rows (flint_jax/nvfp4_tiles.py) into wgmma's BF16 left operand A [64, 128] without leaving registers: each thread
reads 16 code bytes and 2 scale bytes per row, and each code byte becomes one bf16x2 register, its two values
E2M1 x E4M3 x 2^-63 exactly (~3.5 instructions per value; DECODE_PTX). The activations go in as wgmma's right
operand B, x times 2^63 (`x_columns`), so the tensor cores' exact products are x * w and only the FP32 sums run in
another order than `layers`' einsum. Developed in scripts/probe_mosaic_nvfp4.py (runs CL-CW, docs/BENCHMARKS.md).

`lm_head_logits`: FP32 logits x W^T * global_scale of the NVFP4 LM head for up to 8 rows per launch (B's 8
columns are the rows: the weight stream is the same for 1 and 8 rows). One program per 64 vocabulary rows
streams its [64, K/2] code tile through a TMA pipeline of `sub` steps per copy; the epilogue stores each thread's
accumulator values straight into the [rows, V] logits. On the H200 (run DA): 59.6 us for Flint's 175 MB head
(2.9 TB/s) against 80.3 us for the Triton `gemv_logits`.

`inline_mgpu` has no interpreter: in interpret mode (`interpret=True`, the CPU) the kernel decodes with array ops
(`decode_values`, the same values), hands A to wgmma through shared memory (the interpreter's wgmma takes refs)
and stores through shared memory; the pipeline, the tile addressing, the operand orientation and the rows are
the compiled kernel's. The PTX arithmetic itself is checked bit for bit by `decoded_byte` (tests) and compiled on
the GPU by the device script's tests. `ref_lm_head_logits` is the reference (layers.logits_from_hidden without the
norm).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flint_jax import nvfp4
from flint_jax.nvfp4_tiles import ROWS, STEP_BYTES, NVFP4Tiles, dims, unpack

F32, BF16 = jnp.float32, jnp.bfloat16
X_SHIFT = 63  # x is scaled by 2^63 and the scales by 2^63; the decoded code is E2M1 x 2^-126 (see DECODE_PTX)
TILE_K = 2 * STEP_BYTES  # K positions of A per step
X_ROWS = 8  # wgmma's smallest N: rows of x per launch of lm_head_logits
LM_HEAD_STAGES = 4  # TMA pipeline depth (run DA: 4 stages of 2 steps 59.6 us; 8 stages 66.5-74.7)

# Byte `k` of word $1 -> bf16x2 [E2M1(low nibble), E2M1(high nibble)] x E4M3 pair $2 (both x 2^63).
# b * 0x00040040 moves the low nibble's magnitude bits 0-2 to 6-8 and the high nibble's 4-6 to 22-24 (no carries
# between the two terms); b * 0x01001000 moves the signs (bits 3, 7) to 15 and 31. The bf16 pattern
# (m << 6 | s << 15) is E2M1 x 2^-126 (code 1, 0.5, is the subnormal 2^-127), and the bf16x2 multiply by
# E4M3 x 2^63 makes it E2M1 x E4M3 x 2^-63: exact (6 significant bits, exponents inside BF16's normal range).
DECODE_PTX = """{{
.reg .b32 b, x, y;
bfe.u32 b, $1, {shift}, 8;
mul.lo.u32 x, b, 0x00040040;
and.b32 x, x, 0x01C001C0;
mul.lo.u32 y, b, 0x01001000;
and.b32 y, y, 0x80008000;
or.b32 x, x, y;
mul.rn.bf16x2 $0, x, $2;
}}"""


def _scale_ptx(src: str, packs: tuple[str, ...]) -> str:
    """PTX: two E4M3 bytes in `src` -> each x 2^63 in FP32 (flo, fhi; exact), packed into bf16x2 registers by the
    `cvt.rn.bf16x2.f32` operand lists in `packs`."""
    return ("{\n.reg .b32 h;\n.reg .b16 lo, hi;\n.reg .f32 flo, fhi;\n"
            f"cvt.rn.f16x2.e4m3x2 h, {src};\nmov.b32 {{lo, hi}}, h;\n"
            "cvt.f32.f16 flo, lo;\ncvt.f32.f16 fhi, hi;\n"
            "mul.rn.f32 flo, flo, 0f5F000000;\nmul.rn.f32 fhi, fhi, 0f5F000000;\n"
            + "".join(f"cvt.rn.bf16x2.f32 {p};\n" for p in packs) + "}")


# Two E4M3 bytes (low: the low nibbles' group, high: the high nibbles') -> bf16x2 of each x 2^63, exactly.
SCALE_PTX = _scale_ptx("$1", ("$0, fhi, flo",))
# Two E4M3 bytes -> two bf16x2 registers, (lo, lo) and (hi, hi), each scale x 2^63, exactly: the natural layout's
# scale is shared by both values of a register (one 16-value group spans two registers' columns).
SCALE_BCAST_PTX = _scale_ptx("$2", ("$0, flo, flo", "$1, fhi, fhi"))


def columns(q: int) -> int:
    """wgmma's N for q K-segments: q columns, at least 8 (the smallest N)."""
    return max(X_ROWS, q)


def x_segments(x: jax.Array, q: int) -> jax.Array:
    """x [..., K] -> [..., q, K/q] BF16: segment s of x times 2^63, in the order of the decoded A columns: position
    t * 128 + 8 c + 2 j + e holds x[e * K/2 + s * K/(2q) + 64 t + 16 j + c]."""
    *lead, K = x.shape
    steps = K // 2 // q // STEP_BYTES
    xs = (x.astype(F32) * 2.0 ** X_SHIFT).astype(BF16)
    xv = xs.reshape(*lead, 2, q, steps, 4, 16)  # [..., e, s, t, j, c]
    n = len(lead)
    perm = tuple(range(n)) + tuple(n + p for p in (1, 2, 4, 3, 0))  # [..., s, t, c, j, e]
    return xv.transpose(perm).reshape(*lead, q, K // q)


def x_columns(x: jax.Array, q: int) -> jax.Array:
    """One token x [1, K] -> B^T [columns(q), K/q]: row s is segment s (x_segments); rows s >= q are zero."""
    K = x.shape[-1]
    return jnp.zeros((columns(q), K // q), BF16).at[:q].set(x_segments(x.reshape(K), q))


def x_rows(x: jax.Array) -> jax.Array:
    """Up to 8 tokens x [M, K] -> B^T [8, K] for q = 1 tiles: row m is token m (x_segments); rows >= M are zero."""
    M, K = x.shape
    return jnp.zeros((X_ROWS, K), BF16).at[:M].set(x_segments(x, 1)[:, 0])


def thread_coords():
    """Inside an inline_mgpu body: (i32 constant maker, index cast, thread id in the warpgroup, j = lane % 4,
    row0). In wgmma's register fragment this thread holds rows row0 and row0 + 8 and, in every 8-column block,
    columns 2 j and 2 j + 1."""
    from jax._src.lib.mlir import ir  # noqa: PLC0415  (GPU lowering only)
    from jax._src.lib.mlir.dialects import arith  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()

    def ci(v):
        return arith.constant(i32, v)

    def idx(v):
        return arith.index_cast(index, v)

    tid = arith.remui(mu.thread_idx(), ci(128))
    lane, warp = arith.remui(tid, ci(32)), arith.divui(tid, ci(32))
    row0 = arith.addi(arith.muli(warp, ci(16)), arith.divui(lane, ci(4)))
    return ci, idx, tid, arith.remui(lane, ci(4)), row0


def decode_tile(ctx, c_ref, s_ref, *, skip: bool = False, natural: bool = False):
    """inline_mgpu body: the [64, 128] BF16 A tile of one step, in wgmma's register layout, from its [64, 64] code
    tile and [2, 256] scale tile (nvfp4_tiles). skip: zeros instead (a diagnostic: the kernel's cost without the
    decode; the TMA traffic stays). natural: scripts/probe_mosaic_nvfp4.natural_layout's tiles (register c's two
    values share the scale of group c // 2)."""
    del ctx
    import jax.experimental.mosaic.gpu as mgpu  # noqa: PLC0415  (GPU lowering only)
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import arith, vector  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

    i32, i16, i8 = (ir.IntegerType.get_signless(w) for w in (32, 16, 8))
    bf16 = ir.BF16Type.get()
    ci, idx, _, j, row0 = thread_coords()
    layout = mgpu.WGMMA_LAYOUT
    if skip:
        return mgpu.FragmentedArray.splat(arith.constant(bf16, 0.0), (ROWS, TILE_K), layout)
    regs = np.empty(layout.registers_shape((ROWS, TILE_K)), dtype=object)
    for h in range(2):
        m = arith.addi(row0, ci(8 * h))
        code_vec = vector.load(ir.VectorType.get((16,), i8), c_ref, [idx(m), idx(arith.muli(j, ci(16)))])
        words = mu.bitcast(code_vec, ir.VectorType.get((4,), i32))
        if natural:  # the row's 8 scale bytes at flat m * 8: 4 pairs, each two broadcast bf16x2 scales
            flat = arith.muli(m, ci(8))
            eight = vector.load(ir.VectorType.get((8,), i8), s_ref, [idx(arith.divui(flat, ci(256))),
                                                                     idx(arith.remui(flat, ci(256)))])
            pairs = mu.bitcast(eight, ir.VectorType.get((4,), i16))
            scales = []
            for g2 in range(4):
                pair = vector.extract(pairs, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([g2]))
                scales.extend(mu.inline_ptx(SCALE_BCAST_PTX, pair, result_types=[i32, i32]))
            for c in range(16):
                word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([c // 4]))
                val = mu.inline_ptx(DECODE_PTX.format(shift=8 * (c % 4)), word, scales[c // 2], result_types=i32)
                regs[(0, c, 0, 0, h, 0, 0, 0, 0)] = mu.bitcast(val, ir.VectorType.get((2,), bf16))
            continue
        # scale bytes (m, j, e) at flat m * 8 + 2 j of the [2, 256] tile
        flat = arith.addi(arith.muli(m, ci(8)), arith.muli(j, ci(2)))
        pair = vector.load(ir.VectorType.get((2,), i8), s_ref, [idx(arith.divui(flat, ci(256))),
                                                                idx(arith.remui(flat, ci(256)))])
        scale = mu.inline_ptx(SCALE_PTX, mu.bitcast(pair, i16), result_types=i32)
        for c in range(16):
            word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([c // 4]))
            val = mu.inline_ptx(DECODE_PTX.format(shift=8 * (c % 4)), word, scale, result_types=i32)
            regs[(0, c, 0, 0, h, 0, 0, 0, 0)] = mu.bitcast(val, ir.VectorType.get((2,), bf16))
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)


def decode_values(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """decode_tile's A with array ops (the interpreter's decode): codes uint8 [64, 64], scales uint8 [2, 256] ->
    [64, 128] BF16, column 8 c + 2 j + e = nibble e of byte 16 j + c times scale byte 8 m + 2 j + e, x 2^-63."""
    b = codes.astype(jnp.int32).reshape(ROWS, 4, 16)  # [m, j, c]
    nib = jnp.stack([b & 15, b >> 4], axis=-1)  # [m, j, c, e]
    mag = nib & 7
    twice = jnp.where(mag < 4, mag, (2 + (mag & 1)) << jnp.maximum((mag >> 1) - 1, 0))  # 2 |E2M1|, exact
    val = jnp.where((nib & 8) != 0, -twice, twice).astype(F32)
    sc = lax.bitcast_convert_type(scales.reshape(ROWS, 4, 2), jnp.float8_e4m3fn).astype(F32)  # [m, j, e]
    a = val * sc[:, :, None, :] * 2.0 ** -(X_SHIFT + 1)  # exact in FP32 (>= 2^-73)
    return a.transpose(0, 2, 1, 3).reshape(ROWS, TILE_K).astype(BF16)


def decoded_byte(b: int) -> tuple[float, float]:
    """DECODE_PTX's integer part for one code byte, in Python: the bf16x2 pattern read as its two BF16 values
    (subnormals included), each E2M1 x 2^-126 of its nibble."""
    bits = (((b * 0x00040040) & 0x01C001C0) | ((b * 0x01001000) & 0x80008000)) & 0xFFFFFFFF
    lo, hi = np.frombuffer(np.array([(bits << 16) & 0xFFFFFFFF, bits & 0xFFFF0000], np.uint32).tobytes(), np.float32)
    return float(lo), float(hi)


def _store_logits(ctx, acc, gs_ref, o_ref, *, rows: int):
    """inline_mgpu body: o[r, m] = acc[m, r] * global_scale for the program's 64 vocabulary rows m and the
    x rows r < rows, each thread storing its own accumulator values (no shared-memory round trip)."""
    del ctx
    from jax._src.lib.mlir import ir  # noqa: PLC0415  (GPU lowering only)
    from jax._src.lib.mlir.dialects import arith, memref, vector  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

    ci, idx, _, j, row0 = thread_coords()
    gs = memref.load(gs_ref, [idx(ci(0))])
    for h in range(2):
        m = arith.addi(row0, ci(8 * h))
        reg = acc.registers[(0, 0, 0, 0, h, 0, 0, 0, 0)]
        for e in range(2):
            r = arith.addi(arith.muli(j, ci(2)), ci(e))
            el = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
            with mu.when(arith.cmpi(arith.CmpIPredicate.ult, r, ci(rows))):
                memref.store(arith.mulf(el, gs), o_ref, [idx(r), idx(m)])


def _logits8(xb: jax.Array, w: NVFP4Tiles, rows: int, *, interpret: bool, stages: int) -> jax.Array:
    """x_rows' B^T [8, K] -> logits [rows, N] FP32."""
    progs, steps = dims(w.n, w.k, 1)
    sub = w.sub
    steps //= sub
    swizzle = plgpu.find_swizzle(TILE_K * 16)
    k_major = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    scratch = [plgpu.SMEM((ROWS, TILE_K), BF16, transforms=k_major), plgpu.SMEM((X_ROWS, ROWS), F32)] \
        if interpret else []
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415
        mode = dict(interpret=InterpretGPUParams())
    else:
        decode = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                                   return_type=plgpu.ShapeDtypeStruct((ROWS, TILE_K), BF16, layout=plgpu.Layout.WGMMA)
                                   )(decode_tile)
        store = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()))(
            functools.partial(_store_logits, rows=rows))
        mode = {}

    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((rows, w.n), F32), grid=(progs,),
                       grid_names=("i",), scratch_types=scratch, **mode)
    def kernel(x_gmem, c_gmem, s_gmem, gs_gmem, o_gmem, *scratch_refs):
        i = lax.axis_index("i")

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((ROWS, X_ROWS), F32))
        def _(acc):
            def step(_, c_smem, s_smem, x_smem):
                for u in range(sub):
                    c_tile, s_tile = c_smem.at[:, pl.ds(u * STEP_BYTES, STEP_BYTES)], s_smem.at[pl.ds(2 * u, 2), :]
                    if interpret:
                        a = scratch_refs[0]
                        a[...] = decode_values(c_tile[...], s_tile[...])
                        plgpu.commit_smem()
                    else:
                        a = decode(c_tile, s_tile)
                    plgpu.wgmma(acc, a, x_smem.at[:, pl.ds(u * TILE_K, TILE_K)].transpose((1, 0)))
                    plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=stages, in_specs=[
                plgpu.BlockSpec((ROWS, sub * STEP_BYTES), lambda t: (i * steps + t, 0)),
                plgpu.BlockSpec((2 * sub, 256), lambda t: (i * steps + t, 0)),
                plgpu.BlockSpec((X_ROWS, sub * TILE_K), lambda t: (0, t), transforms=k_major)],
            )(c_gmem, s_gmem, x_gmem)
            plgpu.wgmma_wait(0)
            out = o_gmem.at[:, pl.ds(i * ROWS, ROWS)]
            if interpret:
                o_smem = scratch_refs[1]
                o_smem[...] = (acc[...] * gs_gmem[0]).T
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[:rows], out)
                plgpu.wait_smem_to_gmem(0)
            else:
                store(acc[...], gs_gmem, out)

    return kernel(xb, w.codes, w.scales, w.global_scale.reshape(1).astype(F32))


def lm_head_logits(x: jax.Array, w: NVFP4Tiles, *, interpret: bool = False,
                   stages: int = LM_HEAD_STAGES) -> jax.Array:
    """FP32 `x @ W.T * global_scale` (layers.logits_from_hidden after its norm): x [M, K] BF16 (any M: 8 rows per
    launch), w the head tiled with q = 1 (nvfp4_tiles.pack) -> [M, N] FP32."""
    M, K = x.shape
    if w.q != 1 or K != w.k:
        raise ValueError(f"lm_head_logits: x [{M}, {K}] against tiles of [{w.n}, {w.k}] with q={w.q}; "
                         f"needs q=1 and K={w.k}")
    parts = [_logits8(x_rows(x[r:r + X_ROWS]), w, min(X_ROWS, M - r), interpret=interpret, stages=stages)
             for r in range(0, M, X_ROWS)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def ref_lm_head_logits(x: jax.Array, w: NVFP4Tiles, *, interpret: bool = False, stages: int | None = None):
    """The reference: FP32 einsum of x and the exact weight values, times the global scale."""
    del interpret, stages
    wt = unpack(w)
    acc = jnp.einsum("mk,nk->mn", x.astype(BF16), nvfp4.dequantize(wt), preferred_element_type=F32)
    return acc * wt.global_scale
