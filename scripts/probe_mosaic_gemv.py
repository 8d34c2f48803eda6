"""Probe: a BF16 decode GEMV as a Mosaic GPU kernel (TMA + wgmma, swap-AB) against today's Triton `gemv`.

Follow-up of scripts/probe_pdl.py (run W, docs/BENCHMARKS.md), where one TMA copy per program streamed weights at
twice the rate of the Triton lowering's pointer loads. Here the real operation, y = x @ W.T for one token:

  mosaic   the weight tile is the wgmma's left operand (64 rows of W x tile_k, TMA'd into swizzled shared memory by
           plgpu.emit_pipeline), x the right one (the batch padded to 16 rows, K-major, transposed as a ref); the
           [64, 16] FP32 accumulator is one program's slice of y. K is split over `splits` programs so that a small N
           still fills the GPU; the partial sums [splits, N, 16] are added by XLA (`mosaic+sum`), which in a port
           the next kernel's prologue would do.
  triton   pallas_kernels.gemv.gemv (the decode path's kernel, its block table).

Each case runs --layers distinct weight matrices (more bytes than L2 holds) in one jitted program, as the 49
layers of a decode step do; device time per kernel from the profiler trace, and the check against x @ W.T.

    python scripts/probe_mosaic_gemv.py --out $OUT/gemv          # on the GPU
    python scripts/probe_mosaic_gemv.py --out /tmp/g --lower-only  # CPU: lower the Mosaic kernels for CUDA
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flint_jax  # noqa: E402,F401  (XLA flags first)
from flint_jax import device_trace, nvfp4, pallas_path  # noqa: E402
from flint_jax import layers as L  # noqa: E402
from flint_jax.pallas_kernels import gemv as triton_gemv  # noqa: E402

BATCH_PAD = 16  # wgmma's N for the activations: the smallest that takes a 32-byte swizzle in BF16
ROWS = 64  # wgmma's M: weight rows per program
SHAPES = {"o_proj": (2048, 4096), "qkv": (5120, 2048)}  # (N, K) of Flint's BF16 attention projections


def mosaic_gemv(x_pad: jax.Array, w: jax.Array, *, splits: int, tile_k: int = 128, stages: int = 4) -> jax.Array:
    """x_pad [16, K] BF16 (rows past the batch are zero), w [N, K] BF16 -> partial sums [splits, N, 16] FP32."""
    N, K = w.shape
    if N % ROWS or K % (splits * tile_k):
        raise ValueError(f"w [{N}, {K}] must tile into {ROWS} rows and {splits} x {tile_k} K values")
    steps = K // splits // tile_k
    swizzle = plgpu.find_swizzle(tile_k * 16)
    k_major = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    out_tiles = (plgpu.TilingTransform((8, BATCH_PAD)), plgpu.SwizzleTransform(BATCH_PAD * 4))

    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((splits, N, BATCH_PAD), jnp.float32),
                       grid=(N // ROWS, splits), grid_names=("i", "s"),
                       scratch_types=[plgpu.SMEM((ROWS, BATCH_PAD), jnp.float32, transforms=out_tiles)])
    def kernel(x_gmem, w_gmem, o_gmem, o_smem):
        i, s = lax.axis_index("i"), lax.axis_index("s")

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((ROWS, BATCH_PAD), jnp.float32))
        def _(acc):
            def step(_, w_smem, x_smem):
                plgpu.wgmma(acc, w_smem, x_smem.transpose((1, 0)))
                plgpu.wgmma_wait(1)

            plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=stages, in_specs=[
                plgpu.BlockSpec((ROWS, tile_k), lambda k: (i, s * steps + k), transforms=k_major),
                plgpu.BlockSpec((BATCH_PAD, tile_k), lambda k: (0, s * steps + k), transforms=k_major)],
            )(w_gmem, x_gmem)
            plgpu.wgmma_wait(0)
            o_smem[...] = acc[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, pl.ds(i * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    return kernel(x_pad, w)


NVFP4_STEP = 256  # code bytes per pipeline step: 256 values of each K half, 16 scale groups each


def block_diagonal_x(x: jax.Array) -> jax.Array:
    """x [1, K] -> XB [16, K] BF16 with XB[g, k] = x[k] where (k % 256) // 16 == g, else 0: against it, a weight
    tile's products land in one accumulator column per 16-value scale group."""
    K = x.shape[-1]
    g = (jnp.arange(K) % NVFP4_STEP) // 16
    return jnp.where(g[None, :] == jnp.arange(16)[:, None], x.reshape(1, K).astype(jnp.bfloat16), 0)


def _e2m1_times_2(nib):
    """4-bit E2M1 codes (int32) -> 2 x their value, as int32 (exact: 0, +-1, 2, 3, 4, 6, 8, 12)."""
    mag = nib & 7
    v = jnp.where(mag < 4, mag, (2 + (mag & 1)) << ((mag >> 1) - 1))
    return jnp.where((nib & 8) != 0, -v, v)


