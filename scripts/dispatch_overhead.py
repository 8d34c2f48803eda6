"""Host cost of dispatching the jitted decode step, against the number of argument buffers.

At batch 1 the host's dispatch of Flint's step is as long as the GPU's work (docs/BENCHMARKS.md, "Host overhead"),
and it grows with the number of parameter and state buffers. This script builds a model with Flint's 49 layers and
layer pattern but tiny widths (the buffer count is the same as the full model's, the work is negligible) and times
how long the call takes to return (dispatch, asynchronous) and the whole step, for NVFP4 (3 buffers per linear
weight) and BF16 (1 buffer) parameters. Meant for the GPU machine, where the call returns as soon as the step is
enqueued; the CPU backend runs small programs inside the call, so there "returns after" includes the work.

    python scripts/dispatch_overhead.py [--impl xla|pallas] [--iters 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_decode import make_steps, random_state  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="xla", choices=("xla", "pallas"))
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    flint = FlintConfig.flint()
    cfg = FlintConfig.tiny(num_hidden_layers=flint.num_hidden_layers, layer_types=flint.layer_types,
                           first_k_dense_replace=flint.first_k_dense_replace, hidden_size=64, head_dim=32,
                           intermediate_size=64, moe_intermediate_size=64, vocab_size=64)
    print(f"device {jax.devices()[0].device_kind}, impl {args.impl}, {cfg.num_hidden_layers} layers (tiny widths)")
    for weights in ("nvfp4", "bf16"):
        params = init_params(cfg, jax.random.key(1), weights)
        forward, _ = make_steps(cfg, args.impl)
        state = random_state(cfg, 1, 64, 32, jax.random.key(2))
        tokens = jnp.full((1,), 7, jnp.int32)
        lengths = jnp.full((1,), 32, jnp.int32)
        out, state = forward(params, state, tokens, lengths)
        jax.block_until_ready(out)
        dispatch, step = [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            out, state = forward(params, state, tokens, lengths)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            dispatch.append(t1 - t0)
            step.append(time.perf_counter() - t0)
        print(f"{weights}: {len(jax.tree.leaves(params))} parameter buffers, {len(jax.tree.leaves(state))} state "
              f"buffers: the call returns after {1e3 * statistics.median(dispatch):.2f} ms, step "
              f"{1e3 * statistics.median(step):.2f} ms (medians of {args.iters})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
