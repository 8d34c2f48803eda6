"""What sampling costs on the device: `sampling.sample` over Flint's vocabulary, the whole-vocabulary sort path
against the top-k path (`top_k_path=True`, per segment size), and the pieces of each (sort, lax.top_k, cumsum,
categorical).

Each case is one jitted function called `--steps` times back to back under the profiler; the table gives its device
span per call (first kernel start to last kernel end, flint_jax.device_trace) and its kernels per call.

    python scripts/bench_sampling.py --out /tmp/sampling            # on the GPU: B = 1 and 8, V = 151,552
    python scripts/bench_sampling.py --out /tmp/sampling --vocab 4096 --batches 1   # CPU smoke run (no device trace)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flint_jax import device_trace, sampling  # noqa: E402


def cases(segments):
    """name -> function of (logits, keys, temperature, top_k, top_p), jitted by the caller (while the
    segment setting it names is in place)."""
    out = {"sample (sort path)": (None, lambda l, k, t, tk, tp: sampling.sample(l, k, t, tk, tp))}
    for seg in segments:
        out[f"sample (top-k path, segments of {seg})"] = (
            seg, lambda l, k, t, tk, tp: sampling.sample(l, k, t, tk, tp, top_k_path=True))
        out[f"top_values alone, segments of {seg}"] = (
            seg, lambda l, *_: sampling.top_values(l, sampling.TOP_K_CANDIDATES))
    out["jnp.sort alone"] = (None, lambda l, *_: jnp.sort(l, axis=-1))
    out["lax.top_k 16 alone"] = (None, lambda l, *_: jax.lax.top_k(l, 16)[0])
    out["lax.top_k 64 alone"] = (None, lambda l, *_: jax.lax.top_k(l, 64)[0])
    out["jnp.cumsum alone"] = (None, lambda l, *_: jnp.cumsum(l, axis=-1))
    out["categorical alone"] = (None, lambda l, k, *_: jax.vmap(jax.random.categorical)(k, l))
    out["argmax alone"] = (None, lambda l, *_: jnp.argmax(l, axis=-1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--top-k", type=int, default=sampling.DEFAULT_TOP_K)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--segments", default="512,1024,2048", help="sampling.TOP_K_SEGMENT values to time")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not sampling.fits_top_k_path([args.top_k]):
        raise SystemExit(f"--top-k {args.top_k}: no top-k path for it (1..{sampling.TOP_K_CANDIDATES})")
    segments = [int(s) for s in args.segments.split(",")]
    rows, md = [], [f"Device {jax.devices()[0].device_kind}, vocabulary {args.vocab}, top_k {args.top_k}, "
                    f"top_p {sampling.DEFAULT_TOP_P}, {args.steps} calls per case.", "",
                    "| case | batch | device us per call | kernels per call |", "|---|---|---|---|"]
    for batch in (int(b) for b in args.batches.split(",")):
        logits = 3.0 * jax.random.normal(jax.random.key(0), (batch, args.vocab), jnp.float32)
        keys = jax.random.split(jax.random.key(1), batch)
        settings = (jnp.full((batch,), sampling.DEFAULT_TEMPERATURE), jnp.full((batch,), args.top_k, jnp.int32),
                    jnp.full((batch,), sampling.DEFAULT_TOP_P))
        for name, (seg, fn) in cases(segments).items():
            f = jax.jit(fn)
            default_segment = sampling.TOP_K_SEGMENT
            sampling.TOP_K_SEGMENT = seg or default_segment
            try:
                jax.block_until_ready(f(logits, keys, *settings))  # compile (reads the segment) and warm up
            finally:
                sampling.TOP_K_SEGMENT = default_segment

            def run():
                out = None
                for _ in range(args.steps):
                    out = f(logits, keys, *settings)
                return out
            with tempfile.TemporaryDirectory() as d:
                events = device_trace.trace_kernels(run, d)
            dev = device_trace.device_ms(events, args.steps)
            kernels = len(events) / args.steps if events else None
            rows.append({"case": name, "batch": batch, "device_us": None if dev is None else 1e3 * dev,
                         "kernels": kernels})
            us = "no device trace" if dev is None else f"{1e3 * dev:.1f}"
            md.append(f"| {name} | {batch} | {us} | {'-' if kernels is None else f'{kernels:.0f}'} |")
            print(f"{name}, batch {batch}: {us} us, {kernels} kernels per call", flush=True)
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "sampling.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
