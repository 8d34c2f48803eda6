"""Probe: a batch-1 NVFP4 GEMV as a Mosaic GPU kernel with a packed in-register decode, against the Triton `gemv`.

Run AC (docs/BENCHMARKS.md) built the first Mosaic GPU NVFP4 GEMV from Pallas array ops: Mosaic's layout inference
kept the code tile in 2-element vectors widened to i32, ~15 integer ops per value, 63 us for the O projection
against 4.4 us in Triton. This probe writes the decode by hand (`plgpu.inline_mgpu`: registers and PTX), so that
each value costs ~3 instructions and the tensor cores do the multiply-adds:

  A (wgmma's left operand, in registers)  64 rows = R output rows x Q K-segments; each bf16x2 register is one code
      byte, its two nibbles (planar halves: values k and k + K/2) decoded and multiplied by their two block scales,
      exactly E2M1 x E4M3 x 2^-63 in BF16 (bfe, 2 integer multiplies, and, and, or, one bf16x2 multiply).
  B (shared memory, TMA)                  x, times 2^63, one column per K-segment (max(8, Q) columns): row (n, q) of
      A against column q is segment q's partial dot product of output row n.
  epilogue                                out[n] = bf16(sum_q acc[(n, q), q] * global_scale).

The decode's order of K inside a tile follows wgmma's register fragment, so the weight bytes, the scales and x are
laid out for it beforehand (`mosaic_layout`, `x_columns`; a converter would write the weights this way, and the
producer of x could write its columns). One program per R output rows streams R x K/2 code bytes through a TMA
pipeline; no split-K partial sums leave the kernel.

    python scripts/probe_mosaic_nvfp4.py --out $OUT/nvfp4          # on the GPU: check against layers.linear, time
    python scripts/probe_mosaic_nvfp4.py --out /tmp/n --lower-only # CPU: lower the kernel for CUDA

tests/test_mosaic_nvfp4_probe.py checks the layouts on the CPU with `emulate` (the kernel's per-thread arithmetic in
NumPy, bit for bit); `inline_mgpu` has no interpreter, so the kernel itself runs only on the GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flint_jax  # noqa: E402,F401  (XLA flags first)
from flint_jax import device_trace, nvfp4, nvfp4_tiles, pallas_path  # noqa: E402
from flint_jax import layers as L  # noqa: E402
from flint_jax.pallas_kernels import gemv as triton_gemv  # noqa: E402
from flint_jax.pallas_kernels import mosaic_nvfp4 as mn  # noqa: E402
from flint_jax.pallas_kernels.mosaic_nvfp4 import (X_SHIFT, columns, decode_tile, decoded_byte,  # noqa: E402,F401
                                                   thread_coords)
from flint_jax.nvfp4_tiles import STEP_BYTES, dims  # noqa: E402

Q = 4  # default K segments per output row; A has R * Q = 64 rows (wgmma's M), so R = 64 // Q output rows per program
COLS = 16  # the most x segment columns (wgmma's N); a kernel uses columns(q) of them
SHAPES = {"o_proj": (2048, 4096), "qkv": (5120, 2048), "lm_head": (151552, 2048), "dense_gate_up": (20480, 2048),
          "dense_down": (2048, 10240)}


def mosaic_layout(w: nvfp4.NVFP4Weight, q: int = Q, sub: int = 1) -> tuple[jax.Array, jax.Array]:
    """The kernel's weight layout (flint_jax/nvfp4_tiles.py): (codes [N/R * steps/sub * 64, 64 sub], scales
    [N/R * steps * 2, 256]) uint8."""
    return nvfp4_tiles.tile_arrays(w, q, sub)


def x_columns(x: jax.Array, q: int = Q) -> jax.Array:
    """x [1, K] -> B^T [columns(q), K/q] (mosaic_nvfp4.x_columns)."""
    return mn.x_columns(x, q)


def natural_layout(w: nvfp4.NVFP4Weight, q: int = Q) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel layout for x in its natural order (x_natural): K-segment s of a row is values [s K/q, (s+1) K/q),
    and within a step's 128 values the code byte 16 j + c of an A row holds values 8 c + 2 j (low nibble) and
    8 c + 2 j + 1 (high), the two columns of wgmma's register c for the thread with lane % 4 = j. A lossless repack
    of the nibbles. Scales: 8 bytes per A row and step (its 16-value groups in order), [2, 256] per step.
    -> (codes [N/R * steps * 64, 64], scales [N/R * steps * 2, 256] uint8, global scale x 2^63 [1] f32)."""
    N, half = w.codes.shape
    K = 2 * half
    progs, steps = dims(N, K, q)
    r = 64 // q
    nib = nvfp4.unpack_codes(w.codes).reshape(progs, r, q, steps, 16, 4, 2)  # [i, n, s, t, c, j, e]
    byte = (nib[..., 0] | (nib[..., 1] << 4)).astype(jnp.uint8).transpose(0, 3, 1, 2, 5, 4)  # [i, t, n, s, j, c]
    sb = lax.bitcast_convert_type(w.scales, jnp.uint8).reshape(progs, r, q, steps, 8).transpose(0, 3, 1, 2, 4)
    gs = (w.global_scale.astype(jnp.float32) * 2.0 ** X_SHIFT).reshape(1)
    return byte.reshape(progs * steps * 64, STEP_BYTES), sb.reshape(progs * steps * 2, 256), gs


