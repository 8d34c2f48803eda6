"""Probe: jax's Mosaic GPU flash attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`, warp-specialised, TMA and
wgmma) against our Triton-lowered `prefill_attention.full_attention` for a full layer's first 8K chunk.

For a chunk at offset 0 a full layer's attention is plain causal self-attention over the chunk (GQA 32/4, D = 128)
plus the sink. attention_mgpu has no softmax scale and no sink and takes f16 only, so the probe gives it q * (1/sqrt(D)), k, v in f16
and folds the sink in afterwards from the log-sum-exp it returns (o * 1 / (1 + e^(sink - lse)), one more BF16
rounding). Both are timed over `--layers` distinct layers (more bytes than L2), device time from a profiler trace.

    python scripts/probe_mgpu_prefill_attention.py --out $OUT/mgpu      # on the GPU

Outcome on the H200 (docs/BENCHMARKS.md, runs AJ and AK): ours 1,445 us per layer (380 TFLOP/s); attention_mgpu
refused BF16 inputs (jax 0.11.2), and with f16 inputs the process died in native code. Kept as the record of that
measurement and to retry with a later jax.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import flint_jax  # noqa: E402,F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flint_jax import device_trace  # noqa: E402
from flint_jax.pallas_kernels import prefill_attention as pa  # noqa: E402
from flint_jax.state import FullCache  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def mgpu_attention(q, k, v, sinks, cfg):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    D = q.shape[-1]
    F16 = jnp.float16  # the kernel's shared-memory tiles are f16 in jax 0.11.2 (BF16 inputs are refused)
    qs = (q.astype(F32) * (1.0 / math.sqrt(D))).astype(F16)
    o, (lse2,) = am.attention(qs, k.astype(F16), v.astype(F16), cfg, save_residuals=True)  # lse2 [B, Hq, T], base 2
    lse = jnp.swapaxes(lse2, 1, 2) * math.log(2.0)  # [B, T, Hq], natural log
    scale = 1.0 / (1.0 + jnp.exp(sinks[None, None, :] - lse))
    return (o.astype(F32) * scale[..., None]).astype(BF16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--configs", default="64x128x2,64x128x3,64x64x4,128x128x2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    B, T, Hq, KV, D, L = 1, args.tokens, 32, 4, 128, args.layers
    keys = jax.random.split(jax.random.key(0), 4 * L)
    qs = [jax.random.normal(keys[4 * i], (B, T, Hq, D), BF16) for i in range(L)]
    ks = [jax.random.normal(keys[4 * i + 1], (B, T, KV, D), BF16) for i in range(L)]
    vs = [jax.random.normal(keys[4 * i + 2], (B, T, KV, D), BF16) for i in range(L)]
    sinks = [jax.random.normal(keys[4 * i + 3], (Hq,), F32) for i in range(L)]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    lengths = jnp.full((B,), T, jnp.int32)
    caches = [FullCache(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)) for k, v in zip(ks, vs)]
    flops = 4 * B * Hq * D * T * T / 2 * L  # causal half of QK and PV
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "T": T, "layers": L, "rows": []}

    def run(name, fn):
        t0 = time.time()
        try:
            f = jax.jit(fn)
            out = jax.block_until_ready(f())
            s = device_trace.trace_call(f)
            if s is None:
                raise RuntimeError("no device events in the trace (not on a GPU)")
            us = s["kernel_us_per_step"] / L
            row = {"variant": name, "us_per_layer": us, "TFLOPs": flops / L / (us * 1e-6) / 1e12,
                   "kernels": [(r["name"][:60], round(r["mean_us"], 1), r["per_step"]) for r in s["rows"][:4]],
                   "s": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            return out
        except Exception as e:  # noqa: BLE001
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:800]}", flush=True)
            result["rows"].append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:800]}"})
            return None

    ours = run("ours (prefill_attention.full_attention)",
               lambda: [pa.full_attention(q, pos, c, lengths, s) for q, c, s in zip(qs, caches, sinks)])
    for c in args.configs.split(","):
        bq, bkv, st = (int(x) for x in c.split("x"))
        cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st, causal=True)
        got = run(f"attention_mgpu bq={bq} bkv={bkv} steps={st} + sink",
                  lambda cfg=cfg: [mgpu_attention(q, k, v, s, cfg) for q, k, v, s in zip(qs, ks, vs, sinks)])
        if got is not None and ours is not None:
            err = max(float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32)))) for a, b in zip(got, ours))
            scale = max(float(jnp.max(jnp.abs(b.astype(F32)))) for b in ours)
            result["rows"][-1].update(max_abs_diff_vs_ours=err, max_abs_ours=scale)
            print(f"  max |mgpu - ours| {err:.3g} (max |ours| {scale:.3g})", flush=True)
    with open(os.path.join(args.out, "probe_mgpu_prefill_attention.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
