"""Probe: does programmatic dependent launch (PDL) shorten a chain of weight-streaming kernels inside a jitted step?

docs/DECODE_PATH.md names three questions to settle on the GPU before porting the decode kernels from the Pallas
Triton lowering to Mosaic GPU (the only Pallas lowering in jax 0.11.2 that emits PDL):
  1. are Mosaic GPU kernels (`mosaic_gpu` custom calls) captured in XLA's command buffers (CUDA graphs), as the Triton
     kernels are?
  2. does the early launch survive inside the graph: does a kernel that starts its weight load before
     `griddepcontrol_wait` finish a chain sooner than one that waits first?
  3. what does a Triton kernel next to a PDL kernel do?

The probe runs one jitted program of `--layers` dependent kernels, each streaming its own weight matrix (distinct
per layer, more bytes than L2 holds, as in the decode step) and combining it with the previous kernel's small output,
which is the shape of a decode GEMV: big independent weights, a tiny dependent input. Every program of layer l
reads a [128, 256] BF16 weight tile (64 KiB), sums it, and writes out[i] = x[i] / 2 + 1e-6 * sum for its 128-value
slice of the previous layer's output. Variants (same arithmetic, same bytes):

  triton          Pallas Triton lowering (today's decode kernels' lowering)
  mosaic          Mosaic GPU, TMA weight load, no PDL
  mosaic_pdl      Mosaic GPU, weight TMA issued, then griddepcontrol_wait, then the dependent input
  mosaic_pdl_late Mosaic GPU with PDL but the weight load after the wait (the overlap only of launch, not of loads)
  mixed           layers alternate triton and mosaic_pdl (question 3)
  persistent      the whole chain as ONE Mosaic GPU kernel of `programs` resident programs (one per SM): layer l+1's
                  weight tile is loaded by TMA (double-buffered in shared memory) before the program waits for
                  every program of layer l to have stored its output (a global semaphore per layer: each program
                  adds 1 after its store, waiters poll it without decrementing). The wait has the all-to-all shape
                  of a GEMV chain's dependency (each output needs the whole previous vector), though the arithmetic
                  reads only its own slice. This is docs/DECODE_PATH.md's "dataflow waits with the weights already
                  loaded" (tried in the Triton lowering in run BW, slower) in Mosaic GPU
  persistent_late the same, each layer's weight load issued only after its wait (no prefetch): the wait's own cost
  persistent_fence
                  persistent with a gpu-scope acq_rel fence before each signal (the ordering a real chain needs for
                  its plain stores; the TMA store is awaited before the signal in every variant)
  persistent_gpu  persistent with the GPU-scope signal (no system-scope fence; see persistent_chain)
  barrier_only, barrier_only_gpu
                  the persistent kernel without weights (out = x / 2 per layer): its synchronisation chain alone,
                  with either signal
  persistent_stacked, persistent_stacked_gpu
                  persistent / persistent_gpu with the 49 weights passed as one stacked array (one TMA descriptor
                  for all layers; the chain's program receives the stacked array, built once outside it)
  persistent_stacked_gpu_split
                  persistent_stacked_gpu with its two weight buffers as two scratch refs (static shared-memory
                  addresses for the TMA and the sum; not yet run on a GPU)
  persistent_stacked_gpu_split_xfirst
                  the same with the next tile's prefetch issued after the wait and the small load (not yet run)
  mosaic_pdl_attr, mosaic_pdl_late_attr
                  mosaic_pdl / mosaic_pdl_late with `uses_pdl = true` added to the custom call's backend config: XLA's
                  FFI custom-call thunk reads that attribute (when --xla_gpu_enable_pdl is on) to give the call a
                  programmatic dependency on its predecessor; jax 0.11.2's Mosaic GPU lowering does not set it

For each: device time per chain (profiler trace: first kernel start to last kernel end), wall time per call,
kernels per chain, the kernels' custom-call targets in the compiled HLO, and the check that the chain's result
equals the plain-JAX one. Whether the kernels run inside XLA's command buffers (CUDA graphs) is not visible in the
HLO text (command buffers are formed below it): compare a run with XLA_FLAGS=--xla_gpu_enable_command_buffer=
(run W, docs/BENCHMARKS.md: ~0.15 us between kernels with them, 1.7-6.4 us without).

    python scripts/probe_pdl.py --out $OUT/pdl                # on the GPU
    python scripts/probe_pdl.py --out /tmp/pdl --lower-only   # CPU: lower every variant for CUDA (no run)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flint_jax import device_trace, pallas_path  # noqa: E402

TILE_ROWS, TILE_COLS, OUT_PER_PROGRAM = 128, 256, 128
# The persistent variants: persistent_chain's options by name (the docstring above says what each one tests).
GPU, STACKED = {"signal": "gpu"}, {"stacked": True}
PERSISTENT = {
    "persistent": {},
    "persistent_late": {"prefetch": False},
    "persistent_fence": {"fence": True},
    "persistent_gpu": GPU,
    "barrier_only": {"weights": False},
    "barrier_only_gpu": {"weights": False, **GPU},
    "persistent_stacked": STACKED,
    "persistent_stacked_gpu": {**STACKED, **GPU},
    "persistent_stacked_gpu_split": {**STACKED, **GPU, "split_buffers": True},
    "persistent_stacked_gpu_split_xfirst": {**STACKED, **GPU, "split_buffers": True, "x_first": True},
}
VARIANTS = ("triton", "mosaic", "mosaic_pdl", "mosaic_pdl_late", "mixed", "mosaic_pdl_attr", "mosaic_pdl_late_attr",
            *PERSISTENT)


@contextlib.contextmanager
def uses_pdl_attribute(enabled: bool):
    """While active, every Mosaic GPU custom call is lowered with `uses_pdl = true` in its backend config."""
    if not enabled:
        yield
        return
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    original = mlir.custom_call

    def custom_call(call_target_name, **kwargs):
        config = kwargs.get("backend_config")
        if call_target_name == "mosaic_gpu_v2" and isinstance(config, dict):
            kwargs["backend_config"] = {**config, "uses_pdl": ir.BoolAttr.get(True)}
        return original(call_target_name, **kwargs)

    mlir.custom_call = custom_call
    try:
        yield
    finally:
        mlir.custom_call = original


def mosaic_layer(programs: int, pdl: bool, weights_before_wait: bool):
    """One layer as a Mosaic GPU kernel: out[i] = x[i] / 2 + 1e-6 * sum(w tile i)."""

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((programs * OUT_PER_PROGRAM,), jnp.float32),
        grid=(programs,), grid_names=("i",),
        scratch_types=[plgpu.SMEM((TILE_ROWS, TILE_COLS), jnp.bfloat16),
                       plgpu.SMEM((OUT_PER_PROGRAM,), jnp.float32), plgpu.SMEM((OUT_PER_PROGRAM,), jnp.float32),
                       plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)])
    def kernel(x_gmem, w_gmem, o_gmem, w_smem, x_smem, o_smem, w_ready, x_ready):
        i = lax.axis_index("i")
        load_weights = lambda: plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(i * TILE_ROWS, TILE_ROWS)], w_smem, w_ready)
        if not pdl or weights_before_wait:
            load_weights()
        if pdl:
            plgpu.griddepcontrol_wait()          # the previous kernel's writes are visible from here on
            if not weights_before_wait:
                load_weights()
            plgpu.griddepcontrol_launch_dependents()
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(i * OUT_PER_PROGRAM, OUT_PER_PROGRAM)], x_smem, x_ready)
        plgpu.barrier_wait(w_ready)
        total = jnp.sum(w_smem[...].astype(jnp.float32))
        plgpu.barrier_wait(x_ready)
        o_smem[...] = x_smem[...] * 0.5 + total * 1e-6
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i * OUT_PER_PROGRAM, OUT_PER_PROGRAM)])
        plgpu.wait_smem_to_gmem(0)

    return kernel


def persistent_chain(programs: int, layers: int, prefetch: bool = True, fence: bool = False, signal: str = "pallas",
                     weights: bool = True, stacked: bool = False, split_buffers: bool = False,
                     x_first: bool = False):
    """All `layers` layers as one Mosaic GPU kernel (variant `persistent*`): out[l, i] = x_l[i] / 2 + 1e-6 * sum(tile).

    Semaphores: pl.get_global gives `layers` counters that persist across calls and must be zero again at exit.
    Program p adds 1 to sems[l] after storing layer l; a program waits for sems[l - 1] == programs (no decrement)
    before reading layer l - 1's output. Program 0 resets them: once it has seen sems[l] full, every program has
    passed its wait on sems[l - 1] (it signalled sems[l] after that wait), so it takes sems[l - 1] back to 0 (a
    decrementing wait), and the last two at the end. Needs every program resident at once (one per SM).
    signal="pallas": pl.semaphore_signal (a relaxed system-scope add, then a system-scope release fence);
    "gpu": a warpgroup barrier, then one thread's GPU-scope acq_rel fence and relaxed add. weights=False: no weight
    tiles at all, out = x / 2 (the synchronisation chain alone). stacked: the layers' weights come as one
    [layers * rows, cols] array (one TMA descriptor instead of one per layer). split_buffers: the two weight buffers
    as two shared-memory scratch refs instead of one [2, rows, cols] ref, whose slots Mosaic GPU reads through a
    memref with a dynamic offset (`strided<[256, 1], offset: ?>` after layout inference). x_first: issue the next
    layer's weight prefetch after this layer's wait and its load of the previous output (which the layer waits for),
    not before the wait, so that the small load is not queued behind a 64 KiB tile."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir

    @plgpu.inline_mgpu()
    def acq_rel_fence(ctx):
        mgpu.utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def gpu_signal(ctx, sem):
        mgpu.utils.warpgroup_barrier()
        ptr = mgpu.utils.memref_ptr(sem)
        one = mgpu.utils.c(1, ir.IntegerType.get_signless(32))
        first = mgpu.utils.single_thread_predicate(mgpu.utils.ThreadSubset.WARPGROUP)
        mgpu.utils.inline_ptx("fence.acq_rel.gpu;", predicate=first, has_side_effects=True)
        mgpu.utils.inline_ptx("red.relaxed.gpu.global.add.u32 [$0], $1;", ptr, one, predicate=first,
                              has_side_effects=True)

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((layers, programs * OUT_PER_PROGRAM), jnp.float32),
        grid=(programs,), grid_names=("i",),
        scratch_types=[*([plgpu.SMEM((TILE_ROWS, TILE_COLS), jnp.bfloat16)] * 2 if split_buffers else
                         [plgpu.SMEM((2, TILE_ROWS, TILE_COLS), jnp.bfloat16)]),
                       plgpu.SMEM((OUT_PER_PROGRAM,), jnp.float32), plgpu.SMEM((OUT_PER_PROGRAM,), jnp.float32),
                       plgpu.Barrier(num_arrivals=1, num_barriers=2), plgpu.Barrier(num_arrivals=1)])
    def kernel(*refs):
        n_w = 1 if stacked else layers
        x_gmem, ws = refs[0], refs[1:1 + n_w]
        o_gmem, *w_bufs, x_smem, o_smem, w_ready, x_ready = refs[1 + n_w:]
        w_smem = w_bufs if split_buffers else w_bufs[0]  # w_smem[slot]: a scratch ref, or a slot of one
        sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(layers)]
        i = lax.axis_index("i")
        mine = pl.ds(i * OUT_PER_PROGRAM, OUT_PER_PROGRAM)

        def load_weights(l):
            if not weights:
                return
            src = ws[0].at[pl.ds(l * programs * TILE_ROWS + i * TILE_ROWS, TILE_ROWS)] if stacked else \
                ws[l].at[pl.ds(i * TILE_ROWS, TILE_ROWS)]
            dst = w_smem[l % 2] if split_buffers else w_smem.at[l % 2]
            plgpu.copy_gmem_to_smem(src, dst, w_ready.at[l % 2])

        if prefetch:
            load_weights(0)
        for l in range(layers):
            if prefetch and l + 1 < layers and not x_first:
                load_weights(l + 1)  # its slot was last read by layer l - 1, finished above
            if l > 0:
                plgpu.semaphore_wait(sems[l - 1], programs, decrement=False, memory_scope="gpu")
            if l > 1:
                @pl.when(i == 0)
                def _():
                    plgpu.semaphore_wait(sems[l - 2], programs, decrement=True, memory_scope="gpu")
            if not prefetch:
                load_weights(l)
            src = x_gmem if l == 0 else o_gmem.at[l - 1]
            plgpu.copy_gmem_to_smem(src.at[mine], x_smem, x_ready)
            if prefetch and l + 1 < layers and x_first:
                load_weights(l + 1)
            if weights:
                plgpu.barrier_wait(w_ready.at[l % 2])
                tile = w_smem[l % 2][...] if split_buffers else w_smem[l % 2]
                total = jnp.sum(tile.astype(jnp.float32))
            plgpu.barrier_wait(x_ready)
            o_smem[...] = x_smem[...] * 0.5 + total * 1e-6 if weights else x_smem[...] * 0.5
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[l, mine])
            plgpu.wait_smem_to_gmem(0)
            if fence:
                acq_rel_fence()
            if signal == "gpu":
                gpu_signal(sems[l])
            else:
                pl.semaphore_signal(sems[l])

        @pl.when(i == 0)
        def _():  # sems[layers - 1] full: every program is past its last wait, on sems[layers - 2]
            plgpu.semaphore_wait(sems[layers - 1], programs, decrement=False, memory_scope="gpu")
            for l in range(max(0, layers - 2), layers):
                plgpu.semaphore_wait(sems[l], programs, decrement=True, memory_scope="gpu")

    def run(x, weights):
        return kernel(x, weights)[-1] if stacked else kernel(x, *weights)[-1]

    return run


