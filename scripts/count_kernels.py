"""Count the kernels of a decode step at the Flint shape without a GPU (flint_jax.pallas_path.kernel_census): the
jitted step is lowered for CUDA from this host with abstract parameters, nothing allocated.

    python scripts/count_kernels.py [--weights nvfp4] [--batch 1] [--impls pallas,xla] [--stacked-params]
                                    [--stacked-caches]

It also prints the argument buffers the host hands the step per call (parameters + state; flint_jax.layer_stack
and state.StackedCaches cut them).

Pallas kernels appear as one custom call each. XLA fuses the remaining StableHLO ops into kernels only when it
compiles for the device, which needs a GPU, so for those the script reports the op count as an upper bound; the
exact number of kernels comes from scripts/bench_decode.py on the GPU (count of the compiled program).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401

from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.pallas_path import kernel_census  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="nvfp4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--impls", default="pallas,xla")
    ap.add_argument("--stacked-params", action="store_true", help="the layers' parameters stacked (layer_stack)")
    ap.add_argument("--stacked-caches", action="store_true", help="the KV caches stacked (state.StackedCaches)")
    args = ap.parse_args(argv)
    cfg = FlintConfig.flint()
    for impl in args.impls.split(","):
        t = time.time()
        r = kernel_census(cfg, args.weights, args.batch, impl, stacked_params=args.stacked_params,
                          stacked_caches=args.stacked_caches)
        print(f"{impl} {args.weights} B={args.batch}: {r['pallas_kernels']} Pallas kernels, "
              f"{r['other_hlo_ops']} other StableHLO ops, {r['argument_buffers']} argument buffers "
              f"({time.time() - t:.0f}s)", flush=True)
        for name, n in r["by_kernel"].items():
            print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
