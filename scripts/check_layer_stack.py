"""Does a step on stacked parameters (flint_jax.layer_stack) compute what the same step on per-layer arrays does, at
the Flint shape on the device? One prefill chunk and one decode step per layout from the same synthetic weights and
empty state; prints whether the hidden states are bit-identical and their largest difference.

    python scripts/check_layer_stack.py [--weights nvfp4] [--tokens 1024] [--impl pallas]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flint_jax import model as M  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.layer_stack import stack_layers  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from flint_jax.state import init_state  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--impl", default="pallas", choices=("xla", "pallas"))
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens of the prefill chunk")
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() (CPU smoke run)")
    args = ap.parse_args(argv)
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    T = min(args.tokens, 12) if args.tiny else args.tokens
    step = jax.jit(M.model_step, static_argnames=("cfg", "impl"), donate_argnums=(1,))
    params = init_params(cfg, jax.random.key(1), args.weights)
    toks = jax.random.randint(jax.random.key(2), (1, T + 1), 0, cfg.vocab_size)
    outs = []
    for layout in ("layers", "stacked"):
        if layout == "stacked":
            params = stack_layers(params, delete=True)
        t = time.time()
        state = init_state(cfg, 1, T + 8)
        h_pre, state = step(params, state, toks[:, :T], jnp.array([T]), cfg, impl=args.impl)
        h_dec, state = step(params, state, toks[:, T:], jnp.array([1]), cfg, impl=args.impl)
        outs.append([np.asarray(h_pre[:, -1], np.float32), np.asarray(h_dec, np.float32)])
        print(f"{layout}: prefill {T} tokens + one decode step in {time.time() - t:.1f}s (compiles included)",
              flush=True)
        del state
    ok = True
    for name, a, b in zip(("prefill (last token)", "decode"), outs[0], outs[1]):
        same = np.array_equal(a, b)
        ok &= same
        print(f"{name}: bit-identical {same}, max |diff| {np.abs(a - b).max():.3g} (|h| max {np.abs(a).max():.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
