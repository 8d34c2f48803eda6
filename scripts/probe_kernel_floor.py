"""Probe: what one kernel costs in a jitted decode-like chain when it does (almost) nothing.

A chain of N dependent Pallas kernels (Triton lowering) in one jitted program, each reading the previous kernel's
small output and writing its own, with `programs` programs per launch: the device time per kernel is the floor that
every one of the decode step's ~310 kernels pays before it moves a byte (launch inside XLA's command buffer, program
scheduling, first load, store, drain). Variants: 1 program, 132 programs (one per SM), 264 (two per SM), and 132
programs that each also stream `--mib` MiB of distinct weights per kernel (a layer-sized read).

    python scripts/probe_kernel_floor.py --out $OUT/floor          # on the GPU
    python scripts/probe_kernel_floor.py --out /tmp/floor --smoke  # CPU: interpret mode, 4 kernels, no timing
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from flint_jax import device_trace  # noqa: E402

LANES = 128


def _kernel(x_ref, *refs, stream, rows):
    """y[i] = x[i] + 1 (+ the sum of this program's weight rows when streaming)."""
    o_ref = refs[-1]
    i = pl.program_id(0)
    x = x_ref[pl.ds(i * LANES, LANES)]
    if stream:
        w_ref = refs[0]
        acc = jnp.zeros((LANES,), jnp.float32)

        def body(r, acc):
            return acc + w_ref[pl.ds(i * rows + r * 8, 8), :].astype(jnp.float32).sum(axis=0)

        acc = jax.lax.fori_loop(0, rows // 8, body, acc)
        x = x + acc
    o_ref[pl.ds(i * LANES, LANES)] = x + 1.0


def chain(n, programs, mib, interpret):
    """A jitted fn(x, weights) running n dependent kernels; the weights list (one per kernel) or None."""
    stream = mib > 0
    rows = (mib << 20) // (programs * LANES * 2) // 8 * 8 if stream else 0

    def one(x, w):
        kernel = functools.partial(_kernel, stream=stream, rows=rows)
        args = [x] + ([w] if stream else [])
        return pl.pallas_call(kernel, grid=(programs,), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
                              interpret=interpret, name="floor_probe")(*args)

    def run(x, ws):
        for k in range(n):
            x = one(x, ws[k] if stream else None)
        return x

    ws = [jax.random.normal(jax.random.key(k), (programs * rows, LANES), jnp.bfloat16) for k in range(n)] \
        if stream else None
    return jax.jit(run), ws


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", type=int, default=300)
    ap.add_argument("--mib", type=int, default=4, help="MiB of weights per kernel in the streaming variant")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    interpret = jax.default_backend() != "gpu"
    n = 4 if args.smoke else args.kernels
    cases = [(1, 0), (132, 0), (264, 0), (132, args.mib)]
    if args.smoke:
        cases = [(2, 0), (2, 1)]
    rows = []
    for programs, mib in cases:
        fn, ws = chain(n, programs, mib, interpret)
        x = jnp.zeros((programs * LANES,), jnp.float32)
        y = jax.block_until_ready(fn(x, ws))
        ok = bool(jnp.all(y == n)) if mib == 0 else bool(jnp.all(jnp.isfinite(y)))
        row = {"programs": programs, "mib_per_kernel": mib, "kernels": n, "result_ok": ok}
        calls = 5
        with tempfile.TemporaryDirectory() as d:
            events = device_trace.trace_kernels(lambda: [fn(x, ws) for _ in range(calls)][-1], d)
        if events:  # the n kernels of one call are per_layer's "layers"
            figures = device_trace.per_layer(events, calls, n, (mib << 20) or None)
            row["span_us_per_kernel"] = figures["device_us_per_layer"]
            row["kernel_median_us"] = figures["kernels"][0]["median_us"]
            if mib:
                row["GBps"] = figures["GBps"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ws
    with open(os.path.join(args.out, "probe_kernel_floor.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
