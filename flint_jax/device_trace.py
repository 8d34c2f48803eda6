"""Device-side timing of jitted steps from a `jax.profiler` trace: what the GPU did, without the host's share.

Wall-clock timing of a decode step measures the host too: at batch 1 the H200 runs Flint's step in ~3.6 ms, while the
host spends about as long dispatching it (argument handling for ~1,900 parameter and state buffers, the CUDA-graph
update; docs/BENCHMARKS.md), so wall time per step is noisy and mixes the two. This module runs a few steps under the
profiler and reads the GPU kernel events back from the Perfetto trace:

    events = trace_kernels(lambda: step_n_times(), trace_dir)
    spans = step_spans(events, steps=5)       # per step: first kernel start -> last kernel end (ms)
    table = summarize(events, steps=5)        # per kernel name: launches, mean/total us per step
    table = trace_call(lambda: step_n_times(), steps=5)   # both in one, in a temporary directory
    gaps = idle_gaps(events, steps=5)          # device idle time inside steps, by the kernel that ends each gap
    busy = step_busy_ms(events, steps=5)     # per step: time with at least one kernel running (ms)
    per_token = marker_periods(events, "top_k_sample")   # a whole generate: the device's work per decode step
    gap = longest_gap(events)                  # (start, end) of the longest idle stretch between kernels
    host = host_activity(read_host_events(trace_dir), *gap)   # what the host did meanwhile, by event name

Steps are split by count (every step launches the same kernels). On the CPU the trace has no device events:
`trace_kernels` returns an empty list and callers report "no device trace".
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
from typing import Callable

import jax


def _read_trace(trace_dir: str) -> tuple[list[dict], set]:
    """(all events, the device process ids) of the newest perfetto trace under trace_dir."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, {pid for pid, n in procs.items() if re.search(r"/device:(GPU|gpu)", n)}


def read_kernel_events(trace_dir: str) -> list[dict]:
    """Kernel events ('X' on the device's "Stream #..." threads) of the newest perfetto trace under trace_dir,
    sorted by start time. Empty when the trace has no device process (CPU runs)."""
    events, device = _read_trace(trace_dir)
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in device}
    # Kernels sit on the "Stream #..." threads; "XLA Ops"/"XLA Modules" threads repeat them at op level.
    streams = {k for k, n in threads.items() if n.startswith("Stream")}
    out = [e for e in events if e.get("ph") == "X" and e.get("pid") in device and "dur" in e
           and (not streams or (e["pid"], e.get("tid")) in streams)]
    return sorted(out, key=lambda e: float(e["ts"]))


def read_host_events(trace_dir: str) -> list[dict]:
    """The host's complete events ('X' outside the device processes: jax's dispatch, PjRt's execute, XLA's thunks
    and command buffers, as the profiler names them) of the newest perfetto trace under trace_dir, by start time."""
    events, device = _read_trace(trace_dir)
    out = [e for e in events if e.get("ph") == "X" and e.get("pid") not in device and "dur" in e]
    return sorted(out, key=lambda e: float(e["ts"]))


def _gaps(events: list[dict]):
    """(gap start, gap end, the kernel that ends the gap) for each stretch with no kernel running, from the latest end
    of any earlier kernel to the next start (kernels sorted by start; overlapping kernels leave no gap)."""
    end = None
    for e in events:
        start = float(e["ts"])
        if end is not None and start > end:
            yield end, start, e
        end = start + float(e["dur"]) if end is None else max(end, start + float(e["dur"]))


def longest_gap(events: list[dict]) -> tuple[float, float] | None:
    """(start, end) in trace microseconds of the longest stretch with no kernel running between the first kernel's
    start and the last one's end; None with fewer than two kernels or no gap."""
    return max(((a, b) for a, b, _ in _gaps(events)), key=lambda g: g[1] - g[0], default=None)