def x_natural(x: jax.Array, q: int = Q) -> jax.Array:
    """x [.., K] -> B^T [q, K/q] for natural_layout: a free reshape, x as its producer wrote it (q >= 8)."""
    if q < 8:
        raise ValueError(f"natural x needs q >= 8 K-segments (wgmma's N), got {q}")
    return x.reshape(q, x.shape[-1] // q).astype(jnp.bfloat16)


def store_diagonal(acc, red_ref, *, q: int):
    """Inside an inline_mgpu body: red_ref[m] = acc[m, m % q] for the 64 A rows m = n * q + s (segment s's partial
    dot product of row n), then a warpgroup barrier. Returns (i32 constant maker, index cast, thread id)."""
    from jax._src.lib.mlir import ir  # noqa: PLC0415  (GPU lowering only)
    from jax._src.lib.mlir.dialects import arith, memref, vector  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

    ci, idx, tid, j, row0 = thread_coords()
    for h in range(2):
        m = arith.addi(row0, ci(8 * h))
        # A row m = n * q + s wants column s: this thread holds columns 8 c8 + 2 j + e (register c8, element e)
        s = arith.remui(m, ci(q))
        val = None
        for c8 in range((q + 7) // 8):
            reg = acc.registers[(0, c8, 0, 0, h, 0, 0, 0, 0)]
            for e in range(2):
                el = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
                hit = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, arith.divui(s, ci(8)), ci(c8)),
                                 arith.cmpi(arith.CmpIPredicate.eq, arith.remui(s, ci(2)), ci(e)))
                val = el if val is None else arith.select(hit, el, val)
        mine = arith.cmpi(arith.CmpIPredicate.eq, j, arith.divui(arith.remui(s, ci(8)), ci(2)))
        with mu.when(mine):
            memref.store(val, red_ref, [idx(m)])
    mu.warpgroup_barrier()
    return ci, idx, tid


def row_total(red_ref, n, *, q: int):
    """Inside an inline_mgpu body, after store_diagonal: sum over s of red_ref[n * q + s] (n an i32 value), FP32,
    in the order s = 0, 1, ... (emulate_rows' order)."""
    from jax._src.lib.mlir import ir  # noqa: PLC0415  (GPU lowering only)
    from jax._src.lib.mlir.dialects import arith, memref  # noqa: PLC0415

    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    base = arith.muli(n, arith.constant(i32, q))
    total = memref.load(red_ref, [arith.index_cast(index, base)])
    for s in range(1, q):
        at = arith.index_cast(index, arith.addi(base, arith.constant(i32, s)))
        total = arith.addf(total, memref.load(red_ref, [at]))
    return total


