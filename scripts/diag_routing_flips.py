"""Diagnostic: how far the tiny config's decode may stray from the reference through routing flips alone.

`tests/test_pallas_path.py::test_odd_batch_carries_padding_rows_through_the_step` compares impl="pallas" decode
at 8 rows with the reference forward. This script prints the two sets of figures its docstring quotes:
1. per (row, step), the largest logit difference between that decode (the test's `_decode`, 8 sequences) and the
   reference forward, on this machine's backend (CPU: Pallas interpret mode);
2. per (row, step), how far the reference itself moves when one BF16 ulp is added to about an eighth of the
   embedding entries (a few random draws): rounding noise that flips a top-2-of-8 routing choice moves a whole
   (row, step) by ~0.5, the others by a few hundredths.

    python scripts/diag_routing_flips.py [--out FILE.json] [--draws 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flint_jax import model as M  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from test_pallas_path import _decode  # noqa: E402  (the test's decode, not a copy of it)


def per_position_error(a, b) -> np.ndarray:
    """[row, step] largest absolute difference of two [B, T, V] logit arrays."""
    return np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max(axis=-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the figures as JSON here")
    ap.add_argument("--draws", type=int, default=6, help="random one-ulp perturbations of the embedding")
    args = ap.parse_args(argv)
    cfg = FlintConfig.tiny()
    params = init_params(cfg, jax.random.key(0))  # the tests' tiny_params
    n_prompt, n_decode = 4, 3  # as the test
    toks = jax.random.randint(jax.random.key(2), (8, n_prompt + n_decode), 0, cfg.vocab_size)
    ref = M.forward(params, toks, cfg)[:, n_prompt:]
    scale = float(jnp.abs(ref).max())
    decode = per_position_error(M.lm_logits(params, _decode(params, cfg, toks, n_prompt), cfg), ref)
    print(f"backend {jax.default_backend()}; largest |reference logit| {scale:.3f}")
    print("impl='pallas' decode (8 rows) against the reference, [row, step]:")
    print(np.round(decode, 4))
    moved = []
    for d in range(args.draws):
        bump = jax.random.bernoulli(jax.random.key(100 + d), 0.125, params.embed.shape)
        e = params.embed
        noisy = dataclasses.replace(params, embed=jnp.where(bump, jnp.nextafter(e, jnp.full_like(e, jnp.inf)), e))
        moved.append(per_position_error(M.forward(noisy, toks, cfg)[:, n_prompt:], ref))
        print(f"reference with one ulp on ~1/8 of the embedding (draw {d}), [row, step]:")
        print(np.round(moved[-1], 3))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": jax.default_backend(), "largest_ref_logit": scale,
                       "decode_vs_reference": decode.tolist(), "reference_moved": [m.tolist() for m in moved]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
