"""Count the kernels of a decode step at the Flint shape without a GPU: export the jitted step for CUDA from this
host (abstract parameters, nothing allocated) and count what it launches.

    python scripts/count_kernels.py [--weights nvfp4] [--batch 1] [--impls pallas,xla]

Pallas kernels appear as one custom call each. XLA fuses the remaining StableHLO ops into kernels only when it
compiles for the device, which needs a GPU, so for those the script reports the op count as an upper bound, and the
exact number of kernels comes from scripts/bench_decode.py on the GPU (count of the compiled program).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flint_jax import model as M  # noqa: E402
from flint_jax import pallas_path  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import abstract_params  # noqa: E402
from flint_jax.state import init_state  # noqa: E402

# StableHLO ops that never launch anything on their own.
FREE = {"reshape", "bitcast_convert", "get_tuple_element", "tuple", "constant", "return", "optimization_barrier"}


def count(cfg: FlintConfig, weights: str, batch: int, impl: str, max_len: int = 4096) -> dict:
    params = abstract_params(cfg, weights)
    state = jax.eval_shape(lambda: init_state(cfg, batch, max_len))

    def step(params, state, tokens):
        return M.model_step(params, state, tokens[:, None], jnp.ones_like(tokens), cfg, impl=impl)

    with pallas_path.lowering_for_gpu():
        text = jax.jit(step).trace(params, state, jax.ShapeDtypeStruct((batch,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = collections.Counter(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))
    names = collections.Counter(re.findall(r'name = "(\w+)", num_stages', text))
    ops = collections.Counter(re.findall(r"= stablehlo\.(\w+)", text))
    other = sum(n for op, n in ops.items() if op not in FREE and op != "custom_call")
    return {"impl": impl, "weights": weights, "batch": batch, "custom_calls": dict(calls),
            "pallas_kernels": sum(n for c, n in calls.items() if "triton" in c or "mosaic" in c),
            "by_kernel": dict(names.most_common()),
            "other_hlo_ops": other}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="nvfp4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--impls", default="pallas,xla")
    args = ap.parse_args(argv)
    cfg = FlintConfig.flint()
    for impl in args.impls.split(","):
        t = time.time()
        r = count(cfg, args.weights, args.batch, impl)
        print(f"{impl} {args.weights} B={args.batch}: {r['pallas_kernels']} Pallas kernels, custom calls "
              f"{r['custom_calls']}, {r['other_hlo_ops']} other StableHLO ops ({time.time() - t:.0f}s)", flush=True)
        for name, n in r["by_kernel"].items():
            print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
