"""Served decode as a user of the engine sees it: `Engine.generate` ms per output token, host included.

`bench_decode.py` times the jitted step back to back (device time, and wall time with JAX's asynchronous dispatch
overlapping the host and the device); the engine also reads every burst's tokens back to the host to stream and
stop requests. This script runs `Engine.generate` on one prompt at the Flint shape with synthetic weights
(`--tiny`: FlintConfig.tiny() on the CPU, a smoke run) for each (steps per dispatch, overlap_dispatch, parameter
layout) variant and reports the completion's decode ms/token (first to last token, wall clock) and TTFT, median
over `--repeats`.
No stop tokens: every request runs to `--new-tokens`.

    python scripts/bench_engine.py --out DIR [--weights nvfp4] [--prompt-tokens 8192] [--new-tokens 128]
                                   [--variants 1:off,1:off:stacked,4:on:stacked] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The benchmark owns the GPU: let JAX take 92% of its memory rather than 75%. Flint's BF16 weights are 80 GB, and
# stacking them (layer_stack, one chunk at a time) ran out of memory on the H200 at 75% (runs BT, BU).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode import log  # noqa: E402
from flint_jax import device_trace  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.engine import Engine  # noqa: E402
from flint_jax.layer_stack import StackedParams  # noqa: E402
from flint_jax.pallas_path import engine_layout  # noqa: E402
from flint_jax.params import init_params  # noqa: E402
from flint_jax.device_memory import model_shortfall  # noqa: E402
from flint_jax.sampling import SamplingParams  # noqa: E402


def parse_variants(text: str) -> list[tuple[int, bool, str]]:
    """"1:off,4:on:stacked" -> [(1, False, "layers"), (4, True, "stacked")]: steps per dispatch, overlap_dispatch,
    and the layout: per-layer arrays, the layers' parameters stacked (flint_jax.layer_stack), or the KV caches
    stacked too (`Engine(stacked_caches=True)`)."""
    out = []
    for item in text.split(","):
        steps, overlap, *rest = item.split(":")
        layout = rest[0] if rest else "layers"
        if not steps.isdigit() or int(steps) < 1 or overlap not in ("on", "off") or len(rest) > 1 \
                or layout not in ("layers", "stacked", "stacked_caches"):
            raise SystemExit(f"bench_engine: bad variant {item!r} (want STEPS:on|off[:layers|stacked|stacked_caches]"
                             ", e.g. 4:on or 1:off:stacked)")
        out.append((int(steps), overlap == "on", layout))
    return out


def trace_summary(t: dict, marker: str) -> str:
    """One line on a variant's traced decode steps (device_trace.marker_periods)."""
    if not t["periods"]:
        return f"no kernel named *{marker}* twice in the trace (no device trace on a CPU, or another sampler)"
    return (f"{t['periods']} decode steps, median {t['period_us']:.1f} us per step between {marker} launches, "
            f"{t['kernels']:.0f} kernels, busy {t['busy_us']:.1f} us, idle {t['idle_us']:.1f} us, of which "
            f"{t['first_gap_us']:.1f} before the step's first kernel (medians)")


def log_trace(t: dict, marker: str) -> None:
    log(f"  trace: {trace_summary(t, marker)}")
    for g in t.get("gaps", [])[:8]:
        log(f"    idle before {g['name']}: {g['idle_us_per_period']:.1f} us per step ({g['gaps_per_period']:.2f} "
            f"gaps of {g['mean_us']:.1f} us)")


def by_kernel(entries: list[dict], count: str, us: str) -> list[tuple[str, float, float]]:
    """Entries of a trace table summed over the instances of one kernel: XLA names the launches of one Pallas kernel
    in a program `name`, `name__1`, `name__2`, ... -> [(name, summed count, summed us)], most us first."""
    out: dict = {}
    for e in entries:
        base = re.sub(r"__\d+$", "", e["name"])
        n, t = out.get(base, (0.0, 0.0))
        out[base] = (n + e[count], t + e[us])
    return sorted(((k, n, t) for k, (n, t) in out.items()), key=lambda r: -r[2])


def trace_lines(rows: list[dict], marker: str) -> list[str]:
    """Markdown for the traced variants: per decode step on the device, the idle gaps and the kernel table, each
    summed over a kernel's instances."""
    out = []
    for r in rows:
        t = r.get("trace")
        if not t or not t["periods"]:
            continue
        out += ["", f"Device trace, {r['steps_per_dispatch']} steps per dispatch, overlap "
                    f"{'on' if r['overlap_dispatch'] else 'off'}: {trace_summary(t, marker)}; per step over all "
                    f"steps (means):", "",
                "| idle before | gaps per step | idle us per step |", "|---|---|---|"]
        out += [f"| `{name}` | {n:.2f} | {us:.1f} |"
                for name, n, us in by_kernel(t["gaps"], "gaps_per_period", "idle_us_per_period")[:10]]
        out += ["", "| kernel | launches per step | us per step |", "|---|---|---|"]
        out += [f"| `{name}` | {n:.2f} | {us:.1f} |" for name, n, us in by_kernel(t["rows"], "per_step", "us_per_step")]
    return out


