"""A/B of the engine's decode loop at one step per dispatch, without overlap: today's `Engine._decode` against the
loop before commit a88f4c3 (one burst per `_decode` call; tokens, settings and masks passed as host arrays to every
dispatch), and today's loop with host arrays (looped_host). Run BX measured `Engine.generate` 1:off at 4.25 ms/token after that commit, against 3.24 in run BS before
it, on another machine; this times both loops alternately on one engine, so only the loop differs.

    python scripts/ab_decode_loop.py [--tiny] [--prompt-tokens 8192] [--new-tokens 128] [--repeats 4]

Temporary: whichever loop loses is removed, and this script with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode import log  # noqa: E402
from flint_jax import engine as E  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.layer_stack import stack_layers  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from flint_jax.sampling import SamplingParams  # noqa: E402


def per_burst_decode(self, slots, rows, results, admit_after_one: bool = False):
    """`Engine._decode` as of a88f4c3^ without overlap: one burst per call, host arrays for every input."""
    B, n = self.max_batch, self.steps_per_dispatch
    tokens, active = np.zeros(B, np.int32), np.zeros(B, bool)
    limits, generated = np.zeros(B, np.int32), np.zeros(B, np.int32)
    for b in rows:
        s = slots[b]
        tokens[b], active[b], generated[b] = s.tokens[-1], True, len(s.tokens)
        limits[b] = len(s.prompt) + s.sampling.max_tokens - 1
    settings = self._settings(slots, rows)
    out, self.state = E.decode_steps(self.params, self.state, tokens, active, limits, self.keys, generated,
                                     *settings, cfg=self.cfg, impl=self.impl, num_steps=n)
    for step in np.asarray(out):
        for b in rows:
            if slots[b] is not None:
                yield from self._emit(slots, b, int(step[b]), results)


def looped_host_decode(self, slots, rows, results, admit_after_one: bool = False):
    """Today's loop without overlap (bursts follow each other in one call) but with host arrays for every input,
    the next burst's tokens taken from the host copy of the last burst's output."""
    B, n = self.max_batch, self.steps_per_dispatch
    tokens, active = np.zeros(B, np.int32), np.zeros(B, bool)
    limits, generated = np.zeros(B, np.int32), np.zeros(B, np.int32)
    for b in rows:
        s = slots[b]
        tokens[b], active[b], generated[b] = s.tokens[-1], True, len(s.tokens)
        limits[b] = len(s.prompt) + s.sampling.max_tokens - 1
    settings = self._settings(slots, rows)
    while True:
        out, self.state = E.decode_steps(self.params, self.state, tokens, active, limits, self.keys, generated,
                                         *settings, cfg=self.cfg, impl=self.impl, num_steps=n)
        host = np.asarray(out)
        finished = False
        for step in host:
            for b in rows:
                if slots[b] is not None:
                    yield from self._emit(slots, b, int(step[b]), results)
                    finished |= slots[b] is None
        if finished or admit_after_one:
            return
        tokens, generated = np.maximum(host[-1], 0), generated + n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run (CPU)")
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    if args.tiny:
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 40), min(args.new_tokens, 12)
    log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    params = stack_layers(init_params(cfg, jax.random.key(1), args.weights), delete=True)
    jax.block_until_ready(params)
    prompt = [int(v) for v in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_tokens)]
    sampling = SamplingParams(max_tokens=args.new_tokens, seed=7)
    engine = E.Engine(cfg, params, max_batch=1, max_len=args.prompt_tokens + args.new_tokens + 8,
                      chunk_size=min(args.prompt_tokens, 8192), impl="pallas", steps_per_dispatch=1,
                      overlap_dispatch=False)
    loops = {"current": E.Engine._decode, "per_burst": per_burst_decode, "looped_host": looped_host_decode}
    ms = {name: [] for name in loops}
    tokens = {}
    try:
        for i in range(args.repeats + 1):  # round 0 compiles and warms up
            for name, fn in loops.items():
                E.Engine._decode = fn
                t = time.time()
                done = engine.generate([prompt], sampling)[0]
                if i:
                    ms[name].append(done.decode_ms_per_token)
                tokens[name] = done.tokens
                log(f"round {i} {name}: {done.decode_ms_per_token:.3f} ms/token ({time.time() - t:.1f}s)")
    finally:
        E.Engine._decode = loops["current"]
    for name, values in ms.items():
        log(f"{name}: median {statistics.median(values):.3f} ms/token ({', '.join(f'{v:.3f}' for v in values)})")
    same = all(t == tokens["current"] for t in tokens.values())
    log(f"same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
