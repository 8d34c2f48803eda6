"""Probe: a MoE layer's expert gate/up (6 routed experts + the shared one, SwiGLU fused, batch 1) as a Mosaic GPU
NVFP4 kernel that reads only the selected experts, against the Triton `expert_gate_up` of the decode step.

It is scripts/probe_mosaic_nvfp4.py's GEMV (hand-written decode into wgmma's A registers, x as B columns, one
column per K-segment) with two changes:

  expert selection   grid (pair p, program i); program (p, i) reads its expert id e = ids[p] from global memory and
                     its pipeline's TMA copies start at expert e's tiles of a stack laid out per expert
                     (`gate_up_layout`): ids are data, one compiled kernel serves every routing.
  gate and up        each program's 64/q A row blocks are 32/q gate rows and the same 32/q up rows (the two
                     weights interleaved by blocks before the kernel layout), so the epilogue has both halves of
                     its outputs: act[n] = bf16(bf16(silu(g)) * u), g = bf16(gate total x gate scale), u likewise
                     (layers.swiglu's rounding points).

The ids come in ready (the top-k is not in this kernel; the Triton kernel recomputes it in every program, and it
is timed both ways: `triton` recomputing, `triton_given` reading the same ids and weights).

    python scripts/probe_mosaic_moe.py --out $OUT/moe             # on the GPU: check against layers, time
    python scripts/probe_mosaic_moe.py --out /tmp/m --lower-only  # CPU: lower the kernel for CUDA

tests/test_mosaic_moe_probe.py checks the layout and the epilogue on the CPU with `emulate_gate_up` (per-thread
arithmetic in NumPy, probe_mosaic_nvfp4.emulate_rows); `inline_mgpu` has no interpreter.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flint_jax  # noqa: E402,F401  (XLA flags first)
import probe_mosaic_nvfp4 as nv  # noqa: E402
from flint_jax import device_trace, nvfp4, pallas_path, params  # noqa: E402
from flint_jax import layers as L  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.pallas_kernels import moe_experts  # noqa: E402

Q = 8


def _interleave(gate: jax.Array, up: jax.Array, half: int) -> jax.Array:
    """[I, X] gate and up rows -> [2I, X]: blocks of `half` gate rows, each followed by the same `half` up rows."""
    i, x = gate.shape
    return jnp.stack([gate.reshape(i // half, half, x), up.reshape(i // half, half, x)], 1).reshape(2 * i, x)


def gate_up_layout(moe: params.MoE, q: int = Q, natural: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's operands from an NVFP4 MoE (what a converter would write): the routed experts' gate and up, and
    the shared expert's as expert E, each expert's [2I, K] interleaved weight in probe_mosaic_nvfp4's layout.
    natural: probe_mosaic_nvfp4.natural_layout (x as written; the global scales then carry 2^63).
    -> (codes [(E+1) * rows, 64], scales [(E+1) * rows / 32, 256] uint8, global scales [(E+1) * 2] f32 (gate, up))."""
    gate, up = moe.gate, moe.up
    if not isinstance(gate, nvfp4.NVFP4Weight) or moe.shared_gate is None:
        raise ValueError("gate_up_layout needs NVFP4 experts and a shared expert")
    half = 32 // q
    codes = jnp.concatenate([gate.codes, moe.shared_gate.codes[None]]), \
        jnp.concatenate([up.codes, moe.shared_up.codes[None]])
    scales = jnp.concatenate([gate.scales, moe.shared_gate.scales[None]]), \
        jnp.concatenate([up.scales, moe.shared_up.scales[None]])
    if codes[0].shape[1] % half:
        raise ValueError(f"expert intermediate {codes[0].shape[1]} does not split into blocks of {half} (q={q})")

    def one(gc, uc, gs, us):
        w = nvfp4.NVFP4Weight(_interleave(gc, uc, half), _interleave(gs, us, half), jnp.float32(1))
        return nv.natural_layout(w, q)[:2] if natural else nv.mosaic_layout(w, q)

    cm, sm = jax.vmap(one)(*codes, *scales)
    gs = jnp.stack([jnp.concatenate([gate.global_scale, moe.shared_gate.global_scale.reshape(1)]),
                    jnp.concatenate([up.global_scale, moe.shared_up.global_scale.reshape(1)])], 1)
    gs = gs.reshape(-1).astype(jnp.float32) * (2.0 ** nv.X_SHIFT if natural else 1.0)
    return cm.reshape(-1, cm.shape[-1]), sm.reshape(-1, sm.shape[-1]), gs


