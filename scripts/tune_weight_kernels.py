"""Device time of each weight-streaming decode kernel at Flint's shapes over a grid of block settings: the
measurement behind the block tables (gemv.TABLE_*, attention_prologue.QKV_BLOCK, moe_experts.*_BLOCK).

Each (kernel, setting) is jitted as one program that runs the kernel once per layer of a Flint-width model with
`--layers` distinct layers (24 by default: 140 MB of NVFP4 attention weights and 24 different routings, so more
than the H200's 60 MB L2), run three times under the profiler; the figure is the median duration of the kernel's
launches in the trace (GPU time only: no launch gaps, no host). GB/s counts the bytes the kernel must read (weights,
plus the routed experts' for the MoE kernels). GPU only (on a CPU the kernels would run in interpret mode).

    python scripts/tune_weight_kernels.py --out /tmp/tune [--cases qkv,o,gate_up,down,router,lm_head] [--budget-s 200]
    python scripts/tune_weight_kernels.py --out /tmp/tune --weights bf16 --cases qkv,o,gate_up,down
    python scripts/tune_weight_kernels.py --out /tmp/tune --tiny     # CPU smoke run: interpret mode, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flint_jax import device_trace  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from flint_jax.pallas_kernels import attention_prologue as AP  # noqa: E402
from flint_jax.pallas_kernels import gemv as G  # noqa: E402
from flint_jax.pallas_kernels import moe_experts as ME  # noqa: E402
from flint_jax.pallas_kernels import router as R  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def gemv_grid():
    """Blocks(bn, bk, warps, stages, dot, elementwise, prefetch) candidates; the table's choice is timed first, then
    the tensor-core path's blocks (gemv.DOT_BLOCK and its neighbours in runs BH-BI; below gemv.TABLE_DOT_MIN_ROWS
    rows the rows are padded to 8), then the FMA path's."""
    out = [None]
    out += [(bn, 256, warps, 3, True, False, False) for bn, warps in ((32, 2), (16, 1), (64, 4))]
    for bn, bk, warps, pf in itertools.product((8, 16), (1024, 2048, 4096), (4, 8), (False, True)):
        out.append((bn, bk, warps, 3, False, False, pf))
    out += [(8, 512, 4, 3, False, True, False), (16, 1024, 4, 3, True, False, False)]
    return out


def gate_up_grid():
    out = [None]
    for bn, bk, warps, pf in itertools.product((4, 8, 16), (1024, 2048), (4, 8), (False, True)):
        out.append((bn, bk, warps, 3, False, pf))
    return out


def down_grid():
    return [None] + [(bn, 512, warps, 1) for bn, warps in itertools.product((4, 8, 16, 32), (2, 4, 8))]


def router_grid():
    return [None] + [(be, 2048, warps, 1) for be, warps in itertools.product((1, 2, 4), (2, 4, 8))]


def lm_head_grid():
    out = [None]
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (1024, 2048), (4, 8)):
        out.append((bn, bk, warps, 3, False, False, False))
    return out


def nvfp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def bf16_gemv_grid(k: int):
    """BF16 candidates for a K-long weight: thin blocks, K tiles up to the whole row (no decode: the in-flight bytes
    per program, not the FMA pipe, are what a BF16 GEMV must raise)."""
    out = [None]
    tiles = [t for t in (1024, 2048, 4096) if t <= k]
    for bn, bk, warps in itertools.product((4, 8), tiles, (4, 8)):
        out.append((bn, bk, warps, 3, False, False, False))
    for bn, bk, warps in ((4, 1024, 4), (8, 1024, 8), (4, 2048, 8), (8, 2048, 4)):
        if bk <= k:
            out.append((bn, bk, warps, 3, False, False, True))
    return out


