"""Probe: where the sliding layers' fused ring-attention kernel spends its time (issue 5's sliding block; 9.2 us
per layer in the step until run DF, 6.3 us + 1.5 us of `combine` since).

Times `decode_attention.fused_decode_attention` on 35 distinct rings (Flint shape, batch 1, every slot valid) in one
jitted program, as the decode step's 35 sliding layers run it, and reads each kernel's median device time from a
profiler trace. Each variant changes one thing:

  knob variants (product settings the kernel reads at trace time):
    base               the product: 8 splits of one preloaded 64-key block, split 0 also the 513th slot, the
                       splits folded by the `combine` kernel (COMBINE_IN_KERNEL False since run DF), 8 warps
    fold_in_kernel     the splits folded by the last-arriving program (the product until run DF)
    warps4             4 warps
    splits16_bk32      16 splits of one 32-key block (64 programs), folded in the kernel in two rounds of loads
    splits16_bk32_f16k the same, the fold in one round (FOLD_VALUES 16384)
    splits16_combine   16 splits of one 32-key block, folded by `combine`
    rope_table         RoPE's cos/sin read from a table XLA computes (decode_attention.ROPE_TABLE; the product since DI)
    rope_in_kernel     RoPE's cos/sin evaluated in every program (the product until run DI)
  diagnostics (wrong results on purpose; the probe patches the kernel module, only for that variant):
    no_rope            Q/K finished without RoPE (NoPE, as the full layers)
    no_kv_store        the new K/V not written into the ring
    no_extra_slot      the 513th slot not read (the 8 splits' 512 keys only)
    no_fold            fold_in_kernel, but the ticket never makes a program the last: partials stored, nobody folds

    python scripts/probe_ring.py --out $OUT/ring                    # on the GPU
    python scripts/probe_ring.py --out /tmp/ring --smoke            # CPU: tiny shapes, interpret mode, no timing

Writes OUT/probe_ring.json and prints a Markdown table (us per kernel, median over the 35 layers x calls).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flint_jax import device_trace  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.pallas_kernels import decode_attention as DA  # noqa: E402
from flint_jax.state import RingCache  # noqa: E402


def _no_rope(orig):
    def finish(x1, x2, nw_ref, rope, pos, *, eps, sliding):
        return orig(x1, x2, nw_ref, rope, pos, eps=eps, sliding=False)
    return finish


KNOBS = {
    "base": [],
    "fold_in_kernel": [(DA, "COMBINE_IN_KERNEL", True)],
    "warps4": [(DA, "RING_NUM_WARPS", 4)],
    "splits16_bk32": [(DA, "COMBINE_IN_KERNEL", True), (DA, "RING_SPLITS", 16), (DA, "BLOCK_K", 32)],
    "splits16_bk32_f16k": [(DA, "COMBINE_IN_KERNEL", True), (DA, "RING_SPLITS", 16), (DA, "BLOCK_K", 32),
                           (DA, "FOLD_VALUES", 16384)],
    "splits16_combine": [(DA, "RING_SPLITS", 16), (DA, "BLOCK_K", 32)],
    "rope_table": [(DA, "ROPE_TABLE", True)],
    "rope_in_kernel": [(DA, "ROPE_TABLE", False)],
    "no_rope": [(DA, "finish_heads", "no_rope")],
    "no_kv_store": [(DA, "store_kv", "no_store")],
    "no_extra_slot": [(DA, "ring_geometry", "no_extra")],
    "no_fold": [(DA, "COMBINE_IN_KERNEL", True), (DA.plgpu, "atomic_add", "no_fold")],
}


def _patch_value(module, name, value):
    orig = getattr(module, name)
    if value == "no_rope":
        return _no_rope(orig)
    if value == "no_store":
        return lambda *a, **k: None
    if value == "no_extra":
        return lambda n_slots, splits: (DA.BLOCK_K, 0, True)
    if value == "no_fold":  # the ticket is never the last one: no program folds
        return lambda ref, idx, val, **k: jnp.full((), -1, jnp.int32)
    return value


@contextlib.contextmanager
def variant(name):
    saved = []
    try:
        for module, attr, value in KNOBS[name]:
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, _patch_value(module, attr, value))
        yield
    finally:
        for module, attr, old in reversed(saved):
            setattr(module, attr, old)


def make_inputs(cfg, layers, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4 * layers)
    B, Hq, KV, D, W = 1, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    p = 4 * W + 7  # every slot valid, the ring wrapped several times
    slots = jnp.arange(W)
    pos = jnp.broadcast_to(p - 1 - (p - 1 - slots) % W, (B, W)).astype(jnp.int32)
    qkvs, attns, rings = [], [], []
    for i in range(layers):
        k0, k1, k2, k3 = keys[4 * i:4 * i + 4]
        qkvs.append(jax.random.normal(k0, (B, Hq + 2 * KV, D), jnp.bfloat16))
        rings.append(RingCache(k=jax.random.normal(k1, (B, KV, W, D), jnp.bfloat16),
                               v=jax.random.normal(k2, (B, KV, W, D), jnp.bfloat16), pos=pos))
        norms = 1 + 0.1 * jax.random.normal(k3, (2, D))
        attns.append(types.SimpleNamespace(q_norm=norms[0].astype(jnp.bfloat16),
                                           k_norm=norms[1].astype(jnp.bfloat16), sinks=jax.random.normal(k3, (Hq,))))
    return qkvs, attns, rings, jnp.full((B,), p, jnp.int32), jnp.ones((B,), bool)


def run_variant(name, cfg, inputs, interpret, calls):
    qkvs, attns, rings, pos, active = inputs
    with variant(name):
        fn = jax.jit(lambda qkvs, rings: [DA.fused_decode_attention(x, a, r, pos, active, cfg, True,
                                                                    interpret=interpret)
                                          for x, a, r in zip(qkvs, attns, rings)])
        t = time.time()
        outs = fn(qkvs, rings)
        jax.block_until_ready(outs)
        compile_s = time.time() - t
        o0 = outs[0][0]
        with tempfile.TemporaryDirectory() as d:
            events = device_trace.trace_kernels(lambda: [fn(qkvs, rings) for _ in range(calls)][-1], d)
    row = {"variant": name, "compile_s": round(compile_s, 1),
           "o0_abs_mean": float(jnp.abs(o0.astype(jnp.float32)).mean())}
    if events:
        figures = device_trace.per_layer(events, calls, len(qkvs))
        row["span_us_per_layer"], row["kernels"] = figures["device_us_per_layer"], figures["kernels"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(KNOBS))
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny config in interpret mode, no timing")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in KNOBS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(KNOBS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        cfg = FlintConfig.tiny()
        layers, calls = 2, 1
    else:
        cfg = FlintConfig.flint()
        layers, calls = args.layers, args.calls
    interpret = jax.default_backend() != "gpu"
    inputs = make_inputs(cfg, layers)
    rows = []
    for name in names:
        try:
            rows.append(run_variant(name, cfg, inputs, interpret, calls))
        except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(args.out, "probe_ring.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)
    print("\n| variant | us per layer (span) | ring kernel median us | other kernels |")
    print("|---|---|---|---|")
    for r in rows:
        ks = r.get("kernels", [])
        ring = [k for k in ks if "ring" in k["name"]]
        other = ", ".join(f"{k['name']} {k['median_us']:.2f}" for k in ks if "ring" not in k["name"])
        print(f"| {r['variant']} | {r.get('span_us_per_layer', float('nan')):.2f} | "
              f"{ring[0]['median_us'] if ring else float('nan'):.2f} | {other or r.get('error', '')} |")


if __name__ == "__main__":
    main()
