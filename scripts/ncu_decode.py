"""Run the Pallas decode forward of a few full-width Flint layers, for Nsight Compute (`ncu`) to profile its kernels.

The step's kernels at batch 1 take 2-9 us for a few MB each (docs/DECODE_PATH.md): a trace gives their times, not
why. `ncu` replays chosen kernels with hardware counters (stall reasons, issue slots, DRAM throughput, occupancy,
registers). This script only builds and runs the program; `scripts/ncu_decode.sh` wraps it in `ncu` and reduces the
report to a table. A few layers suffice: every layer of a kind runs the same kernels (the first MoE layer and the
first full layer are layers 2 and 3 of Flint's pattern), and `ncu` flushes the caches before each replay, so the
weights come from HBM as in the 49-layer step.

    python scripts/ncu_decode.py --layers 4 --context 100000 --kv-dtype fp8 --steps 3
    python scripts/ncu_decode.py --tiny            # CPU smoke run (interpret mode)

Prints, after the warm-up step, the line `NCU_MARK steps start` and then runs --steps steps, so that `ncu
--launch-skip` can skip the warm-up's launches (the kernels per step are printed too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_decode import count_kernels, log, make_steps, random_state  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.device_memory import model_shortfall  # noqa: E402
from flint_jax.params import init_params  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="Flint layers (pattern of FLINT_SPEC: 4 gives 2 dense, "
                    "2 MoE, 1 full-context layer); default 4")
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--steps", type=int, default=2, help="steps after the warm-up (default 2)")
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() on the CPU, interpret mode")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.steps < 1:
        ap.error("--layers and --steps must be at least 1")
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint(num_hidden_layers=args.layers)
    context = min(args.context, 100) if args.tiny else args.context
    why = model_shortfall(cfg, args.weights, batch=args.batch, max_len=context + 8, kv_dtype=args.kv_dtype)
    if why:
        print(f"ncu_decode: {why}", file=sys.stderr)
        return 1
    t = time.time()
    params = init_params(cfg, jax.random.key(1), args.weights)
    state = random_state(cfg, args.batch, context + 8, context, jax.random.key(2), args.kv_dtype)
    tokens = jnp.arange(args.batch, dtype=jnp.int32) + 7
    forward, _ = make_steps(cfg, "pallas")
    compiled = forward.lower(params, state, tokens, state.lengths).compile()
    log(f"{cfg.num_hidden_layers} layers {cfg.layer_types}, context {context}, {args.kv_dtype} caches: built and "
        f"compiled in {time.time() - t:.1f}s, {count_kernels(compiled)} kernel-launching ops per step")
    h, state = compiled(params, state, tokens, state.lengths)  # warm-up
    jax.block_until_ready(h)
    print("NCU_MARK steps start", flush=True)
    for _ in range(args.steps):
        h, state = compiled(params, state, tokens, state.lengths)
        jax.block_until_ready(h)
    log(f"ran {args.steps} steps; |h| = {float(jnp.abs(h.astype(jnp.float32)).mean()):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
