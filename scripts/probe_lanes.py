"""Probe: do independent decode chains overlap on the device, and does that beat one batched chain?

At batch 1 every kernel of the decode step waits on the one before it, and the step is a chain of ~345 latency-bound
kernels (docs/DECODE_PATH.md). A batch of B sequences runs the same chain with B rows per kernel. The alternative
measured here: B *lanes*, each a batch-1 decode step over its own KV state, in one jitted program. The lanes share
only the (read-only) weights, so XLA's command buffer may run their kernels side by side
(`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT` builds the CUDA graph from data dependencies), and a weight
tile one lane has just read may still be in L2 for the other.

Variants (comma list): `b<N>` the batched step at batch N; `lanes<N>` N batch-1 steps in one program; `slanes<N>`
the same with lane i > 0 on its own XLA stream (`jax.experimental.compute_on("gpu_stream:i")`). The lanes start
from the rows of the batched variant's state, so each lanes variant also reports its largest difference from the
b<N> variant's hidden states when that ran first (`max_abs_diff_vs_batched`: 0 in interpret mode on the tiny config).
Results: docs/BENCHMARKS.md, runs ED-EE (with XLA's default scheduling the lanes run one after the other; with
CONCURRENT they overlap but the graph's cross-stream edges cost more than the overlap saves). Run the script
once per scheduling mode (the flag must be set before JAX starts):

    python scripts/probe_lanes.py --out $OUT/lanes --context 8192 --variants b1,b2,lanes2
    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT python scripts/probe_lanes.py ...
    python scripts/probe_lanes.py --tiny --out /tmp/lanes           # CPU smoke run (no device events)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode import count_kernels, log, make_steps, random_state, time_steps, trace_steps  # noqa: E402
from flint_jax import device_trace  # noqa: E402
from flint_jax import model as M  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402


def lanes_step(cfg: FlintConfig, impl: str, streams: bool = False):
    """fn(params, states, tokens [N], lengths [N]) -> ([N, H], states): N independent batch-1 forwards.
    streams: lane i > 0 runs on XLA stream i (`compute_on("gpu_stream:i")`, an explicit stream annotation)."""
    def lane(params, state, token, length):
        state = dataclasses.replace(state, lengths=length)
        h, state = M.model_step(params, state, token[:, None], jnp.ones((1,), jnp.int32), cfg, impl=impl)
        return h[:, 0], state

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, states, tokens, lengths):
        hs, out = [], []
        for i, state in enumerate(states):
            run = lane
            if streams and i:
                from jax.experimental.compute_on import compute_on
                run = compute_on(lane, compute_type=f"gpu_stream:{i}", out_memory_spaces=jax.memory.Space.Device)
            h, state = run(params, state, tokens[i:i + 1], lengths[i:i + 1])
            hs.append(h)
            out.append(state)
        return jnp.concatenate(hs), tuple(out)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run")
    ap.add_argument("--weights", default="nvfp4")
    ap.add_argument("--impl", default="pallas")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default="b1,b2,lanes2")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    context = min(args.context, 100) if args.tiny else args.context
    mode = os.environ.get("XLA_FLAGS", "")
    report = {"device": jax.devices()[0].device_kind, "context": context, "xla_flags": mode, "runs": []}
    variants = args.variants.split(",")
    parsed = {v: re.fullmatch(r"(b|lanes|slanes)([1-8])", v) for v in variants}
    bad = [v for v, m in parsed.items() if m is None]
    if bad:
        ap.error(f"unknown variants {bad}: b<N>, lanes<N> or slanes<N> with N in 1..8")
    params = init_params(cfg, jax.random.key(1), args.weights)
    jax.block_until_ready(params)
    batched = {}  # N -> the b<N> step's hidden states, to check the lanes against
    for v in variants:
        kind, n = parsed[v].group(1), int(parsed[v].group(2))
        # the lanes get the rows of the same batched state, so every variant with N sequences computes the same
        state = random_state(cfg, n, context + 8, context, jax.random.key(2))
        if kind == "b":
            step = make_steps(cfg, args.impl)[0]
        else:
            step = lanes_step(cfg, args.impl, streams=kind == "slanes")
            state = tuple(jax.tree.map(lambda a, i=i: a[i:i + 1], state) for i in range(n))
        tokens = jnp.arange(n, dtype=jnp.int32) + 7
        lengths = jnp.full((n,), context, jnp.int32)
        t = time.time()
        compiled = step.lower(params, state, tokens, lengths).compile()
        kernels = count_kernels(compiled)
        log(f"{v}: compiled in {time.time() - t:.1f}s, {kernels} kernel-launching ops")
        h, state = compiled(params, state, tokens, lengths)  # every call restarts at `context`: the same h each time
        h = np.asarray(h, np.float32)
        check = {}
        if kind == "b":
            batched[n] = h
        elif n in batched:  # batch-1 kernels against batch-n ones: the same math, other tile sums
            check = {"max_abs_diff_vs_batched": float(np.abs(h - batched[n]).max()),
                     "batched_max_abs": float(np.abs(batched[n]).max())}
        ms, state = time_steps(compiled, params, state, tokens, (), 20, context)
        events, state = trace_steps(compiled, params, state, tokens, (), context,
                                    os.path.join(args.out, f"trace_{v}"), args.steps)
        dev = device_trace.device_ms(events, args.steps)
        busy = (statistics.median(device_trace.step_busy_ms(events, args.steps))
                if events and len(events) % args.steps == 0 else None)
        streams = len({e.get("tid") for e in events})
        row = {"variant": v, "sequences": n, "wall_ms": ms, "device_ms": dev, "busy_ms": busy,
               "kernels_per_step": len(events) / args.steps if events else None, "streams": streams, **check}
        report["runs"].append(row)
        log(f"{v}: {json.dumps(row)}")
        with open(os.path.join(args.out, "lanes.json"), "w") as f:
            json.dump(report, f, indent=1)
        del state
    return 0


if __name__ == "__main__":
    sys.exit(main())