def pair_ids(ids: jax.Array, experts: int) -> jax.Array:
    """One token's top-k ids [k] -> the kernel's pairs [k + 1]: the routed experts, then the shared one (id E)."""
    return jnp.concatenate([ids.reshape(-1).astype(jnp.int32), jnp.full((1,), experts, jnp.int32)])


def _finish_swiglu(ctx, acc, red_ref, gs_ref, o_ref, *, q: int):
    """inline_mgpu body: the program's 32/q activations act[n] = bf16(bf16(silu(g)) * u) from A rows n (gate) and
    n + 32/q (up): g = bf16(total x gate scale), u = bf16(total x up scale); silu(g) = g / (1 + exp(-g)) in FP32."""
    del ctx
    from jax._src.lib.mlir import ir  # noqa: PLC0415  (GPU lowering only)
    from jax._src.lib.mlir.dialects import arith, memref  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import math as mlir_math  # noqa: PLC0415
    from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

    f32, bf16 = ir.F32Type.get(), ir.BF16Type.get()
    half = 32 // q
    ci, idx, tid = nv.store_diagonal(acc, red_ref, q=q)
    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, tid, ci(half))):
        g = arith.truncf(bf16, arith.mulf(nv.row_total(red_ref, tid, q=q), memref.load(gs_ref, [idx(ci(0))])))
        u = arith.truncf(bf16, arith.mulf(nv.row_total(red_ref, arith.addi(tid, ci(half)), q=q),
                                          memref.load(gs_ref, [idx(ci(1))])))
        gf = arith.extf(f32, g)
        one = arith.constant(f32, 1.0)
        silu = arith.divf(gf, arith.addf(one, mlir_math.exp(arith.negf(gf))))
        act = arith.mulf(arith.extf(f32, arith.truncf(bf16, silu)), arith.extf(f32, u))
        memref.store(arith.truncf(bf16, act), o_ref, [idx(tid)])


KP = 8  # routing outputs' width: k = 6 slots rounded up to a power of two (moe_experts' layout), the rest zero