def bf16_gate_up_grid():
    return [None] + [(bn, bk, warps, 3, False, False)
                     for bn, bk, warps in itertools.product((4, 8, 16), (1024, 2048), (4, 8))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="qkv,o,gate_up,down,router")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny widths, two settings per kernel, no timing (CPU CI)")
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"),
                    help="the weight format of the model (and of the grids: BF16 has its own)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    interpret = jax.default_backend() != "gpu"
    if interpret and not args.tiny:
        raise SystemExit("tune_weight_kernels.py times compiled kernels: run it on the GPU machine (or --tiny)")
    flint = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    L, M = (2 if args.tiny else args.layers), args.batch
    cfg = dataclasses.replace(flint, num_hidden_layers=L, layer_types=flint.layer_types[:L], first_k_dense_replace=0)
    t = time.time()
    params = jax.block_until_ready(init_params(cfg, jax.random.key(1), args.weights))
    layers = params.layers
    log(f"{L} Flint-width MoE layers ({args.weights}) built in {time.time() - t:.1f}s; batch {M}")
    bf16 = args.weights == "bf16"
    wbytes = (lambda n, k: 2 * n * k) if bf16 else nvfp4_bytes
    H, Hq, KV, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    I, E, k = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    keys = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(keys[0], (M, H), jnp.bfloat16)
    xo = jax.random.normal(keys[1], (M, Hq * D), jnp.bfloat16)
    logits = jax.random.normal(keys[2], (L, M, E), jnp.float32)  # a different routing per layer
    act = jax.random.normal(keys[3], (M * (k + 1), I), jnp.bfloat16)
    experts = 1 - (1 - k / E) ** M  # expected fraction of routed experts a batch reads

    def with_qkv_block(block):
        def fn(layer, _):
            saved, AP.QKV_BLOCK = AP.QKV_BLOCK, block
            try:
                return AP.qkv_projection(x, layer.attn_norm, layer.attn, cfg, interpret=interpret)
            finally:
                AP.QKV_BLOCK = saved
        return fn

    cases = {
        "qkv": (bf16_gemv_grid(H) if bf16 else gemv_grid(), with_qkv_block, wbytes((Hq + 2 * KV) * D, H)),
        "o": (bf16_gemv_grid(Hq * D) if bf16 else gemv_grid(), lambda b: lambda layer, _: G.gemv(
            xo, layer.attn.o, residual=x, block=b, interpret=interpret), wbytes(H, Hq * D)),
        "gate_up": (bf16_gate_up_grid() if bf16 else gate_up_grid(), lambda b: lambda layer, i: ME.expert_gate_up(
            x, logits[i], layer.mlp, cfg, block=b, interpret=interpret), 2 * wbytes(I, H) * (E * experts + 1)),
        "down": (down_grid(), lambda b: lambda layer, i: ME.expert_down(
            act, logits[i], layer.mlp, cfg, x, block=b, interpret=interpret), wbytes(H, I) * (E * experts + 1)),
        "router": (router_grid(), lambda b: lambda layer, _: R.router_logits(
            x, layer.mlp.router, norm_weight=layer.mlp_norm, eps=cfg.rms_norm_eps, block=b,
            interpret=interpret)[0], layers[0].mlp.router.nbytes),
    }
    # The LM head: one 175 MB weight (NVFP4), larger than the L2 by itself, run once per "layer" of the program.
    # A different input per call: XLA merges identical calls (same weight, same input) into one.
    xs = jax.random.normal(jax.random.key(5), (L, M, H), jnp.bfloat16)
    cases["lm_head"] = (lm_head_grid(), lambda b: lambda layer, i: G.gemv_logits(
        xs[i], params.lm_head, norm_weight=params.final_norm, eps=cfg.rms_norm_eps, block=b, interpret=interpret),
        wbytes(cfg.vocab_size, H))
    results = {"device": jax.devices()[0].device_kind, "layers": L, "batch": M, "weights": args.weights, "rows": []}
    for name in args.cases.split(","):
        grid, make, nbytes = cases[name]
        if args.tiny:
            grid = grid[:2]
        best = None
        for block in grid:
            if time.time() - T0 > args.budget_s:
                log(f"{name}: budget reached, {grid.index(block)} of {len(grid)} settings timed")
                break
            fn = make(block)
            prog = jax.jit(lambda ls: [fn(layer, i) for i, layer in enumerate(ls)])
            row = {"case": name, "block": "table" if block is None else list(block), "bytes": nbytes}
            try:
                jax.block_until_ready(prog(layers))
                if interpret:  # ran, nothing to time
                    row["ran"] = True
                    results["rows"].append(row)
                    log(f"{name} {row['block']}: ran (interpret mode)")
                    continue
                tdir = os.path.join(args.out, "traces", f"{name}_{len(results['rows'])}")
                events = device_trace.trace_kernels(lambda: [prog(layers) for _ in range(args.reps)][-1], tdir)
                # the kernel under test: the name launched once per layer per rep with the most time
                rows = device_trace.summarize(events, args.reps)["rows"]
                k = max((r for r in rows if r["per_step"] == L), key=lambda r: r["us_per_step"])
                row.update(kernel=k["name"], us=k["median_us"], GBps=nbytes / k["median_us"] / 1e3)
            except Exception as e:  # noqa: BLE001  (a setting the shape or the compiler refuses)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            results["rows"].append(row)
            if "us" in row:
                if best is None or row["us"] < best["us"]:
                    best = row
                log(f"{name} {row['block']}: {row['us']:.2f} us, {row['GBps']:.0f} GB/s")
            else:
                log(f"{name} {row['block']}: {row['error']}")
            with open(os.path.join(args.out, "tune.json"), "w") as f:
                json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(results, f, indent=1)
        if best is not None:
            log(f"BEST {name}: {best['block']} {best['us']:.2f} us ({best['GBps']:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
