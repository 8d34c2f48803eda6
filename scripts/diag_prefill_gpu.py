"""Diagnostic (not a test): tests/test_prefill.py's chunked-prefill cases, compiled, with the prefill router logits
as three BF16 parts (the default) or as the FP32 einsum, and prefill attention's P @ V in BF16 (the GPU default) or
FP32: max |error| / max |ref| of the logits and the argmax agreement per row, to see which one moves the results."""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flint_jax  # noqa: E402,F401
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import test_prefill as T  # noqa: E402
from flint_jax import layers as L, model as M, prefill as P  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from flint_jax.pallas_kernels import prefill_attention as pa  # noqa: E402

split_logits = P.router_logits_bf16x3


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)  # --help; no options
    M._blocks = T._blocks
    for pv, split in itertools.product(["bf16", "f32"], [True, False]):
        run_case(pv, split)
    return 0


def run_case(pv: str, split: bool) -> None:
    pa.GPU_PV = pv
    P.router_logits_bf16x3 = split_logits if split else L.router_logits
    jax.clear_caches()
    step = jax.jit(M.model_step, static_argnames=("cfg", "impl"))
    for window, weights, chunks, n_valid in T.CASES:
        cfg = FlintConfig.tiny(sliding_window=window)
        params = init_params(cfg, jax.random.key(0), weights)
        tokens = jax.random.randint(jax.random.key(1), (2, 23), 0, cfg.vocab_size)
        got, _ = T.run_chunks(step, params, cfg, tokens, chunks, n_valid)
        for b, n in enumerate(n_valid):
            ref = M.forward(params, tokens[b:b + 1, :n], cfg)
            g = got[b:b + 1, :n]
            err = float(jnp.abs(g - ref).max() / jnp.abs(ref).max())
            agree = float((jnp.argmax(g, -1) == jnp.argmax(ref, -1)).mean())
            print(f"[diag] pv={pv} split_router={split} {weights} window {window} row {b}: "
                  f"max err / max |ref| {err:.4f}, argmax agreement {agree:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