def triton_layer(programs: int):
    """The same layer in the Pallas Triton lowering."""

    def body(x_ref, w_ref, o_ref):
        total = jnp.sum(w_ref[...].astype(jnp.float32))
        o_ref[...] = x_ref[...] * 0.5 + total * 1e-6

    def run(x, w):
        return pl.pallas_call(
            body, out_shape=jax.ShapeDtypeStruct((programs * OUT_PER_PROGRAM,), jnp.float32), grid=(programs,),
            in_specs=[pl.BlockSpec((OUT_PER_PROGRAM,), lambda i: (i,)),
                      pl.BlockSpec((TILE_ROWS, TILE_COLS), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((OUT_PER_PROGRAM,), lambda i: (i,)),
            compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))(x, w)

    return run


def reference_layer(x, w):
    programs = w.shape[0] // TILE_ROWS
    sums = w.astype(jnp.float32).reshape(programs, -1).sum(axis=1)
    return x * 0.5 + jnp.repeat(sums, OUT_PER_PROGRAM) * 1e-6


def chain(variant: str, programs: int, layers: int):
    """The jitted program: `layers` dependent kernels, layer l reading weights[l] (a persistent variant: one kernel
    reading all of them, or their stacked array)."""
    if variant in PERSISTENT:
        return jax.jit(persistent_chain(programs, layers, **PERSISTENT[variant]))
    kinds = {
        "triton": [triton_layer(programs)] * layers,
        "mosaic": [mosaic_layer(programs, False, True)] * layers,
        "mosaic_pdl": [mosaic_layer(programs, True, True)] * layers,
        "mosaic_pdl_late": [mosaic_layer(programs, True, False)] * layers,
        "mosaic_pdl_attr": [mosaic_layer(programs, True, True)] * layers,
        "mosaic_pdl_late_attr": [mosaic_layer(programs, True, False)] * layers,
        "mixed": [triton_layer(programs) if l % 2 == 0 else mosaic_layer(programs, True, True) for l in range(layers)],
        "reference": [reference_layer] * layers,
    }[variant]

    @jax.jit
    def run(x, weights):
        for layer, w in zip(kinds, weights):
            x = layer(x, w)
        return x

    return run


def custom_call_report(compiled_text: str) -> dict:
    """The kernels' custom-call targets in the optimised HLO (Triton, Mosaic GPU) and how many calls."""
    custom_calls = re.findall(r'custom_call_target="([^"]+)"', compiled_text)
    return {"custom_call_targets": sorted(set(custom_calls)), "custom_calls": len(custom_calls)}


def measure(v: str, programs: int, args, x0, weights, expected, nbytes: int) -> dict:
    """Build, check and time one variant's chain; a variant that fails to build gives its error."""
    t0 = time.perf_counter()
    try:
        run = chain(v, programs, args.layers)
        compiled = run.lower(x0, weights).compile()
        got = np.asarray(run(x0, weights))
    except Exception as e:  # one variant failing to build must not hide the others
        print(f"[probe_pdl] {v}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    err = float(np.max(np.abs(got - expected)))
    events = device_trace.trace_kernels(
        lambda: [run(x0, weights) for _ in range(args.steps)][-1], os.path.join(args.trace_dir, f"trace_{v}"))
    dev = device_trace.device_ms(events, args.steps)
    walls = []
    for _ in range(args.steps * 3):
        t = time.perf_counter()
        run(x0, weights).block_until_ready()
        walls.append(time.perf_counter() - t)
    err_after = float(np.max(np.abs(np.asarray(run(x0, weights)) - expected)))  # state left by earlier calls
    per_step = len(events) // args.steps if events else None
    durs = [float(e["dur"]) for e in events]
    entry = {"max_abs_err": err, "max_abs_err_after_timing": err_after, "device_ms": dev,
             "wall_ms": statistics.median(walls) * 1e3,
             "kernels_per_chain": per_step, "kernel_us_median": statistics.median(durs) if durs else None,
             "us_per_layer": dev * 1e3 / args.layers if dev else None,
             "GBps": nbytes / (dev * 1e-3) / 1e9 if dev else None,
             "compile_and_check_s": time.perf_counter() - t0,
             "xla_flags": os.environ.get("XLA_FLAGS", ""),
             **custom_call_report(compiled.as_text())}
    print(f"[probe_pdl] {v}: device {dev} ms ({entry['us_per_layer']} us/layer), wall {entry['wall_ms']:.3f} ms,"
          f" {per_step} kernels, kernel median {entry['kernel_us_median']} us, err {err:.2e} / {err_after:.2e}, "
          f"targets {entry['custom_call_targets']}", flush=True)
    with open(os.path.join(args.out, f"hlo_{v}.txt"), "w") as f:
        f.write(compiled.as_text())
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=49)
    ap.add_argument("--mib", type=float, default=8.0, help="weight MiB per layer (default 8)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trace-dir", default="/tmp/probe_pdl_traces", help="profiler traces (large; not under --out)")
    ap.add_argument("--lower-only", action="store_true", help="lower each variant for CUDA and stop (CPU hosts)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    programs = max(1, int(args.mib * 2**20) // (TILE_ROWS * TILE_COLS * 2))
    rows = programs * TILE_ROWS
    x_shape = jax.ShapeDtypeStruct((programs * OUT_PER_PROGRAM,), jnp.float32)
    w_shapes = [jax.ShapeDtypeStruct((rows, TILE_COLS), jnp.bfloat16)] * args.layers
    results = {"programs": programs, "weight_bytes_per_layer": rows * TILE_COLS * 2, "layers": args.layers,
               "variants": {}}

    if args.lower_only:
        for v in variants:
            with pallas_path.lowering_for_gpu(), uses_pdl_attribute(v.endswith("_attr")):
                ws_arg = jax.ShapeDtypeStruct((args.layers * rows, TILE_COLS), jnp.bfloat16) \
                    if PERSISTENT.get(v, {}).get("stacked") else w_shapes
                text = chain(v, programs, args.layers).trace(x_shape, ws_arg).lower(
                    lowering_platforms=("cuda",)).as_text()
            results["variants"][v] = {"lowered_chars": len(text), "mosaic_calls": text.count("mosaic_gpu"),
                                      "kernels": text.count("stablehlo.custom_call"),
                                      "gpu_scope_signal": "red.relaxed.gpu" in text,
                                      "uses_pdl": text.count("mosaic_gpu.uses_pdl"),
                                      "uses_pdl_config": text.count("uses_pdl = true")}
            print(f"[probe_pdl] {v}: lowered ({len(text)} chars, uses_pdl x{text.count('mosaic_gpu.uses_pdl')})",
                  flush=True)
        json.dump(results, open(os.path.join(args.out, "probe_pdl.json"), "w"), indent=1)
        return 0

    key = jax.random.key(0)
    weights = [jax.random.normal(jax.random.fold_in(key, l), (rows, TILE_COLS), jnp.bfloat16)
               for l in range(args.layers)]
    x0 = jnp.linspace(-1.0, 1.0, programs * OUT_PER_PROGRAM, dtype=jnp.float32)
    expected = np.asarray(chain("reference", programs, args.layers)(x0, weights))
    nbytes = args.layers * rows * TILE_COLS * 2
    stacked = None  # built once, for the first variant that reads the weights as one array
    for v in variants:
        options = PERSISTENT.get(v, {})
        if options.get("stacked") and stacked is None:
            stacked = jnp.concatenate(weights)
        with uses_pdl_attribute(v.endswith("_attr")):
            want = expected if options.get("weights", True) else np.asarray(x0) * 0.5 ** args.layers
            entry = measure(v, programs, args, x0, stacked if options.get("stacked") else weights, want, nbytes)
        results["variants"][v] = entry
        json.dump(results, open(os.path.join(args.out, "probe_pdl.json"), "w"), indent=1)
    json.dump(results, open(os.path.join(args.out, "probe_pdl.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