def top_k_round(score: jax.Array, iota: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One round of the top-k: the first index of the largest score (ties to the lower id, as lax.top_k), and the
    scores with it removed. Array ops that lower in a Mosaic GPU kernel and run in plain JAX alike."""
    top = jnp.max(score)
    pick = jnp.min(jnp.where(score == top, iota, score.shape[0]))
    return pick, jnp.where(iota == pick, -jnp.inf, score)


def routing_weights(sig: jax.Array, iota: jax.Array, ids, norm: bool, scaling: float) -> list:
    """The selected experts' unbiased scores, normalised to sum 1 when norm (summed in slot order), times scaling."""
    vals = [jnp.sum(jnp.where(iota == pick, sig, 0.0)) for pick in ids]
    total = functools.reduce(lambda x, y: x + y, vals)
    return [(v / total if norm else v) * scaling for v in vals]


def select_top_k(logits: jax.Array, bias: jax.Array, k: int, norm: bool, scaling: float):
    """One token's routing from the kernel's pieces (top_k_round k times over sigmoid(logits) + bias,
    routing_weights), unrolled. -> (ids: k int32 scalars, weights(): k f32 scalars, computed where called)."""
    sig = jax.nn.sigmoid(logits)
    score = sig + bias
    iota = lax.broadcasted_iota(jnp.int32, score.shape, 0)
    ids = []
    for _ in range(k):
        pick, score = top_k_round(score, iota)
        ids.append(pick)
    return ids, lambda: routing_weights(sig, iota, ids, norm, scaling)


def mosaic_gate_up(xcols: jax.Array, experts, codes_m: jax.Array, scales_m: jax.Array, gs: jax.Array, *,
                   inter: int, K: int, q: int = Q, stages: int = 4, overlap: bool = True,
                   natural: bool = False, route: dict | None = None):
    """SwiGLU activations [pairs, inter] BF16 for one token's x columns (probe_mosaic_nvfp4.x_columns(b, q);
    natural: x_natural(b, q)), from gate_up_layout's operands (the same natural).
    experts: the pairs' expert ids [pairs] (int32, < E + 1; E the shared expert); or, with route=dict(k, norm,
    scaling), the token's (logits [E] f32, bias [E] f32): the programs select the experts themselves (expert_of),
    pairs = k + 1 (the last the shared expert), and the call returns (act, ids [KP] int32, weights [KP] f32), the
    routing for the down kernel."""
    progs, steps = nv.dims(2 * inter, K, q)
    n_experts = codes_m.shape[0] // (progs * steps * 64) - 1
    pairs = route["k"] + 1 if route else experts.shape[0]
    if route and n_experts % 128:
        raise ValueError(f"in-kernel routing over {n_experts} experts: Mosaic GPU lays a [E] vector over the 128 "
                         "threads of a warpgroup, so E must be a multiple of 128")
    half, tile_k = 32 // q, 2 * nv.STEP_BYTES
    swizzle = plgpu.find_swizzle(tile_k * 16)
    k_major = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    decode = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                               return_type=plgpu.ShapeDtypeStruct((64, tile_k), jnp.bfloat16,
                                                                  layout=plgpu.Layout.WGMMA))(
        functools.partial(nv.decode_tile, natural=natural))
    finish = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType(),
                                          plgpu.RefType()))(functools.partial(_finish_swiglu, q=q))
    x_spec = dict(delay_release=1) if overlap and steps > 1 else {}
    out_type = [jax.ShapeDtypeStruct((pairs * inter,), jnp.bfloat16)]
    scratch = [plgpu.SMEM((64,), jnp.float32)]
    if route:
        out_type += [jax.ShapeDtypeStruct((KP,), jnp.int32), jax.ShapeDtypeStruct((KP,), jnp.float32)]
        scratch += [plgpu.SMEM((n_experts,), jnp.float32), plgpu.SMEM((n_experts,), jnp.float32),
                    plgpu.SMEM((KP,), jnp.int32), plgpu.Barrier(num_arrivals=2)]

    def expert_of(p, e_refs, ids_out, w_out, lg_smem, b_smem, ids_smem, bar):
        """Pair p's expert id. With route: p + 1 rounds of top_k_round for routed pair p (its slot's expert is the
        last pick), none for the shared pair; the program of pair k - 1 and block 0, which has all k picks, writes
        the routing."""
        if not route:
            return e_refs[0][p]
        k = route["k"]
        plgpu.copy_gmem_to_smem(e_refs[0], lg_smem, bar)
        plgpu.copy_gmem_to_smem(e_refs[1], b_smem, bar)
        plgpu.barrier_wait(bar)
        sig = jax.nn.sigmoid(lg_smem[...])
        iota = lax.broadcasted_iota(jnp.int32, (n_experts,), 0)

        def one_round(r, carry):
            pick, score = top_k_round(carry[1], iota)
            ids_smem[r] = pick
            return pick, score

        pick, _ = lax.fori_loop(0, jnp.where(p < k, p + 1, 0), one_round, (jnp.int32(0), sig + b_smem[...]))

        @pl.when((p == k - 1) & (lax.axis_index("i") == 0))
        def _():
            ids = [ids_smem[s] for s in range(k)]
            for s, (e, w) in enumerate(zip(ids, routing_weights(sig, iota, ids, route["norm"], route["scaling"]))):
                ids_out[s] = e
                w_out[s] = w
            for s in range(k, KP):
                ids_out[s] = jnp.int32(0)
                w_out[s] = jnp.float32(0)

        return jnp.where(p < k, pick, jnp.int32(n_experts))

    @functools.partial(plgpu.kernel, out_type=out_type, grid=(pairs, progs), grid_names=("p", "i"),
                       scratch_types=scratch)
    def kernel(*refs):
        n_in = 2 if route else 1
        e_refs, (x_gmem, c_gmem, s_gmem, gs_gmem, o_gmem) = refs[:n_in], refs[n_in:n_in + 5]
        ids_out, w_out, red_smem, *route_scratch = refs[n_in + 5:] if route else (None, None, *refs[n_in + 5:])
        p, i = lax.axis_index("p"), lax.axis_index("i")
        e = expert_of(p, e_refs, ids_out, w_out, *(route_scratch or [None] * 4))
        first = (e * progs + i) * steps  # expert e's program i's first pipeline step in the stacked layout

        @functools.partial(pl.run_scoped, acc=plgpu.ACC((64, nv.columns(q)), jnp.float32))
        def _(acc):
            def step(_, c_smem, s_smem, x_smem):
                plgpu.wgmma(acc, decode(c_smem, s_smem), x_smem.transpose((1, 0)))
                plgpu.wgmma_wait(1 if overlap else 0)

            plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=max(stages, 2 if x_spec else 1),
                                in_specs=[
                plgpu.BlockSpec((64, nv.STEP_BYTES), lambda t: (first + t, 0)),
                plgpu.BlockSpec((2, 256), lambda t: (first + t, 0)),
                plgpu.BlockSpec((nv.columns(q), tile_k), lambda t: (0, t), transforms=k_major, **x_spec)],
            )(c_gmem, s_gmem, x_gmem)
            plgpu.wgmma_wait(0)
            finish(acc[...], red_smem, gs_gmem.at[pl.ds(2 * e, 2)], o_gmem.at[pl.ds(p * inter + i * half, half)])

    if route:
        logits, bias = experts
        act, ids, ws = kernel(logits.reshape(-1).astype(jnp.float32), bias.reshape(-1).astype(jnp.float32), xcols,
                              codes_m, scales_m, gs)
        return act.reshape(pairs, inter), ids, ws
    return kernel(experts.astype(jnp.int32), xcols, codes_m, scales_m, gs)[0].reshape(pairs, inter)