def _finish(ctx, acc, red_ref, gs_ref, o_ref, res_ref=None, *, q: int, end_barrier: bool = False,
            out_f32: bool = False):
    """inline_mgpu body: out[n] = bf16(sum_s acc[n * q + s, s] * global_scale) for the program's 64/q rows; with a
    residual, out[n] = bf16(res[n] + that) (layers' rounding points: the linear output rounded, then the sum).
    end_barrier: a warpgroup barrier after the reads of red_ref (a persistent program reuses it for its next rows).
    out_f32: store the FP32 product unrounded (the LM head's logits)."""
    del ctx
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import arith, memref  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

    bf16, f32 = ir.BF16Type.get(), ir.F32Type.get()
    ci, idx, tid = store_diagonal(acc, red_ref, q=q)
    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, tid, ci(64 // q))):
        gs = memref.load(gs_ref, [idx(ci(0))])
        y = arith.mulf(row_total(red_ref, tid, q=q), gs)
        if not out_f32:
            y = arith.truncf(bf16, y)
        if res_ref is not None:
            y = arith.truncf(bf16, arith.addf(arith.extf(f32, memref.load(res_ref, [idx(tid)])), arith.extf(f32, y)))
        memref.store(y, o_ref, [idx(tid)])
    if end_barrier:
        mu.warpgroup_barrier()


def mosaic_gemv_nvfp4(xcols: jax.Array, codes_m: jax.Array, scales_m: jax.Array, global_scale: jax.Array, *,
                      N: int, K: int, q: int = Q, stages: int = 4, overlap: bool = False,
                      skip_decode: bool = False, sub: int = 1, natural: bool = False,
                      residual: jax.Array | None = None, programs: int | None = None,
                      out_f32: bool = False) -> jax.Array:
    """y [N] BF16 = bf16(x W^T * global_scale) from the kernel layout (mosaic_layout, x_columns with the same q).
    natural: natural_layout's operands and x_natural(x, q) (global_scale: the layout's, x 2^63).
    residual [N] BF16: y = bf16(residual + bf16(x W^T * global_scale)), added in the epilogue.
    programs: a persistent grid of that many programs, each taking row blocks p, p + programs, ... through ONE
    pipeline (the next block's tiles load while this block finishes; the accumulator is read and zeroed at each
    block's last step), instead of one program per row block with its own pipeline ramp.
    overlap: let a step's wgmma run while the next step decodes (wgmma_wait(1); x's buffer released a step late).
    sub: 64-byte decode steps per pipeline step (bigger TMA copies; codes_m from mosaic_layout(w, q, sub)).
    out_f32: y [N] FP32 = x W^T * global_scale, unrounded (the LM head's logits; no residual)."""
    if out_f32 and residual is not None:
        raise ValueError("out_f32 takes no residual")
    progs, steps = dims(N, K, q)
    if steps % sub:
        raise ValueError(f"{steps} steps of {STEP_BYTES} code bytes do not group by sub={sub}")
    steps //= sub
    r = 64 // q
    tile_k = 2 * STEP_BYTES
    swizzle = plgpu.find_swizzle(tile_k * 16)
    k_major = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    decode = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                               return_type=plgpu.ShapeDtypeStruct((64, tile_k), jnp.bfloat16,
                                                                  layout=plgpu.Layout.WGMMA))(
        functools.partial(decode_tile, skip=skip_decode, natural=natural))
    finish = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) + (plgpu.RefType(),) * (3 + (residual is not None)))(
        functools.partial(_finish, q=q, end_barrier=programs is not None, out_f32=out_f32))
    if programs is not None and progs % programs:
        raise ValueError(f"{progs} row blocks do not split over {programs} persistent programs")
    blocks = 1 if programs is None else progs // programs
    x_spec = dict(delay_release=1) if overlap and steps > 1 else {}

    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((N,), jnp.float32 if out_f32 else jnp.bfloat16),
                       grid=(progs if programs is None else programs,), grid_names=("i",),
                       scratch_types=[plgpu.SMEM((64,), jnp.float32)])
    def kernel(x_gmem, c_gmem, s_gmem, gs_gmem, *rest):
        *res_gmem, o_gmem, red_smem = rest
        pid = lax.axis_index("i")

        def block_of(b):
            return pid if programs is None else pid + b * programs

        def finish_block(acc, b):
            i = block_of(b)
            finish(acc[...], red_smem, gs_gmem, o_gmem.at[pl.ds(i * r, r)],
                   *[res.at[pl.ds(i * r, r)] for res in res_gmem])

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((64, columns(q)), jnp.float32))
        def _(acc):
            def step(idx, c_smem, s_smem, x_smem):
                b, t = idx
                for u in range(sub):
                    a = decode(c_smem.at[:, pl.ds(u * STEP_BYTES, STEP_BYTES)], s_smem.at[pl.ds(2 * u, 2), :])
                    plgpu.wgmma(acc, a, x_smem.at[:, pl.ds(u * tile_k, tile_k)].transpose((1, 0)))
                    plgpu.wgmma_wait(1 if overlap else 0)
                if programs is not None:
                    @pl.when(t == steps - 1)
                    def _():
                        finish_block(acc, b)  # acc[...] waits for the last wgmma
                        acc[...] = jnp.zeros((64, columns(q)), jnp.float32)

            plgpu.emit_pipeline(step, grid=(blocks, steps), max_concurrent_steps=max(stages, 2 if x_spec else 1),
                                in_specs=[
                plgpu.BlockSpec((64, sub * STEP_BYTES), lambda b, t: (block_of(b) * steps + t, 0)),
                plgpu.BlockSpec((2 * sub, 256), lambda b, t: (block_of(b) * steps + t, 0)),
                plgpu.BlockSpec((columns(q), sub * tile_k), lambda b, t: (0, t), transforms=k_major, **x_spec)],
            )(c_gmem, s_gmem, x_gmem)
            if programs is None:
                plgpu.wgmma_wait(0)
                finish_block(acc, 0)

    extra = [] if residual is None else [residual.reshape(N).astype(jnp.bfloat16)]
    return kernel(xcols, codes_m, scales_m, global_scale.reshape(1).astype(jnp.float32), *extra)