def host_activity(host_events: list[dict], start: float, end: float, top: int = 25) -> list[dict]:
    """What the host did between start and end (trace microseconds): per event name, the time its events overlap
    the interval and how many overlap it, most time first (nested events each count: a parent covers its
    children). [{"name", "count", "overlap_us"}]"""
    by_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in host_events:
        lo, hi = max(start, float(e["ts"])), min(end, float(e["ts"]) + float(e["dur"]))
        if hi > lo:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += hi - lo
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "count": c, "overlap_us": us} for n, (c, us) in rows]


def trace_kernels(run: Callable[[], object], trace_dir: str) -> list[dict]:
    """Run `run()` (which must block until its work is done) under the profiler; its kernel events."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(run())
    return read_kernel_events(trace_dir)


def trace_call(run: Callable[[], object], steps: int = 1) -> dict | None:
    """summarize() of `run()` (which runs `steps` equal steps) traced into a temporary directory; None without device
    events (CPU runs)."""
    with tempfile.TemporaryDirectory() as d:
        events = trace_kernels(run, d)
    return summarize(events, steps) if events else None


def split_steps(events: list[dict], steps: int) -> list[list[dict]]:
    """The events of `steps` equal-count steps (every step launches the same kernels); [] if they do not divide."""
    if not events or len(events) % steps:
        return []
    n = len(events) // steps
    return [events[i * n:(i + 1) * n] for i in range(steps)]


def step_spans(events: list[dict], steps: int) -> list[float]:
    """Milliseconds from the first kernel's start to the last kernel's end of each of `steps` equal-count steps."""
    return [(max(float(e["ts"]) + float(e["dur"]) for e in s) - float(s[0]["ts"])) / 1e3
            for s in split_steps(events, steps)]


def busy_us(events: list[dict]) -> float:
    """Microseconds in which at least one of `events` runs (the union of their intervals): below the sum of their
    durations where kernels overlap, below the span where the device idles between them."""
    if not events:
        return 0.0
    events = sorted(events, key=lambda e: float(e["ts"]))
    span = max(float(e["ts"]) + float(e["dur"]) for e in events) - float(events[0]["ts"])
    return span - sum(end - start for start, end, _ in _gaps(events))


def step_busy_ms(events: list[dict], steps: int) -> list[float]:
    """busy_us of each of `steps` equal-count steps, in ms."""
    return [busy_us(s) / 1e3 for s in split_steps(events, steps)]


def device_ms(events: list[dict], steps: int) -> float | None:
    """Median device span of a step (ms), or None without device events."""
    spans = step_spans(events, steps)
    return statistics.median(spans) if spans else None


def idle_gaps(events: list[dict], steps: int, top: int = 15) -> dict:
    """Where the device sits idle inside the steps: per kernel name, the gaps that end at its launches (from the
    latest end of any earlier kernel to its start; overlapping kernels leave no gap). Gaps between steps (the host)
    are not counted. {"idle_us_per_step", "rows": [{"name", "gaps_per_step", "idle_us_per_step", "mean_us"}]}
    (the `top` names with the most idle time)."""
    groups = split_steps(events, steps)
    if not groups:
        return {"idle_us_per_step": 0.0, "rows": []}
    by_name = collections.defaultdict(list)
    for group in groups:
        for start, end, e in _gaps(group):
            by_name[e["name"]].append(end - start)
    total = sum(sum(g) for g in by_name.values())
    rows = [{"name": name, "gaps_per_step": len(g) / steps, "idle_us_per_step": sum(g) / steps,
             "mean_us": sum(g) / len(g)}
            for name, g in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]
    return {"idle_us_per_step": total / steps, "rows": rows}


def summarize(events: list[dict], steps: int) -> dict:
    """Per kernel name: launches per step, mean and median us, us per step and share of the kernel time."""
    by_name = collections.defaultdict(list)
    for e in events:
        by_name[e["name"]].append(float(e["dur"]))
    total = sum(sum(v) for v in by_name.values())
    rows = [{"name": name, "per_step": len(d) / steps, "mean_us": sum(d) / len(d), "median_us": statistics.median(d),
             "us_per_step": sum(d) / steps, "share": sum(d) / total if total else 0.0}
            for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))]
    return {"kernel_us_per_step": total / steps, "launches_per_step": len(events) / steps, "rows": rows,
            "step_spans_ms": step_spans(events, steps), "step_busy_ms": step_busy_ms(events, steps)}


def per_layer(events: list[dict], steps: int, layers: int, nbytes: int | None = None) -> dict:
    """A probe's figures for `steps` calls of a program of `layers` similar kernels: device time per layer (span /
    layers), kernels per layer, the kernels launched at least once per layer (median us) and, given the bytes one
    layer reads, GB/s."""
    summary = summarize(events, steps)
    dev = device_ms(events, steps)
    out = {"device_us_per_layer": dev * 1e3 / layers if dev else None,
           "kernels_per_layer": summary["launches_per_step"] / layers,
           "kernels": [{"name": r["name"][:60], "median_us": r["median_us"], "per_layer": r["per_step"] / layers}
                       for r in summary["rows"] if r["per_step"] >= layers]}
    if dev and nbytes:
        out["GBps"] = nbytes / (dev * 1e-3 / layers) / 1e9
    return out


def marker_periods(events: list[dict], marker: str, skip: int = 1, top: int = 12) -> dict:
    """The device's work between consecutive launches of a kernel that runs once per step (`marker`, a substring of
    its name: the sampler's kernel for a decode loop), for a trace that holds more than the steps (a whole
    `Engine.generate`: prefill, then one marker per decode step). Period i runs from the end of marker i to the end
    of marker i + 1; the first `skip` periods are dropped (the prefill's hand-over). Per period (medians): its
    length, the kernels that start in it, their busy time (union of intervals), the idle rest, and the idle time
    before its first kernel (with one step per dispatch: the wait between two dispatches); then the idle gaps by
    the kernel that ends them and the kernel table, both per period over all the periods kept (means: a few long
    stalls weigh in them, not in the medians).
    {"periods", "period_us", "kernels", "busy_us", "idle_us", "first_gap_us", "gaps": [...], "rows": [...]} or
    {"periods": 0}."""
    ends = [float(e["ts"]) + float(e["dur"]) for e in events if marker in e["name"]]
    windows = list(zip(ends, ends[1:]))[skip:]
    if not windows:
        return {"periods": 0}
    lengths, counts, busy, idle, first = [], [], [], [], []
    gaps_by_name: dict = collections.defaultdict(list)
    inside = []
    j = 0
    for lo, hi in windows:
        while j < len(events) and float(events[j]["ts"]) < lo:
            j += 1
        mine = []
        while j < len(events) and float(events[j]["ts"]) < hi:
            mine.append(events[j])
            j += 1
        for start, end, e in _gaps([{"ts": lo, "dur": 0.0, "name": "(period start)"}] + mine):
            gaps_by_name[e["name"]].append(end - start)
        covered = busy_us([{"ts": max(float(e["ts"]), lo), "dur": min(float(e["ts"]) + float(e["dur"]), hi)
                            - max(float(e["ts"]), lo)} for e in mine])  # clipped to the window
        lengths.append(hi - lo)
        first.append(max(0.0, float(mine[0]["ts"]) - lo) if mine else hi - lo)
        counts.append(len(mine))
        busy.append(covered)
        idle.append(hi - lo - covered)
        inside.extend(mine)
    n = len(windows)
    gaps = [{"name": name, "gaps_per_period": len(g) / n, "idle_us_per_period": sum(g) / n, "mean_us": sum(g) / len(g)}
            for name, g in sorted(gaps_by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]
    return {"periods": n, "period_us": statistics.median(lengths), "kernels": statistics.median(counts),
            "busy_us": statistics.median(busy), "idle_us": statistics.median(idle),
            "first_gap_us": statistics.median(first), "gaps": gaps,
            "rows": summarize(inside, n)["rows"][:top]}
