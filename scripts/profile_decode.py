"""Where a decode step's time goes: a device trace of the jitted Flint decode step, kernels grouped by name.

Builds the full-shape model with synthetic weights (as `bench_decode.py` does), compiles the decode forward for one
(weights, impl, batch, context), runs a few steps under `jax.profiler.trace`, and reads the GPU kernel events back
from the Perfetto trace: per kernel name the launches per step, the mean and total microseconds, and the share of
the step; plus the step's wall time against the sum of its kernel times (the rest is launch gaps).

    python scripts/profile_decode.py --out /tmp/prof --weights nvfp4 --impl pallas --context 8192
    python scripts/profile_decode.py --tiny --out /tmp/prof      # CPU smoke run (no GPU events: says so)

`--variants base,prefetch,...` profiles the Pallas step once per variant: a variant sets kernel-module knobs that
are read at trace time (VARIANTS below), so each kernel's time is compared inside the whole step, with the same
data and the same cache state, rather than in an isolated micro-benchmark.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_decode import count_kernels, log, make_steps, random_state, time_steps  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.params import init_params  # noqa: E402


def _variants():
    from flint_jax.pallas_kernels import decode_attention as DA
    from flint_jax.pallas_kernels import gemv as G
    from flint_jax.pallas_kernels import moe_experts as ME
    return {
        "base": [],
        "prefetch": [(G, "TABLE_PREFETCH", True), (ME, "GATE_UP_BLOCK", (8, 512, 4, 3, False, True))],
        "bk1024": [(G, "TABLE_BK", 1024), (ME, "GATE_UP_BLOCK", (8, 1024, 4, 3))],
        "moe_bn16": [(ME, "GATE_UP_BLOCK", (16, 512, 4, 3)), (ME, "DOWN_BLOCK", (16, 512, 4, 1))],
        "attn_bk128": [(DA, "BLOCK_K", 128)],
        "attn_warps8": [(DA, "NUM_WARPS", 8)],
        "attn_splits64": [(DA, "MAX_SPLITS", 64)],
        "ring_splits4": [(DA, "RING_SPLITS", 4)],
        "combine_kernel": [(DA, "COMBINE_IN_KERNEL", False)],
    }


class variant:
    """Context manager: set a variant's module attributes, restore them on exit."""

    def __init__(self, name: str):
        table = _variants()
        if name not in table:
            raise SystemExit(f"unknown variant {name!r}; known: {', '.join(table)}")
        self.sets = table[name]

    def __enter__(self):
        self.old = [(m, a, getattr(m, a)) for m, a, _ in self.sets]
        for m, a, v in self.sets:
            setattr(m, a, v)

    def __exit__(self, *exc):
        for m, a, v in self.old:
            setattr(m, a, v)


def kernel_events(trace_dir: str) -> list[dict]:
    """Complete events ('X') of the device's processes in the newest perfetto trace under trace_dir."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if re.search(r"/device:(GPU|gpu)", n)}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in device_pids}
    # Kernels sit on the "Stream #..." threads; "XLA Ops"/"XLA Modules" threads repeat them at op level.
    streams = {k for k, n in threads.items() if n.startswith("Stream")}
    log(f"device threads: {sorted(set(threads.values()))}")
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e
            and (not streams or (e["pid"], e.get("tid")) in streams)]


def summarize(events: list[dict], steps: int) -> dict:
    by_name = collections.defaultdict(list)
    for e in events:
        by_name[e["name"]].append(float(e["dur"]))
    total = sum(sum(v) for v in by_name.values())
    rows = []
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        rows.append({"name": name, "per_step": len(durs) / steps, "mean_us": sum(durs) / len(durs),
                     "us_per_step": sum(durs) / steps, "share": sum(durs) / total if total else 0.0})
    return {"kernel_us_per_step": total / steps, "launches_per_step": len(events) / steps, "rows": rows}


def short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run")
    ap.add_argument("--weights", default="nvfp4", help="comma list: nvfp4,bf16")
    ap.add_argument("--impls", default="pallas", help="comma list: pallas,xla")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default="base", help="comma list of kernel-knob variants (pallas impl only): "
                    + ", ".join(_variants()))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    context = min(args.context, 100) if args.tiny else args.context
    report = {"device": jax.devices()[0].device_kind, "batch": args.batch, "context": context, "runs": []}
    md = [f"Device {report['device']}, batch {args.batch}, context {context}, {args.steps} traced steps.", ""]
    for weights in args.weights.split(","):
        params = init_params(cfg, jax.random.key(1), weights)
        jax.block_until_ready(params)
        runs = [(impl, v) for impl in args.impls.split(",")
                for v in (args.variants.split(",") if impl == "pallas" else ["base"])]
        for impl, vname in runs:
            tag = f"{weights}/{impl}" + ("" if vname == "base" else f" [{vname}]")
            try:
                with variant(vname):
                    forward, _ = make_steps(cfg, impl)
                    state = random_state(cfg, args.batch, context + 8, context, jax.random.key(2))
                    tokens = jnp.arange(args.batch, dtype=jnp.int32) + 7
                    t = time.time()
                    compiled = forward.lower(params, state, tokens, state.lengths).compile()
                    kernels = count_kernels(compiled)
                    log(f"{tag}: compiled in {time.time() - t:.1f}s, {kernels} kernel-launching ops")
                    ms, state = time_steps(forward, params, state, tokens, (), 20, context)
                    log(f"{tag}: {ms:.3f} ms per step")
                    tdir = os.path.join(args.out, f"trace_{weights}_{impl}_{vname}")
                    lengths = jnp.full((args.batch,), context, jnp.int32)
                    with jax.profiler.trace(tdir, create_perfetto_trace=True):
                        out = None
                        for _ in range(args.steps):
                            out, state = forward(params, state, tokens, lengths)
                        jax.block_until_ready(out)
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
                log(f"{tag}: failed: {type(e).__name__}: {str(e)[:500]}")
                md += [f"## {tag}: failed: {type(e).__name__}: {str(e)[:300]}", ""]
                continue
            try:
                s = summarize(kernel_events(tdir), args.steps)
            except (FileNotFoundError, KeyError, ValueError) as e:
                log(f"no device events read: {e}")
                s = {"kernel_us_per_step": 0.0, "launches_per_step": 0, "rows": []}
            s.update(weights=weights, impl=impl, variant=vname, step_ms=ms, kernels=kernels)
            report["runs"].append(s)
            md += [f"## {tag}: {ms:.3f} ms per step, {kernels} kernel-launching ops in the program; "
                   f"trace: {s['launches_per_step']:.0f} kernels per step, {s['kernel_us_per_step']:.0f} us of "
                   f"kernel time per step ({100 * s['kernel_us_per_step'] / 1e3 / ms:.0f}% of the step)", "",
                   "| kernel | per step | mean us | us per step | share |", "|---|---|---|---|---|"]
            for r in s["rows"][:25]:
                md.append(f"| `{short(r['name'])}` | {r['per_step']:.0f} | {r['mean_us']:.1f} | "
                          f"{r['us_per_step']:.0f} | {100 * r['share']:.1f}% |")
            md.append("")
            top = ", ".join(f"{r['name'][:28]} {r['us_per_step']:.0f}" for r in s["rows"][:8])
            log(f"{tag}: top kernels (us/step): {top}")
            with open(os.path.join(args.out, "profile.json"), "w") as f:
                json.dump(report, f, indent=1)
            with open(os.path.join(args.out, "profile.md"), "w") as f:
                f.write("\n".join(md) + "\n")
            del state
        del params
    return 0


if __name__ == "__main__":
    sys.exit(main())