def emulate_rows(xcols: np.ndarray, codes_m: np.ndarray, scales_m: np.ndarray, N: int, K: int,
                 q: int = Q, natural: bool = False) -> np.ndarray:
    """The kernel's arithmetic in NumPy, thread by thread, up to the global scale: the same byte and scale
    addresses, the same bit decode (A exact in BF16, so FP32 here), the same diagonal sums. FP32 sums in NumPy's
    order, not wgmma's. natural: natural_layout's operands and x_natural's x (then the totals carry 2^-63, which the
    layout's global scale undoes). -> [N] float64 totals, row n of program i at i * 64/q + n."""
    progs, steps = dims(N, K, q)
    r = 64 // q
    xc = np.asarray(jnp.asarray(xcols, jnp.float32))
    cm = np.asarray(codes_m).astype(np.uint32)
    sm = np.asarray(scales_m).astype(np.uint8)
    e4m3 = np.asarray(lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
                      .astype(jnp.float32)).astype(np.float64)
    out = np.zeros(N, np.float64)
    for i in range(progs):
        acc = np.zeros((64, xc.shape[0]), np.float64)
        for t in range(steps):
            a = np.zeros((64, 128))
            tile = cm[(i * steps + t) * 64:(i * steps + t + 1) * 64]
            stile = sm[(i * steps + t) * 2:(i * steps + t + 1) * 2].reshape(-1)
            for m in range(64):
                for j in range(4):
                    if not natural:
                        s_lo, s_hi = e4m3[stile[m * 8 + 2 * j]], e4m3[stile[m * 8 + 2 * j + 1]]
                    for c in range(16):
                        if natural:
                            s_lo = s_hi = e4m3[stile[m * 8 + c // 2]]
                        lo, hi = decoded_byte(int(tile[m, 16 * j + c]))
                        lo, hi = lo * 2.0 ** X_SHIFT * s_lo, hi * 2.0 ** X_SHIFT * s_hi
                        a[m, 8 * c + 2 * j], a[m, 8 * c + 2 * j + 1] = lo, hi
            acc += a @ xc[:, t * 128:(t + 1) * 128].T.astype(np.float64)
        for n in range(r):
            out[i * r + n] = sum(acc[n * q + s, s] for s in range(q))
    return out


def emulate(xcols: np.ndarray, codes_m: np.ndarray, scales_m: np.ndarray, global_scale: float, N: int,
            K: int, q: int = Q, natural: bool = False) -> np.ndarray:
    """mosaic_gemv_nvfp4 in NumPy (emulate_rows, times the global scale, rounded to BF16) -> [N] float32."""
    out = (emulate_rows(xcols, codes_m, scales_m, N, K, q, natural) * global_scale).astype(np.float32)
    return np.asarray(jnp.asarray(out).astype(jnp.bfloat16).astype(jnp.float32))


def mosaic_linear_nvfp4(x: jax.Array, w: nvfp4.NVFP4Weight, layout=None, q: int = Q, sub: int = 1,
                        **kw) -> jax.Array:
    """layers.linear for one token through the kernel; `layout` = mosaic_layout(w, q, sub) (natural=True:
    natural_layout(w, q)), precomputed."""
    N, half = w.codes.shape
    if kw.get("natural"):
        codes_m, scales_m, gs = layout if layout is not None else natural_layout(w, q)
        xb = x_natural(x, q)
    else:
        codes_m, scales_m = layout if layout is not None else mosaic_layout(w, q, sub)
        xb, gs = x_columns(x, q), w.global_scale
    return mosaic_gemv_nvfp4(xb, codes_m, scales_m, gs, N=N, K=2 * half, q=q, sub=sub, **kw)[None, :]


def parse_variant(v: str) -> dict:
    """'q16_st4_s2_ov_nd' -> mosaic_gemv_nvfp4 keywords: q K-segments, st pipeline depth, s sub-steps per pipeline
    step, ov wgmma overlap, nd no decode (a diagnostic), nat natural_layout and x_natural, p<n> n persistent
    programs, f32 FP32 output (the LM head's logits); 'res' (the residual epilogue) is main's to handle and not returned."""
    parts = v.split("_")
    kw = dict(q=int(parts[0][1:]), stages=int(parts[1][2:]), sub=1, overlap="ov" in parts, skip_decode="nd" in parts,
              natural="nat" in parts)
    if "f32" in parts:
        kw["out_f32"] = True
    for part in parts[2:]:
        if part.startswith("s") and part[1:].isdigit():
            kw["sub"] = int(part[1:])
        elif part.startswith("p") and part[1:].isdigit():
            kw["programs"] = int(part[1:])
        elif part not in ("ov", "nd", "nat", "res", "f32"):
            raise ValueError(f"variant {v!r}: unknown part {part!r}")
    return kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=49)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="q4_st4,q8_st4,q16_st4,q8_st4_ov,q16_st4_ov",
                    help="comma list of [mix_]q<K segments>_st<pipeline depth>[_s<sub>][_ov][_nd][_nat][_res][_p<n>] "
                         "(ov: wgmma_wait(1) overlap; nd: no decode, A = 0, a diagnostic; nat: x as written "
                         "(natural_layout); res: residual epilogue; p<n>: n persistent programs; f32: FP32 output; mix: odd layers run "
                         "the Triton gemv)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trace-dir", default="/tmp/probe_mosaic_nvfp4_traces")
    ap.add_argument("--lower-only", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "probe_mosaic_nvfp4.json")
    results: dict = {"layers": args.layers, "shapes": {}}
    for shape in [s for s in args.shapes.split(",") if s]:
        N, K = SHAPES[shape]
        nbytes = N * K // 2 + N * K // 16
        res = results["shapes"].setdefault(shape, {"N": N, "K": K, "weight_bytes": nbytes})
        if args.lower_only:
            w_abs = jax.eval_shape(lambda: nvfp4.random(jax.random.key(0), (N, K), 0.02))
            for v in [v for v in args.variants.split(",") if v]:
                kw = parse_variant(v.removeprefix("mix_"))
                if "_res" in v:
                    kw["residual"] = jnp.ones((N,), jnp.bfloat16)
                try:
                    with pallas_path.lowering_for_gpu():
                        text = jax.jit(functools.partial(mosaic_linear_nvfp4, **kw)).trace(
                            jax.ShapeDtypeStruct((1, K), jnp.bfloat16), w_abs).lower(
                            lowering_platforms=("cuda",)).as_text()
                except ValueError as e:
                    res[v] = {"error": str(e)}
                    print(f"[probe_mosaic_nvfp4] {shape} {v}: {e}", flush=True)
                    continue
                res[v] = {"lowered_chars": len(text)}
                print(f"[probe_mosaic_nvfp4] {shape} {v}: lowered ({len(text)} chars)", flush=True)
            continue
        make = jax.jit(lambda k: nvfp4.random(k, (N, K), 1 / np.sqrt(K)))
        ws = [make(jax.random.fold_in(jax.random.key(1), layer)) for layer in range(args.layers)]
        # a global scale that is not 1, and one negative subnormal-scaled block, in layer 0
        s0 = ws[0].scales.astype(jnp.float32).at[0, :4].set(2.0 ** -8).at[1, 3].multiply(-1)
        ws[0] = nvfp4.NVFP4Weight(ws[0].codes, s0.astype(ws[0].scales.dtype), jnp.float32(0.75))
        x = jax.random.normal(jax.random.key(2), (1, K), jnp.float32).astype(jnp.bfloat16)
        want = want_plain = np.asarray(L.linear(x, ws[0]), np.float32)
        # (prepare x once per step, per-layer call): the Mosaic kernel's x columns are built once, as the producer
        # of x would write them, not once per layer
        h = jax.random.normal(jax.random.key(4), (1, N), jnp.float32).astype(jnp.bfloat16)  # residual variants
        want_res = np.asarray((h.astype(jnp.float32) + jnp.asarray(want)).astype(jnp.bfloat16), np.float32)
        want_f32 = np.asarray(triton_gemv.ref_gemv_logits(x, ws[0]), np.float32)
        wants = {"plain": want_plain, "res": want_res, "f32": want_f32}
        variants = [v for v in args.variants.split(",") if v]
        fns = {"triton": (None, lambda x: x, lambda xp, w, lay, layer: triton_gemv.gemv(xp, w), "plain")}
        if any("_res" in v for v in variants):
            fns["triton_res"] = (None, lambda x: x, lambda xp, w, lay, layer: triton_gemv.gemv(xp, w, residual=h),
                                 "res")
        if any("_f32" in v for v in variants):  # the LM head's kernel (gemv_logits, here without its final norm)
            fns["triton_f32"] = (None, lambda x: x, lambda xp, w, lay, layer: triton_gemv.gemv_logits(xp, w), "f32")
        for v in variants:
            mix = v.startswith("mix_")  # odd layers Triton, even layers Mosaic: the two lowerings side by side
            kw = parse_variant(v.removeprefix("mix_"))
            with_res = "_res" in v
            want_kind = "res" if with_res else "f32" if kw.get("out_f32") else "plain"

            def fn(xp, w, lay, layer, kw=kw, mix=mix, with_res=with_res):
                resid = dict(residual=h) if with_res else {}
                if mix and layer % 2:
                    return triton_gemv.gemv(xp[0], w, **resid)
                gs = lay[2] if kw["natural"] else w.global_scale
                return mosaic_gemv_nvfp4(xp[1], lay[0], lay[1], gs, N=N, K=K, **kw, **resid)[None, :]
            make_x = x_natural if kw["natural"] else x_columns
            fns[v] = ((kw["q"], kw["sub"], kw["natural"]), lambda x, q=kw["q"], mk=make_x: (x, mk(x, q)), fn,
                      want_kind)
        layouts_by_q: dict = {}
        for name, (q, prep, fn, want_kind) in fns.items():
            try:
                if q not in layouts_by_q:
                    layouts_by_q.clear()  # one layout's copies at a time
                    if q is None:
                        layouts_by_q[q] = [None] * len(ws)
                    else:
                        lay_fn = functools.partial(natural_layout, q=q[0]) if q[2] else \
                            functools.partial(mosaic_layout, q=q[0], sub=q[1])
                        layouts_by_q[q] = [jax.jit(lay_fn)(w) for w in ws]
                layouts = layouts_by_q[q]
                run = jax.jit(lambda x, ws, lays, prep=prep, fn=fn: [fn(xp, w, lay, layer) for xp in [prep(x)]
                                                                     for layer, (w, lay) in enumerate(zip(ws, lays))])
                outs = run(x, ws, layouts)
                want = wants[want_kind]
                got = np.asarray(outs[0], np.float32)
                entry = {"max_abs_err": float(np.max(np.abs(got - want))), "ref_max_abs": float(np.max(np.abs(want))),
                         "mismatches_over_1ulp": int(np.sum(np.abs(got - want) > np.abs(want) * 2 ** -7 + 1e-30))}
                events = device_trace.trace_kernels(lambda: [run(x, ws, layouts) for _ in range(args.steps)][-1],
                                                    os.path.join(args.trace_dir, f"{shape}_{name}"))
                entry.update(device_trace.per_layer(events, args.steps, args.layers, nbytes))
                res[name] = entry
                print(f"[probe_mosaic_nvfp4] {shape} {name}: {entry['device_us_per_layer']} us per layer, "
                      f"err {entry['max_abs_err']} (ref max {entry['ref_max_abs']:.3g}, "
                      f"{entry['mismatches_over_1ulp']} over 1 ulp), "
                      f"kernels {[(k['name'][:30], round(k['median_us'], 2)) for k in entry['kernels']]}", flush=True)
            except Exception as e:  # noqa: BLE001  (one variant failing must not hide the others)
                res[name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
                print(f"[probe_mosaic_nvfp4] {shape} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            json.dump(results, open(path, "w"), indent=1)
        del ws
        layouts_by_q.clear()
    json.dump(results, open(path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