def emulate_gate_up(xcols, ids, codes_m, scales_m, gs, *, inter: int, K: int, q: int = Q,
                    natural: bool = False) -> np.ndarray:
    """mosaic_gate_up in NumPy: per pair, probe_mosaic_nvfp4.emulate_rows on the expert's tiles, then the
    epilogue's scales, roundings and SwiGLU. -> [pairs, inter] float32 (BF16 values)."""
    progs, steps = nv.dims(2 * inter, K, q)
    half = 32 // q
    rows, srows = progs * steps * 64, progs * steps * 2
    cm, sm, g = np.asarray(codes_m), np.asarray(scales_m), np.asarray(gs, np.float32)
    out = []
    for e in np.asarray(ids).tolist():
        tot = nv.emulate_rows(xcols, cm[e * rows:(e + 1) * rows], sm[e * srows:(e + 1) * srows], 2 * inter, K, q,
                              natural)
        tot = tot.reshape(progs, 2, half).astype(np.float32)
        gate = jnp.asarray(tot[:, 0].reshape(-1) * g[2 * e]).astype(jnp.bfloat16)
        up = jnp.asarray(tot[:, 1].reshape(-1) * g[2 * e + 1]).astype(jnp.bfloat16)
        out.append(np.asarray(L.swiglu(gate, up), np.float32))
    return np.stack(out)


def ref_gate_up(b: jax.Array, ids, moe: params.MoE) -> np.ndarray:
    """The activations from flint_jax.layers, pair by pair (id E: the shared expert). b [1, H] -> [pairs, I]."""
    E = moe.gate.codes.shape[0]
    out = []
    for e in np.asarray(ids).tolist():
        if e == E:
            g, u = moe.shared_gate, moe.shared_up
        else:
            g, u = (nvfp4.NVFP4Weight(w.codes[e], w.scales[e], w.global_scale[e]) for w in (moe.gate, moe.up))
        out.append(np.asarray(L.swiglu(L.linear(b, g), L.linear(b, u)), np.float32)[0])
    return np.stack(out)


def synthetic_moe(key: jax.Array, experts: int, hidden: int, inter: int) -> params.MoE:
    """An NVFP4 MoE layer with random weights, per-expert global scales != 1 and a shared expert."""
    ks = jax.random.split(key, 8)
    std = 1 / np.sqrt(hidden)

    def stacked(k, shape):
        w = nvfp4.random(k, shape, std)
        return nvfp4.NVFP4Weight(w.codes, w.scales, jnp.linspace(0.5, 1.5, shape[0], dtype=jnp.float32))

    return params.MoE(router=jax.random.normal(ks[0], (experts, hidden), jnp.float32) * std,
                      router_bias=jax.random.normal(ks[1], (experts,), jnp.float32) * 0.1,
                      gate=stacked(ks[2], (experts, inter, hidden)), up=stacked(ks[3], (experts, inter, hidden)),
                      down=stacked(ks[4], (experts, hidden, inter)),
                      shared_gate=nvfp4.random(ks[5], (inter, hidden), std),
                      shared_up=nvfp4.random(ks[6], (inter, hidden), std),
                      shared_down=nvfp4.random(ks[7], (hidden, inter), std))


