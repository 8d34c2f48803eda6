"""Decode benchmark at the Flint shape: model forward and served ms/token for both impls, against the roofline.

Builds `FlintConfig.flint()` with synthetic weights directly on the device (no checkpoint file), fills the KV state
to the requested context with random values, and times the jitted decode step: on the device (a profiler trace of
five steps, flint_jax.device_trace; the headline) and by the wall clock. For each point it reports ms, the
bytes a step must read (active weights + KV, from the config), the achieved fraction of the HBM bandwidth measured
in the same run, and the kernels launched per step (from the trace). At batch 1 and the first context it also
times the served step (forward + LM head + sampling) and the engine's multi-step decode (`--served-steps`).
Writes results.json, results.md (every point, then a summary shaped like vLLM's: initial = impl "xla",
optimized = impl "pallas", per checkpoint) and latency_vs_context.png (forward latency with the roofline).

    python scripts/bench_decode.py --out results/            # the full GPU run (one H200)
    python scripts/bench_decode.py --tiny --out /tmp/bench   # CPU smoke test of the same code path

One compiled program serves every context for a given (weights, impl, batch): the state is allocated for the
largest context and only `lengths` changes. The Pallas path skips cache blocks beyond each sequence's length; the
XLA reference reads the whole allocation, so its points are taken with an allocation sized to the context.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The benchmark owns the GPU: let JAX take 92% of its memory rather than 75%. Flint's BF16 weights are 80 GB, and
# stacking them (layer_stack, one chunk at a time) ran out of memory on the H200 at 75% (runs BT, BU).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from flint_jax import device_trace  # noqa: E402
from flint_jax.device_memory import model_shortfall  # noqa: E402
from flint_jax import engine as E  # noqa: E402
from flint_jax import model as M  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.layer_stack import StackedParams  # noqa: E402
from flint_jax.pallas_path import engine_layout  # noqa: E402
from flint_jax.params import init_params, weight_bytes_per_token  # noqa: E402
from flint_jax.state import (KV_DTYPES, FullCache, KVState, RingCache, kv_bytes_read, kv_dtype_of,  # noqa: E402
                             stack_caches, to_cache_values, values_transposed)

VLLM_GB200 = {"nvfp4_forward_ms": 1.78, "bf16_forward_ms": 2.34, "served_ms": 2.06, "kernels": 346,
              "prefill_8k_ms": 145}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- measurements --------------------------------------------------------------------------------------------
def hbm_bandwidth(n_bytes: int = 4 << 30) -> dict:
    """Streaming bandwidth: a large read-only reduction, and a copy (read + write), in GB/s."""
    x = jax.random.uniform(jax.random.key(0), (n_bytes // 4,), jnp.float32)
    red = jax.jit(lambda a: jnp.sum(a))
    cpy = jax.jit(lambda a: a * 1.0001)
    out = {}
    for name, fn, moved in (("read", red, n_bytes), ("copy", cpy, 2 * n_bytes)):
        fn(x).block_until_ready()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            fn(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        out[f"{name}_GBps"] = moved / statistics.median(ts) / 1e9
    del x
    return out


def count_kernels(compiled) -> int:
    """Kernel-launching instructions in the compiled program's entry computation (fusions, custom calls such as
    Pallas kernels, library calls); parameters, tuples, bitcasts and constants launch nothing."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[: entry.index("\n}\n")] if "\n}\n" in entry else entry
    skip = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
            "replica-id"}
    n = 0
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*[^ ]+(?:\{[^}]*\})?\s+([a-z\-]+)\(", line)
        if m and m.group(1) not in skip:
            n += 1
    return n


@functools.partial(jax.jit, static_argnums=(1,))
def _normal_bf16(key, shape):
    return jax.random.normal(key, shape, jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal_cache(key, shape, dtype):
    return to_cache_values(jax.random.normal(key, shape, jnp.bfloat16), dtype)


def random_state(cfg: FlintConfig, batch: int, max_len: int, context: int, key, kv_dtype="bf16") -> KVState:
    """A state holding `context` tokens per sequence, with random K/V (never time on zeros); the full caches in
    `kv_dtype` (state.KV_DTYPES). One small program per cache shape, called per layer: a single jit over all 49
    layers took minutes to compile at batch 8 (run of 2026-11-29, 14:02), on the device's clock."""
    full_dtype = kv_dtype_of(kv_dtype)
    KV, D, W = cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    slot_pos = np.arange(W)
    # slot s holds the latest position p < context with p % W == s
    pos = context - 1 - ((context - 1 - slot_pos) % W)
    pos = np.ascontiguousarray(np.broadcast_to(np.where(pos >= 0, pos, -1).astype(np.int32), (batch, W)))
    layers = []
    for i in range(cfg.num_hidden_layers):
        key, k1, k2 = jax.random.split(key, 3)
        if cfg.is_sliding(i):
            shape = (batch, KV, W, D)
            # a buffer per layer: the step donates the state, and a buffer may be donated once
            layers.append(RingCache(_normal_bf16(k1, shape), _normal_bf16(k2, shape), jnp.array(pos)))
        else:
            shape = (batch, KV, max_len, D)
            v_shape = (batch, KV, D, max_len) if values_transposed(full_dtype) else shape  # FP8: V transposed
            layers.append(FullCache(_normal_cache(k1, shape, full_dtype), _normal_cache(k2, v_shape, full_dtype)))
    return KVState(tuple(layers), jnp.full((batch,), context, jnp.int32))


def make_steps(cfg: FlintConfig, impl: str):
    # Each step starts from `lengths` (the benchmark's context), so repeated steps all run at that context.
    @functools.partial(jax.jit, donate_argnums=(1,))
    def forward(params, state, tokens, lengths):
        state = dataclasses.replace(state, lengths=lengths)
        h, state = M.model_step(params, state, tokens[:, None], jnp.ones_like(tokens), cfg, impl=impl)
        return h[:, 0], state

    @functools.partial(jax.jit, donate_argnums=(1,))
    def served(params, state, tokens, lengths, keys):  # the engine's single step: forward + LM head + sampling
        state = dataclasses.replace(state, lengths=lengths)
        B = tokens.shape[0]
        return E.decode(params, state, tokens, jnp.ones(B, bool), keys, jnp.ones(B), jnp.full((B,), 20, jnp.int32),
                        jnp.full((B,), 0.95), cfg=cfg, impl=impl, sampler=E.decode_sampler(impl, [(1.0, 20)] * B))
    return forward, served


def make_burst(cfg: FlintConfig, impl: str, num_steps: int):
    """The engine's multi-step decode (engine.decode_steps: `num_steps` forwards + LM heads + samplings, each
    sampled token feeding the next step, one dispatch), restarted at `lengths` on every call like make_steps."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def burst(params, state, tokens, lengths, keys):
        state = dataclasses.replace(state, lengths=lengths)
        B = tokens.shape[0]
        out, state = E.decode_steps(params, state, tokens, jnp.ones(B, bool), jnp.full((B,), 1 << 30, jnp.int32),
                                    keys, jnp.zeros(B, jnp.int32), jnp.ones(B), jnp.full((B,), 20, jnp.int32),
                                    jnp.full((B,), 0.95), cfg=cfg, impl=impl, num_steps=num_steps,
                                    sampler=E.decode_sampler(impl, [(1.0, 20)] * B))
        return out, state
    return burst


def time_steps(step, params, state, tokens, extra, iters: int, context: int):
    """Median ms per step over `iters` steps enqueued back to back, each at `context` tokens."""
    lengths = jnp.full((tokens.shape[0],), context, jnp.int32)
    ts = []
    out = None
    for _ in range(3):  # warm-up
        out, state = step(params, state, tokens, lengths, *extra)
    jax.block_until_ready(out)
    reps = 5
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out, state = step(params, state, tokens, lengths, *extra)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters)
    return statistics.median(ts) * 1e3, state


def trace_steps(step, params, state, tokens, extra, context: int, trace_dir: str, steps: int = 5):
    """Run `steps` steps at `context` under the profiler: (their kernel events, the state)."""
    lengths = jnp.full((tokens.shape[0],), context, jnp.int32)
    box = [state]

    def run():
        out = None
        for _ in range(steps):
            out, box[0] = step(params, box[0], tokens, lengths, *extra)
        return out

    return device_trace.trace_kernels(run, trace_dir), box[0]


def device_time(step, params, state, tokens, extra, context: int, trace_dir: str, steps: int = 5):
    """Median device time per step (ms; None without device events), kernels launched per step (None likewise),
    the per-kernel summary (device_trace.summarize; None likewise) from a profiler trace of `steps` steps, and the
    state. The GPU-side figure: wall time also counts the host's dispatch when the host is slower."""
    events, state = trace_steps(step, params, state, tokens, extra, context, trace_dir, steps)
    shutil.rmtree(trace_dir, ignore_errors=True)  # a few MB per point; scripts/profile_decode.py keeps its traces
    if not events or len(events) % steps:
        return device_trace.device_ms(events, steps), None, None, state
    summary = device_trace.summarize(events, steps)
    summary["rows"] = summary["rows"][:25]
    return device_trace.device_ms(events, steps), len(events) // steps, summary, state


def expected_expert_fraction(cfg: FlintConfig, batch: int) -> float:
    """Expected fraction of routed experts a batch touches (independent uniform routing)."""
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    return 1 - (1 - k / E) ** batch


def bytes_per_step(cfg: FlintConfig, weights: str, batch: int, context: int, kv_dtype="bf16") -> int:
    one = weight_bytes_per_token(cfg, weights)
    if batch > 1:  # more distinct experts are read as the batch grows
        from flint_jax.params import weight_bytes_per_token as w
        full = w(cfg.replace(num_experts_per_tok=cfg.n_routed_experts), weights)
        routed_all = full - one
        frac1 = cfg.num_experts_per_tok / cfg.n_routed_experts
        routed_one = routed_all * frac1 / (1 - frac1)
        one = one - routed_one + (routed_all + routed_one) * expected_expert_fraction(cfg, batch)
    return int(one + batch * kv_bytes_read(cfg, context, kv_dtype))


# ---- main ----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for results.json and results.md")
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() smoke run (CPU)")
    ap.add_argument("--weights", default="nvfp4,bf16")
    ap.add_argument("--impls", default="xla,pallas:stacked",
                    help="impls in order; ':stacked' runs on the layers' parameters stacked (flint_jax.layer_stack, "
                         "done in place when first asked for: later entries run stacked too); ':stacked_caches' "
                         "also stacks the KV caches (state.StackedCaches)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--contexts", default="8192,32768,100000,262144")
    ap.add_argument("--xla-points", default="1:8192,1:100000",
                    help="batch:context points for the XLA reference (each compiles its own program)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--served-steps", type=int, default=4,
                    help="also time the engine's multi-step decode (this many steps per dispatch) at batch 1 and "
                         "the first context, Pallas only; 0 = skip")
    ap.add_argument("--max-kv-gb", type=float, default=40.0,
                    help="skip contexts over 100K at a batch whose full caches would take more (GB; batch 8 at 262K "
                         "needs 60 with NVFP4's 23 GB of weights, BF16's 80 GB leave no room for it)")
    ap.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPES),
                    help="element type of the full layers' KV caches (default: bf16; fp8: E4M3, see state.KV_DTYPES)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new points after this many seconds")
    args = ap.parse_args(argv)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)

    cfg = FlintConfig.tiny() if args.tiny else FlintConfig.flint()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        contexts = [min(c, cfg.max_position_embeddings - 8) for c in (16, 100, 400)]
        args.xla_points = "1:100"
        args.iters = 3
    xla_points = [tuple(int(v) for v in p.split(":")) for p in args.xla_points.split(",") if p]
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    results = {"device": dev.device_kind, "jax": jax.__version__, "config": "tiny" if args.tiny else "flint",
               "date": time.strftime("%Y-%m-%d"), "points": [], "skipped": []}
    results["hbm"] = hbm_bandwidth(256 << 20 if args.tiny else 4 << 30)
    peak = results["hbm"]["read_GBps"]
    log(f"HBM: read {peak:.0f} GB/s, copy {results['hbm']['copy_GBps']:.0f} GB/s")

    def over_budget():
        return time.time() - t_start > args.budget_s

    def skip(what: str, why: str, **where):
        log(f"{what}: skipped: {why}")
        results["skipped"].append({**where, "reason": why})

    stacking = any(":" in entry for entry in args.impls.split(","))
    for weights in args.weights.split(","):
        why = model_shortfall(cfg, weights, stacking=stacking)
        if why:  # e.g. BF16 Flint on an H100: say so now, not as an XLA allocation failure minutes later
            skip(weights, why, weights=weights)
            continue
        t = time.time()
        params = init_params(cfg, jax.random.key(1), weights)  # eager: one small program per leaf shape
        jax.block_until_ready(params)
        log(f"{weights}: synthetic params built in {time.time() - t:.1f}s")
        for entry in args.impls.split(","):
            impl, _, layout = entry.partition(":")
            if layout not in ("", "stacked", "stacked_caches") or impl not in ("xla", "pallas"):
                raise SystemExit(f"bench_decode: bad impl {entry!r} (want xla, pallas, or either with :stacked or "
                                 ":stacked_caches)")
            stacked_caches = layout == "stacked_caches"
            if layout and not isinstance(params, StackedParams):
                t = time.time()
                params = engine_layout(params, delete=True)
                jax.block_until_ready(params)
                log(f"{weights}: layers stacked into {len(params.stacks)} buffers in {time.time() - t:.1f}s")
            layout = ("stacked" if isinstance(params, StackedParams) else "layers") + ("+caches" if stacked_caches
                                                                                      else "")
            forward, served = make_steps(cfg, impl)
            if impl == "xla":
                plan = [(b, [c]) for b, c in xla_points]  # allocation sized to the context
            else:
                plan = [(b, contexts) for b in batches]
            for batch, ctxs in plan:
                if over_budget():
                    log("budget reached: stopping")
                    break
                max_len = max(ctxs) + 8
                kv_gb = batch * (len(cfg.full_layers) * max_len * 2 * cfg.num_key_value_heads * cfg.head_dim
                                 * kv_dtype_of(args.kv_dtype).itemsize) / 1e9
                if not args.tiny and kv_gb > args.max_kv_gb:
                    log(f"{weights}/{impl} B={batch}: the full caches for context {max(ctxs)} take {kv_gb:.0f} GB "
                        f"(> --max-kv-gb {args.max_kv_gb:g}): skipping the contexts over 100K")
                    ctxs = [c for c in ctxs if c <= 100_000]
                    if not ctxs:
                        continue
                    max_len = max(ctxs) + 8
                why = model_shortfall(cfg, weights, batch=batch, max_len=max_len, kv_dtype=args.kv_dtype)
                if why:
                    skip(f"{weights}/{impl} B={batch}", why, weights=weights, impl=impl, batch=batch)
                    continue
                state = random_state(cfg, batch, max_len, ctxs[0], jax.random.key(2), args.kv_dtype)
                if stacked_caches:
                    state = KVState(stack_caches(state.layers), state.lengths)
                tokens = jnp.arange(batch, dtype=jnp.int32) + 7
                keys = jax.random.split(jax.random.key(3), batch)
                t = time.time()
                lowered = forward.lower(params, state, tokens, state.lengths)
                compiled = lowered.compile()
                kernels = count_kernels(compiled)
                buffers = len(jax.tree.leaves(params)) + len(jax.tree.leaves(state))
                log(f"{weights}/{impl} ({layout}) B={batch}: compiled forward in {time.time() - t:.1f}s, "
                    f"{buffers} argument buffers")
                for ctx in ctxs:
                    if over_budget():
                        break
                    # The AOT executable itself: calling `forward` would compile the same program a second time.
                    fwd_ms, state = time_steps(compiled, params, state, tokens, (), args.iters, ctx)
                    # Every step at this context computes the same hidden states (it rewrites the same cache slot):
                    # their fingerprint tells whether two variants of one impl (parameter layouts) agree bit for bit.
                    h, state = compiled(params, state, tokens, jnp.full((batch,), ctx, jnp.int32))
                    fingerprint = hashlib.sha1(np.asarray(h).tobytes()).hexdigest()[:16]
                    same = [p["layout"] for p in results["points"]
                            if (p["weights"], p["impl"], p["batch"], p["context"]) == (weights, impl, batch, ctx)
                            and p.get("output_sha1") == fingerprint]
                    log(f"  ctx {ctx:>6}: output {fingerprint}" + (f", the same as {same}" if same else ""))
                    tdir = os.path.join(args.out, "traces", f"{weights}_{impl}_b{batch}_{ctx}")
                    dev_ms, launched, summary, state = device_time(compiled, params, state, tokens, (), ctx, tdir)
                    point = {"weights": weights, "impl": impl, "layout": layout, "argument_buffers": buffers,
                             "kv_dtype": args.kv_dtype,
                             "output_sha1": fingerprint,
                             "batch": batch, "context": ctx,
                             "forward_wall_ms": fwd_ms, "forward_device_ms": dev_ms,
                             # launched per step in the trace where there is one; else the compiled program's
                             # entry instructions (an undercount: command-buffer calls hide their kernels)
                             "kernels": launched if launched is not None else kernels,
                             "kernels_source": "trace" if launched is not None else "hlo_entry",
                             "bytes": bytes_per_step(cfg, weights, batch, ctx, args.kv_dtype),
                             "kernel_summary": summary}
                    # The headline is the device time (the GPU's work per step); wall time where no trace.
                    point["forward_ms"] = dev_ms if dev_ms is not None else fwd_ms
                    point["roofline_ms"] = point["bytes"] / (peak * 1e9) * 1e3
                    point["hbm_fraction"] = point["roofline_ms"] / point["forward_ms"]
                    if batch == 1 and ctx in (100_000, max(ctxs)):
                        srv_ms, state = time_steps(served, params, state, tokens, (keys,), args.iters, ctx)
                        srv_dev, srv_kernels, srv_summary, state = device_time(
                            served, params, state, tokens, (keys,), ctx, tdir + "_served")
                        point["served_kernel_summary"] = srv_summary
                        point["served_kernels"] = srv_kernels
                        point["served_wall_ms"] = srv_ms
                        point["served_device_ms"] = srv_dev
                        point["served_ms"] = srv_dev if srv_dev is not None else srv_ms
                    if (batch == 1 and impl == "pallas" and args.served_steps > 1 and ctx == ctxs[0]
                            and not over_budget()):
                        n = args.served_steps
                        burst = make_burst(cfg, impl, n)
                        t = time.time()
                        burst_ms, state = time_steps(burst, params, state, tokens, (keys,), max(2, args.iters // n),
                                                     ctx)
                        burst_dev, _, _, state = device_time(burst, params, state, tokens, (keys,), ctx,
                                                             tdir + "_burst", steps=3)
                        point["served_steps"] = n
                        point["served_burst_wall_ms_per_token"] = burst_ms / n
                        point["served_burst_device_ms_per_token"] = None if burst_dev is None else burst_dev / n
                        log(f"  ctx {ctx:>6}: served, {n} steps per dispatch: {burst_ms / n:.3f} ms/token wall"
                            + ("" if burst_dev is None else f", {burst_dev / n:.3f} ms/token device")
                            + f" (compile + timing {time.time() - t:.0f}s)")
                    results["points"].append(point)
                    dev_txt = f"{dev_ms:.3f} ms device, " if dev_ms is not None else ""
                    log(f"  ctx {ctx:>6}: forward {dev_txt}{fwd_ms:.3f} ms wall, {point['kernels']} kernels"
                        + (f", served {point['served_ms']:.3f} ms" if "served_ms" in point else "")
                        + f", {point['bytes'] / 1e9:.2f} GB -> {100 * point['hbm_fraction']:.0f}% of HBM")
                    with open(os.path.join(args.out, "results.json"), "w") as f:
                        json.dump(results, f, indent=1)
                del state
        del params
    write_markdown(results, os.path.join(args.out, "results.md"))
    write_plot(results, os.path.join(args.out, "latency_vs_context.png"))
    log(f"done in {time.time() - t_start:.0f}s")
    return 0


def write_markdown(results: dict, path: str) -> None:
    lines = [f"Device: {results['device']}, jax {results['jax']}, config {results['config']}, {results['date']}. "
             f"HBM measured: read {results['hbm']['read_GBps']:.0f} GB/s, copy {results['hbm']['copy_GBps']:.0f} GB/s.",
             "Forward and served ms are the device time per step (profiler trace: first kernel start to last kernel "
             "end), wall ms the host-timed step, which includes dispatch when the host is slower than the GPU.",
             "Served burst: the engine's decode_steps, several steps per dispatch, wall ms per token.",
             "Parameters: per-layer arrays, or the layers stacked (flint_jax.layer_stack); buffers: the arrays the "
             "host hands the step per call (parameters + state).",
             "KV: the full layers' cache element type (the rings are BF16).",
             "", "| weights | impl | parameters | buffers | KV | batch | context | forward ms | forward wall ms "
             "| served ms | served wall ms | served burst wall ms/token | kernels | GB/step | roofline ms | % HBM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(p, key):
        v = p.get(key)
        return f"{v:.3f}" if isinstance(v, (int, float)) else ""
    for p in results["points"]:
        lines.append(f"| {p['weights']} | {p['impl']} | {p.get('layout', 'layers')} | {p.get('argument_buffers', '')} "
                     f"| {p.get('kv_dtype', 'bf16')} | {p['batch']} | {p['context']} | {ms(p, 'forward_ms')} | "
                     f"{ms(p, 'forward_wall_ms')} | {ms(p, 'served_ms')} | {ms(p, 'served_wall_ms')} | "
                     f"{ms(p, 'served_burst_wall_ms_per_token')} | {p['kernels']} | {p['bytes'] / 1e9:.2f} | "
                     f"{p['roofline_ms']:.3f} | {100 * p['hbm_fraction']:.0f}% |")
    for entry in results.get("skipped", []):
        where = ", ".join(f"{k} {v}" for k, v in entry.items() if k != "reason")
        lines.append(f"\nSkipped ({where}): {entry['reason']}.")
    lines += ["", *vllm_table(results)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def vllm_table(results: dict) -> list[str]:
    """The summary shaped like vLLM's announcement: per checkpoint, the initial implementation (impl="xla") and the
    optimized one (impl="pallas") at batch 1 and the headline context (100K, else the longest both measured), next
    to vLLM's GB200 figures."""
    ones = [p for p in results["points"] if p["batch"] == 1]
    if not ones:
        return []
    both = ({p["context"] for p in ones if p["impl"] == "xla"} & {p["context"] for p in ones if p["impl"] == "pallas"})
    ctx = 100_000 if any(p["context"] == 100_000 for p in ones) else max(both or {p["context"] for p in ones})
    out = [f"Summary at batch 1, context {ctx} (ms are device time where traced):", "",
           "| checkpoint | metric | vLLM, GB200 | initial (impl=xla) | optimized (impl=pallas) |",
           "|---|---|---|---|---|"]

    def cell(weights, impl, key, fmt):
        for p in reversed(ones):  # the impl's last variant (e.g. pallas with stacked parameters)
            if (p["weights"], p["impl"], p["context"]) == (weights, impl, ctx) and p.get(key) is not None:
                return fmt.format(p[key])
        return "-"
    for weights in sorted({p["weights"] for p in ones}):
        rows = [("decode forward ms", VLLM_GB200.get(f"{weights}_forward_ms"), "forward_ms", "{:.3f}"),
                ("served ms/token (one step per call)", VLLM_GB200["served_ms"] if weights == "nvfp4" else None,
                 "served_ms", "{:.3f}"),
                ("served ms/token wall, one step per call", None, "served_wall_ms", "{:.3f}"),
                ("served ms/token wall, engine burst", None, "served_burst_wall_ms_per_token", "{:.3f}"),
                ("kernels per step", VLLM_GB200["kernels"], "kernels", "{}"),
                ("% of HBM bandwidth", None, "hbm_fraction", "{:.0%}")]
        for name, ref, key, fmt in rows:
            out.append(f"| {weights} | {name} | {'-' if ref is None else ref} | {cell(weights, 'xla', key, fmt)} | "
                       f"{cell(weights, 'pallas', key, fmt)} |")
    return out


def write_plot(results: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    if not any(p["batch"] == 1 for p in results["points"]):
        log("no batch-1 points: no plot (it shows batch-1 latency against context)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for weights in sorted({p["weights"] for p in results["points"]}):
        for impl in sorted({p["impl"] for p in results["points"]}):
            pts = sorted((p["context"], p["forward_ms"]) for p in results["points"]
                         if p["weights"] == weights and p["impl"] == impl and p["batch"] == 1)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{weights} {impl}")
        roof = sorted((p["context"], p["roofline_ms"]) for p in results["points"]
                      if p["weights"] == weights and p["batch"] == 1)
        if roof:
            ax.plot(*zip(*roof), linestyle="--", color="gray", label=f"{weights} HBM roofline")
    for weights, key in (("nvfp4", "nvfp4_forward_ms"), ("bf16", "bf16_forward_ms")):
        if any(p["weights"] == weights for p in results["points"]):
            ax.scatter([100_000], [VLLM_GB200[key]], marker="x", s=60, color="black", zorder=5)
            ax.annotate(f"vLLM GB200 {weights}", (100_000, VLLM_GB200[key]), textcoords="offset points",
                        xytext=(6, -4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode forward, batch 1 (ms)")
    ax.set_title(f"Flint decode on {results['device']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