def write_report(args, dev, rows: list[dict]) -> list[str]:
    """engine.json and engine.md under args.out (rewritten after every variant, so a run stopped by a time limit keeps
    what it measured); returns the Markdown lines."""
    report = {"device": dev.device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
              "config": "tiny" if args.tiny else "flint", "weights": args.weights, "impl": args.impl,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows}
    with open(os.path.join(args.out, "engine.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"Engine.generate, batch 1, {args.weights}/{args.impl}, prompt {args.prompt_tokens} tokens, "
             f"{args.new_tokens} new tokens, {report['config']} config, {dev.device_kind}, {report['date']}.", "",
             "| steps per dispatch | overlap_dispatch | parameters | argument buffers | decode ms/token (wall) "
             "| TTFT s | tokens as the first row |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['steps_per_dispatch']} | {'on' if r['overlap_dispatch'] else 'off'} | {r['layout']} | "
              f"{r['argument_buffers']} | "
              f"{r['decode_ms_per_token']:.3f} | {r['ttft_s']:.3f} | {'yes' if r['same_tokens_as_first'] else 'no'} |"
              for r in rows]
    lines += trace_lines(rows, args.trace_marker)
    with open(os.path.join(args.out, "engine.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for engine.json and engine.md")
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run (CPU)")
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--impl", default="pallas", choices=("xla", "pallas"))
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variants", default="1:off,1:off:stacked,4:on:stacked",
                    help="STEPS:on|off[:layers|stacked|stacked_caches]: steps per dispatch, overlap_dispatch, "
                         "layout (per-layer variants run first; the parameters are then stacked in place; "
                         "stacked_caches also stacks the KV caches)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace", action="store_true",
                    help="also run one generate per variant under the profiler and report, per decode step on the "
                         "device (between launches of --trace-marker): kernels, busy and idle us, the idle gaps by "
                         "the kernel that ends them (GPU only; traces under OUT/traces)")
    ap.add_argument("--trace-marker", default="top_k_sample",
                    help="a kernel launched once per decode step (substring of its name); default: the top-k "
                         "sampler of the Pallas path")
    args = ap.parse_args(argv)
    # per-layer first: stacking consumes them
    variants = sorted(parse_variants(args.variants), key=lambda v: v[2] != "layers")
    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    if args.tiny:
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 40), min(args.new_tokens, 12)
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    max_len = args.prompt_tokens + args.new_tokens + 8
    why = model_shortfall(cfg, args.weights, batch=1, max_len=max_len,
                          stacking=any(layout != "layers" for _, _, layout in variants))
    if why:  # e.g. BF16 Flint on an H100: say so now, not as an XLA allocation failure minutes later
        raise SystemExit(f"bench_engine: {why}")
    t = time.time()
    params = init_params(cfg, jax.random.key(1), args.weights)
    jax.block_until_ready(params)
    log(f"{args.weights}: synthetic params built in {time.time() - t:.1f}s")
    prompt = [int(v) for v in np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_tokens)]
    sampling = SamplingParams(max_tokens=args.new_tokens, seed=7)  # the defaults 1.0 / 0.95 / 20, no stop tokens
    rows, tokens_seen = [], None
    for steps, overlap, layout in variants:
        if layout != "layers" and not isinstance(params, StackedParams):
            t = time.time()
            params = engine_layout(params, delete=True)
            jax.block_until_ready(params)
            log(f"layers stacked: {len(params.stacks)} stacks in {time.time() - t:.1f}s")
        engine = Engine(cfg, params, max_batch=1, max_len=max_len, chunk_size=min(args.prompt_tokens, 8192),
                        impl=args.impl, steps_per_dispatch=steps, overlap_dispatch=overlap,
                        stacked_caches=layout == "stacked_caches")
        t = time.time()
        engine.generate([prompt], SamplingParams(max_tokens=2 * steps + 1, seed=7))  # compiles prefill and decode
        log(f"{steps} steps per dispatch, overlap {'on' if overlap else 'off'}, {layout}: warm-up "
            f"{time.time() - t:.1f}s")
        ms, ttft, same = [], [], True
        for _ in range(args.repeats):
            done = engine.generate([prompt], sampling)[0]
            if len(done.tokens) != args.new_tokens:
                raise SystemExit(f"bench_engine: {len(done.tokens)} tokens generated, expected {args.new_tokens}")
            tokens_seen = tokens_seen or done.tokens
            # overlap_dispatch never changes the tokens; another burst length is another compiled program, whose
            # floating-point results (hence samples) may differ on the GPU, so this is recorded, not enforced
            same &= done.tokens == tokens_seen
            ms.append(done.decode_ms_per_token)
            ttft.append(done.ttft_s)
        row = {"steps_per_dispatch": steps, "overlap_dispatch": overlap, "layout": layout,
               "argument_buffers": len(jax.tree.leaves(params)) + len(jax.tree.leaves(engine.state)),
               "decode_ms_per_token": statistics.median(ms),
               "decode_ms_per_token_all": ms, "ttft_s": statistics.median(ttft), "same_tokens_as_first": same,
               "tokens": done.tokens}
        log(f"  decode {row['decode_ms_per_token']:.3f} ms/token (runs {', '.join(f'{v:.3f}' for v in ms)}), "
            f"TTFT {row['ttft_s']:.3f} s")
        if args.trace:
            tdir = os.path.join(args.out, "traces", f"{steps}_{'on' if overlap else 'off'}_{layout}")
            events = device_trace.trace_kernels(lambda: engine.generate([prompt], sampling), tdir)
            row["trace"] = device_trace.marker_periods(events, args.trace_marker, top=1000)
            log_trace(row["trace"], args.trace_marker)
        rows.append(row)
        del engine
        write_report(args, dev, rows)
    print("\n".join(write_report(args, dev, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