def _x_for(kw: dict):
    """The x operand's builder for a variant: x_natural (a free reshape) or x_columns (a copy)."""
    return nv.x_natural if kw["natural"] else nv.x_columns


def route_of(cfg: FlintConfig) -> dict:
    """mosaic_gate_up's route argument for a config's routing."""
    return dict(k=cfg.num_experts_per_tok, norm=bool(cfg.norm_topk_prob), scaling=float(cfg.routed_scaling_factor))


def parse_variant(v: str) -> dict:
    """'q8_st4_ov_nat_rt' -> mosaic_gate_up keywords (q K-segments, st pipeline depth, ov wgmma overlap, nat x as
    written) and rt: the kernel selects the experts from the logits (else the ids come in)."""
    kw = nv.parse_variant(v.replace("_rt", ""))
    if kw.pop("sub") != 1 or kw.pop("skip_decode"):
        raise ValueError(f"variant {v!r}: sub-steps and nd are GEMV-probe diagnostics, not offered here")
    kw["routed"] = "_rt" in v
    return kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=47, help="MoE layers, each its own weights (Flint: 47)")
    ap.add_argument("--experts", type=int, default=256,
                    help="routed experts per layer (Flint: 256; the in-kernel top-k needs a multiple of 128)")
    ap.add_argument("--variants", default="q8_st4,q8_st4_nat,q8_st4_rt,q8_st4_nat_rt")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trace-dir", default="/tmp/probe_mosaic_moe_traces")
    ap.add_argument("--lower-only", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "probe_mosaic_moe.json")
    cfg = FlintConfig.flint(n_routed_experts=args.experts)
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    nbytes = (k + 1) * 2 * I * (H // 2 + H // 16)
    results: dict = {"layers": args.layers, "experts": args.experts, "weight_bytes_per_layer": nbytes, "variants": {}}
    variants = [v for v in args.variants.split(",") if v]
    if args.lower_only:
        moe_abs = jax.eval_shape(lambda: synthetic_moe(jax.random.key(0), args.experts, H, I))
        for v in variants:
            kw = parse_variant(v)

            def fn(b, ids, moe, kw=kw):
                lay = gate_up_layout(moe, kw["q"], kw["natural"])
                experts, route = pair_ids(ids, args.experts), None
                if kw["routed"]:
                    experts, route = (moe.router[:, 0], moe.router_bias), route_of(cfg)
                return mosaic_gate_up(_x_for(kw)(b, kw["q"]), experts, *lay, inter=I, K=H, route=route,
                                      **{a: c for a, c in kw.items() if a != "routed"})
            with pallas_path.lowering_for_gpu():
                text = jax.jit(fn).trace(jax.ShapeDtypeStruct((1, H), jnp.bfloat16),
                                         jax.ShapeDtypeStruct((k,), jnp.int32), moe_abs).lower(
                    lowering_platforms=("cuda",)).as_text()
            results["variants"][v] = {"lowered_chars": len(text)}
            print(f"[probe_mosaic_moe] {v}: lowered ({len(text)} chars)", flush=True)
        json.dump(results, open(path, "w"), indent=1)
        return 0

    print(f"[probe_mosaic_moe] {args.layers} layers of {args.experts} experts ...", flush=True)
    make = jax.jit(lambda key: synthetic_moe(key, args.experts, H, I))
    moes = [make(jax.random.fold_in(jax.random.key(1), layer)) for layer in range(args.layers)]
    b = jax.random.normal(jax.random.key(2), (1, H), jnp.float32).astype(jnp.bfloat16)
    logits = [jax.random.normal(jax.random.fold_in(jax.random.key(3), layer), (1, args.experts), jnp.float32)
              for layer in range(args.layers)]
    routes = [L.route_from_logits(lg, m.router_bias, cfg) for lg, m in zip(logits, moes)]  # (ids [1, k], weights [1, k])
    kp = 8
    given = [(jnp.zeros((1, kp), jnp.int32).at[:, :k].set(ids), jnp.zeros((1, kp), jnp.float32).at[:, :k].set(w))
             for ids, w in routes]
    pairs = [pair_ids(ids, args.experts) for ids, _ in routes]
    want = ref_gate_up(b, pairs[0], moes[0])
    results["ids_layer0"] = np.asarray(pairs[0]).tolist()

    def record(name, run, inputs):
        try:
            outs = jax.jit(run)(*inputs)
            first = outs[0]
            routing = {}
            if isinstance(first, (tuple, list)):  # (act, ids, weights): the kernel's routing against layers'
                first, ids, ws = first
                routing = {"ids_equal": bool(np.array_equal(np.asarray(ids), np.asarray(given[0][0][0]))),
                           "weights_max_rel_err": float(np.max(np.abs(np.asarray(ws) - np.asarray(given[0][1][0]))
                                                               / np.maximum(np.abs(np.asarray(given[0][1][0])),
                                                                            1e-30)))}
            got = np.asarray(first, np.float32)
            entry = {**routing, "max_abs_err": float(np.max(np.abs(got - want))), "ref_max_abs": float(np.max(np.abs(want))),
                     "mismatches_over_1ulp": int(np.sum(np.abs(got - want) > np.abs(want) * 2 ** -7 + 1e-30)),
                     "exact_fraction": float(np.mean(got == want))}
            f = jax.jit(run)
            events = device_trace.trace_kernels(lambda: [f(*inputs) for _ in range(args.steps)][-1],
                                                os.path.join(args.trace_dir, name))
            entry.update(device_trace.per_layer(events, args.steps, args.layers, nbytes))
            if routing and not routing["ids_equal"]:
                entry["error"] = f"routing differs from layers.route_from_logits: {routing}"
        except Exception as e:  # noqa: BLE001  (one variant failing must not hide the others)
            entry = {"error": f"{type(e).__name__}: {e}"[:3000]}
        results["variants"][name] = entry
        print(f"[probe_mosaic_moe] {name}: " + (f"FAILED {entry['error'][:2000]}" if "error" in entry else
              f"{entry['device_us_per_layer']} us per layer, err {entry['max_abs_err']} (ref max "
              f"{entry['ref_max_abs']:.3g}, {entry['mismatches_over_1ulp']} over 1 ulp, exact "
              f"{entry['exact_fraction']:.3f}), kernels "
              f"{[(x['name'][:30], round(x['median_us'], 2)) for x in entry['kernels']]}"), flush=True)
        json.dump(results, open(path, "w"), indent=1)

    # as in the step: the top-k in every program, and the routing written for the down kernel (ROUTING_TO_DOWN)
    record("triton", lambda b, lg, ms: [
        (lambda a, ids, ws: (a[:k + 1], ids[0], ws[0]))(*moe_experts.expert_gate_up(b, lg[i], ms[i], cfg,
                                                                                     emit_routing=True))
        for i in range(args.layers)], (b, logits, moes))
    record("triton_given", lambda b, gv, ms: [moe_experts.expert_gate_up(b, None, ms[i], cfg, routing=gv[i])[:k + 1]
                                              for i in range(args.layers)], (b, given, moes))
    for q, nat in sorted({(parse_variant(v)["q"], parse_variant(v)["natural"]) for v in variants}):
        layouts = [jax.jit(functools.partial(gate_up_layout, q=q, natural=nat))(m) for m in moes]
        for v in [v for v in variants if (parse_variant(v)["q"], parse_variant(v)["natural"]) == (q, nat)]:
            kw = parse_variant(v)
            kern = {a: c for a, c in kw.items() if a != "routed"}
            if kw["routed"]:
                record(v, lambda b, lg, ms, lays, kern=kern: [
                    mosaic_gate_up(xc, (lg[i][0], ms[i].router_bias), *lays[i], inter=I, K=H, route=route_of(cfg),
                                   **kern)
                    for xc in [_x_for(kw)(b, kw["q"])] for i in range(args.layers)], (b, logits, moes, layouts))
            else:
                record(v, lambda b, ps, lays, kern=kern: [
                    mosaic_gate_up(xc, ps[i], *lays[i], inter=I, K=H, **kern)
                    for xc in [_x_for(kw)(b, kw["q"])] for i in range(args.layers)], (b, pairs, layouts))
        del layouts
    json.dump(results, open(path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