def _e4m3(b):
    """E4M3 bytes (int32) -> FP32 values (normal: exponent and mantissa moved into FP32 bits; subnormal: m x 2^-9)."""
    e, m = (b >> 3) & 15, b & 7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    value = jnp.where(e == 0, m.astype(jnp.float32) * 2.0 ** -9, normal)
    return jnp.where((b & 0x80) != 0, -value, value)


def mosaic_gemv_nvfp4(xb: jax.Array, codes: jax.Array, scales: jax.Array, *, splits: int, stages: int = 2,
                      interpret=None, a_in_smem: bool | None = None) -> jax.Array:
    """Batch-1 NVFP4 GEMV without the global scale: xb [16, K] (block_diagonal_x), codes uint8 [N, K/2] (planar
    halves), scale bytes uint8 [N, K/16] -> partial sums [splits, N] FP32. Each step decodes a [64, 256] code tile
    into two BF16 tiles (low and high nibbles) in registers, multiplies each by its [256, 16] slice of XB on the
    tensor cores (a fresh accumulator: one column per scale group), and adds sum_g scale[n, g] * P[n, g] / 2.
    a_in_smem: pass the decoded tile to wgmma through shared memory instead of registers (the Mosaic GPU
    interpreter's wgmma takes only refs; default: on in interpret mode)."""
    a_in_smem = interpret is not None if a_in_smem is None else a_in_smem
    N, half = codes.shape
    K = 2 * half
    if N % ROWS or half % (splits * NVFP4_STEP):
        raise ValueError(f"codes [{N}, {half}] must tile into {ROWS} rows and {splits} x {NVFP4_STEP} bytes")
    steps = half // splits // NVFP4_STEP
    hg = half // 16  # first scale group of the high half
    sw = plgpu.find_swizzle(NVFP4_STEP * 8)
    code_tiles = (plgpu.TilingTransform((8, sw)), plgpu.SwizzleTransform(sw))
    swx = plgpu.find_swizzle(NVFP4_STEP * 16)
    x_tiles = (plgpu.TilingTransform((8, swx // 2)), plgpu.SwizzleTransform(swx))
    G = NVFP4_STEP // 16

    @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct((splits, N), jnp.float32),
                       grid=(N // ROWS, splits), grid_names=("i", "s"),
                       scratch_types=[plgpu.SMEM((ROWS,), jnp.float32),
                                      plgpu.SMEM((ROWS, NVFP4_STEP), jnp.bfloat16, transforms=x_tiles)],
                       interpret=interpret)
    def kernel(xb_gmem, c_gmem, s_gmem, o_gmem, o_smem, a_smem):
        i, s = lax.axis_index("i"), lax.axis_index("s")

        def step(_, c_smem, slo_smem, shi_smem, xlo_smem, xhi_smem, y):
            c = c_smem[...].astype(jnp.int32)
            parts = []
            for nib, x_smem, s_smem in ((c & 15, xlo_smem, slo_smem), (c >> 4, xhi_smem, shi_smem)):
                w = _e2m1_times_2(nib).astype(jnp.float32).astype(jnp.bfloat16)

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((ROWS, G), jnp.float32))
                def per_group(acc):
                    a = w
                    if a_in_smem:
                        a_smem[...] = w
                        plgpu.commit_smem()
                        a = a_smem
                    plgpu.wgmma(acc, a, x_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc[...]
                parts.append(per_group * _e4m3(s_smem[...].astype(jnp.int32)))
            return y + jnp.sum(parts[0] + parts[1], axis=1) * 0.5

        y = plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=stages, in_specs=[
            plgpu.BlockSpec((ROWS, NVFP4_STEP), lambda k: (i, s * steps + k), transforms=code_tiles),
            plgpu.BlockSpec((ROWS, G), lambda k: (i, s * steps + k)),
            plgpu.BlockSpec((ROWS, G), lambda k: (i, hg // G + s * steps + k)),
            plgpu.BlockSpec((G, NVFP4_STEP), lambda k: (0, s * steps + k), transforms=x_tiles),
            plgpu.BlockSpec((G, NVFP4_STEP), lambda k: (0, (half // NVFP4_STEP) + s * steps + k),
                            transforms=x_tiles)],
            init_carry=jnp.zeros((ROWS,), jnp.float32))(c_gmem, s_gmem, s_gmem, xb_gmem, xb_gmem)
        o_smem[...] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, pl.ds(i * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    return kernel(xb, codes, scales)


def mosaic_linear_nvfp4(x: jax.Array, w, *, splits: int, reduce: bool = True, interpret=None) -> jax.Array:
    """layers.linear for one token on an NVFP4Weight through mosaic_gemv_nvfp4 (+ the XLA sum of the splits)."""
    scales = lax.bitcast_convert_type(w.scales, jnp.uint8)
    parts = mosaic_gemv_nvfp4(block_diagonal_x(x), w.codes, scales, splits=splits, interpret=interpret)
    if not reduce:
        return parts
    return (parts.sum(axis=0) * w.global_scale)[None, :].astype(jnp.bfloat16)


def mosaic_linear(x: jax.Array, w: jax.Array, *, splits: int, reduce: bool = True) -> jax.Array:
    """x [M, K] (M <= 16) -> [M, N] BF16 through mosaic_gemv and an XLA sum of the splits (or the raw partials)."""
    M = x.shape[0]
    x_pad = jnp.zeros((BATCH_PAD, x.shape[1]), jnp.bfloat16).at[:M].set(x.astype(jnp.bfloat16))
    parts = mosaic_gemv(x_pad, w, splits=splits)
    if not reduce:
        return parts
    return parts.sum(axis=0)[:, :M].T.astype(jnp.bfloat16)


def variants(splits_list, kind: str):
    out = {"triton": lambda x, w: triton_gemv.gemv(x, w)}
    linear = mosaic_linear if kind == "bf16" else mosaic_linear_nvfp4
    for s in splits_list:
        out[f"mosaic_s{s}"] = functools.partial(linear, splits=s, reduce=False)
        out[f"mosaic_s{s}+sum"] = functools.partial(linear, splits=s)
    return out


def make_weight(key, N: int, K: int, kind: str):
    if kind == "bf16":
        return (jax.random.normal(key, (N, K), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    return nvfp4.random(key, (N, K), 1 / np.sqrt(K))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=49)
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--weights", default="bf16", help="comma list of bf16, nvfp4")
    ap.add_argument("--variants", default="", help="comma list of variant names to run (default: all)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trace-dir", default="/tmp/probe_mosaic_gemv_traces")
    ap.add_argument("--lower-only", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    splits_list = [int(s) for s in args.splits.split(",") if s]
    results: dict = {"layers": args.layers, "shapes": {}}
    path = os.path.join(args.out, "probe_mosaic_gemv.json")
    wanted = {v for v in args.variants.split(",") if v}
    for kind, shape in [(k, s) for k in args.weights.split(",") if k for s in args.shapes.split(",") if s]:
        N, K = SHAPES[shape]
        nbytes = N * K * 2 if kind == "bf16" else N * K // 2 + N * K // 16
        res = results["shapes"].setdefault(f"{shape} {kind}", {"N": N, "K": K, "weight_bytes": nbytes})
        if args.lower_only:
            w_abs = jax.eval_shape(lambda: make_weight(jax.random.key(0), N, K, kind))
            linear = mosaic_linear if kind == "bf16" else mosaic_linear_nvfp4
            for s in splits_list:
                with pallas_path.lowering_for_gpu():
                    text = jax.jit(functools.partial(linear, splits=s)).trace(
                        jax.ShapeDtypeStruct((1, K), jnp.bfloat16), w_abs).lower(
                        lowering_platforms=("cuda",)).as_text()
                res[f"mosaic_s{s}"] = {"lowered_chars": len(text)}
                print(f"[probe_mosaic_gemv] {shape} {kind} splits {s}: lowered", flush=True)
            continue
        key = jax.random.key(1)
        make = jax.jit(functools.partial(make_weight, N=N, K=K, kind=kind))
        ws = [make(jax.random.fold_in(key, l)) for l in range(args.layers)]
        x = jax.random.normal(jax.random.key(2), (1, K), jnp.float32).astype(jnp.bfloat16)
        want = np.asarray(L.linear(x, ws[0]), np.float32)
        for name, fn in variants(splits_list, kind).items():
            if wanted and name not in wanted:
                continue
            try:
                run = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
                outs = run(x, ws)
                entry = {}
                if not name.startswith("mosaic") or name.endswith("+sum"):
                    got = np.asarray(outs[0], np.float32)
                    entry["max_abs_err"] = float(np.max(np.abs(got - want)))
                    entry["ref_max_abs"] = float(np.max(np.abs(want)))
                events = device_trace.trace_kernels(lambda: [run(x, ws) for _ in range(args.steps)][-1],
                                                    os.path.join(args.trace_dir, f"{shape}_{name}"))
                entry.update(device_trace.per_layer(events, args.steps, args.layers, nbytes))
                res[name] = entry
                print(f"[probe_mosaic_gemv] {shape} {kind} {name}: {entry.get('device_us_per_layer')} us per layer, "
                      f"{entry['kernels_per_layer']:.1f} kernels per layer, err {entry.get('max_abs_err')}, "
                      f"kernels {[(k['name'][:30], round(k['median_us'], 2)) for k in entry['kernels']]}", flush=True)
            except Exception as e:  # noqa: BLE001  (one variant failing must not hide the others)
                res[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                print(f"[probe_mosaic_gemv] {shape} {kind} {name}: FAILED {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
            json.dump(results, open(path, "w"), indent=1)
        del ws
    json.dump(results, open(path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
