"""A/B of the engine's decode loop: do command-buffer (CUDA graph) updates explain its host overhead?

XLA replays a jitted program's recorded command buffer while every buffer it uses keeps its device address, and
updates it when one moves. This times `Engine.generate` at one step per dispatch with the decode loop swapped
between calls of one engine (so only the loop differs):

* per_burst: one burst per `_decode` call, every input a fresh host array (the loop of run BY's winner);
* looped_host: bursts back to back in one call, host arrays, the last output still referenced at each dispatch;
* looped_drop: the same, the last output dropped before each dispatch;
* overlap_host: the loop before decode_burst with overlap (each burst dispatched before the last is read, its
  tokens passed as a device slice, `generated` as a host array);
* fixed / fixed_overlap: today's `Engine._decode` (`decode_burst`: the settings uploaded once, two token buffers
  taking turns on the device), without and with overlap.

Run with XLA's command-buffer log on and the log in a file, then summarise it per variant:

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \\
        python scripts/ab_decode_loop.py --repeats 3 2> /tmp/ab.log
    python scripts/ab_decode_loop.py --summarize /tmp/ab.log

Temporary: it answers one question (docs/DECODE_PATH.md, "Host overhead"), then goes.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MARK = "@@ab_variant "


def summarize(path: str) -> int:
    """Per variant marker in the log: command-buffer updates, their total and median us, executions."""
    name, stats = None, {}
    upd = re.compile(r"Updated command buffer in (\d+) ")
    upd_s = re.compile(r"updated command buffer in ([0-9.e-]+) sec")
    with open(path, errors="replace") as f:
        for line in f:
            if MARK in line:
                name = line.split(MARK, 1)[1].strip()
                stats.setdefault(name, {"updates": [], "executions": 0})
                continue
            if name is None:
                continue
            m = upd.search(line)
            us = float(m.group(1)) if m else None
            if us is None:
                m = upd_s.search(line)
                us = float(m.group(1)) * 1e6 if m else None
            if us is not None:
                stats[name]["updates"].append(us)
            elif "Execute command buffer" in line:
                stats[name]["executions"] += 1
    for name, st in stats.items():
        u = st["updates"]
        print(f"{name}: {len(u)} updates ({sum(u) / 1e3:.1f} ms, median {statistics.median(u) if u else 0:.0f} us),"
              f" {st['executions']} command-buffer executions")
    return 0


def mark(name: str) -> None:
    sys.stderr.flush()
    os.write(2, f"{MARK}{name}\n".encode())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summarize", metavar="LOG", help="summarise a log written by a run (no run)")
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run (CPU)")
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", help="comma-separated subset of the loops (default: all)")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    import flint_jax  # noqa: F401  (XLA flags before JAX starts)
    import jax
    import numpy as np

    from bench_decode import log
    from flint_jax import engine as E
    from flint_jax.config import FlintConfig
    from flint_jax.layer_stack import stack_layers
    from flint_jax.params import init_params
    from flint_jax.sampling import SamplingParams

    def host_inputs(self, slots, rows):
        B = self.max_batch
        tokens, active = np.zeros(B, np.int32), np.zeros(B, bool)
        limits, generated = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for b in rows:
            s = slots[b]
            tokens[b], active[b], generated[b] = s.tokens[-1], True, len(s.tokens)
            limits[b] = len(s.prompt) + s.sampling.max_tokens - 1
        return tokens, active, limits, generated, self._settings(slots, rows)

    def emit(self, slots, rows, results, out):
        finished = False
        for step in np.asarray(out):
            for b in rows:
                if slots[b] is not None:
                    yield from self._emit(slots, b, int(step[b]), results)
                    finished |= slots[b] is None
        return finished

    def per_burst(self, slots, rows, results, admit_after_one=False):
        tokens, active, limits, generated, settings = host_inputs(self, slots, rows)
        out, self.state = E.decode_steps(self.params, self.state, tokens, active, limits, self.keys, generated,
                                         *settings, cfg=self.cfg, impl=self.impl, num_steps=self.steps_per_dispatch)
        yield from emit(self, slots, rows, results, out)

    def looped(drop: bool):
        def loop(self, slots, rows, results, admit_after_one=False):
            tokens, active, limits, generated, settings = host_inputs(self, slots, rows)
            n = self.steps_per_dispatch
            out = None
            while True:
                if drop:
                    out = None
                out, self.state = E.decode_steps(self.params, self.state, tokens, active, limits, self.keys,
                                                 generated, *settings, cfg=self.cfg, impl=self.impl, num_steps=n)
                host = np.asarray(out)
                if (yield from emit(self, slots, rows, results, host)) or admit_after_one:
                    return
                tokens, generated = np.maximum(host[-1], 0), generated + n
        return loop

    def overlap_host(self, slots, rows, results, admit_after_one=False):
        tokens, active, limits, generated, settings = host_inputs(self, slots, rows)
        n = self.steps_per_dispatch

        def dispatch(tokens, generated):
            out, self.state = E.decode_steps(self.params, self.state, tokens, active, limits, self.keys, generated,
                                             *settings, cfg=self.cfg, impl=self.impl, num_steps=n)
            return out

        out = dispatch(tokens, generated)
        while True:
            generated = generated + n
            ahead = dispatch(out[-1], generated)
            if (yield from emit(self, slots, rows, results, out)):
                yield from emit(self, slots, rows, results, ahead)
                return
            out = ahead

    current = E.Engine._decode
    # name -> (decode loop, overlap_dispatch)
    loops = {"per_burst": (per_burst, False), "looped_host": (looped(False), False),
             "looped_drop": (looped(True), False), "overlap_host": (overlap_host, True),
             "fixed": (current, False), "fixed_overlap": (current, True)}

    if args.variants:
        unknown = set(args.variants.split(",")) - set(loops)
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(loops)}")
        loops = {k: v for k, v in loops.items() if k in args.variants.split(",")}
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    if args.tiny:
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 40), min(args.new_tokens, 12)
    log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    params = stack_layers(init_params(cfg, jax.random.key(1), args.weights), delete=True)
    jax.block_until_ready(params)
    prompt = [int(v) for v in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_tokens)]
    sampling = SamplingParams(max_tokens=args.new_tokens, seed=7)
    engine = E.Engine(cfg, params, max_batch=1, max_len=args.prompt_tokens + args.new_tokens + 8,
                      chunk_size=min(args.prompt_tokens, 8192), impl="pallas", steps_per_dispatch=1)
    ms = {name: [] for name in loops}
    tokens = {}
    try:
        for i in range(args.repeats + 1):  # round 0 compiles and warms up
            for name, (fn, overlap) in loops.items():
                E.Engine._decode, engine.overlap_dispatch = fn, overlap
                mark(f"{name} round {i}")
                t = time.time()
                done = engine.generate([prompt], sampling)[0]
                mark("between")
                if i:
                    ms[name].append(done.decode_ms_per_token)
                tokens[name] = done.tokens
                log(f"round {i} {name}: {done.decode_ms_per_token:.3f} ms/token ({time.time() - t:.1f}s)")
    finally:
        E.Engine._decode = current
    for name, values in ms.items():
        log(f"{name}: median {statistics.median(values):.3f} ms/token ({', '.join(f'{v:.3f}' for v in values)})")
    same = all(t == next(iter(tokens.values())) for t in tokens.values())
    log(f"same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
