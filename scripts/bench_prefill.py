"""Prefill benchmark at the Flint shape (issue 7): grouped-expert GEMMs, chunked prefill attention, 8K prefill, TTFT.

    python scripts/bench_prefill.py --check --out results/prefill --budget-s 220     # the GPU run (one H200)
    python scripts/bench_prefill.py --tiny --check --out /tmp/bench_prefill          # CPU smoke test (< 1 min)

Sections, in this order, each skipped (and said so) when the remaining --budget-s cannot cover it; results are
written (JSON + Markdown) after every section, so a run cut short still leaves what it measured:

  check   (--check) kernels vs their plain-JAX references on the GPU at moderate shapes with Flint's head and
          expert shapes
  moe     one MoE layer's expert GEMMs at 8,192 tokens (49,152 (token, expert) pairs, 256 experts): our grouped
          kernels (BF16 and NVFP4, the block table's defaults) and our tiled plain-JAX reference
  prefill per weight format (NVFP4, then BF16; parameters initialised on the device, leaf by leaf under jax.jit,
          and freed before the next format): an 8,192-token prompt at batch 1 in one chunk, first the engine's
          path (the headline: prefill_pipeline.prefill, the chunk as a few jitted programs cut at layer boundaries;
          --program-variants adds other cuts, the one-program path and other compile options, PROGRAM_VARIANTS), then the same kernels as a Python loop over
          per-layer jitted blocks (with --profile each traced: device time by part, top kernels, and where the
          device sat idle), then in chunks of --chunk, then the reference blocks on the one-chunk prompt
          (model.attention_block + the MoE on the tiled reference GEMMs; layers.mlp_block's ragged_dot is measured
          in `moe` only: on the GPU it expands to dense matmuls over all 256 experts)
  routing the synthetic model's routing on that prompt (rows per expert at each MoE layer, tiles of 64/128/256 rows
          the grouped GEMMs run for it), then the grouped GEMMs timed at its median layer's routing (after the
          formats; skip with --skip routing)
  ttft    (first format only) a 100K-token prompt in chunks of 8,192: wall time to the first token on the engine's
          path (prefill_pipeline, as above), then a breakdown run that times the parts separately (each part synchronised)
  moe/jax jax's options on the same layer (BF16, gate projection): jax.lax.ragged_dot (default GPU lowering, and
          with jax_ragged_dot_use_gpu_pallas_triton_lowering) and jax.experimental.pallas.ops.gpu.ragged_dot_mgpu
          (BF16 only: it takes one dtype for both operands)
  attn    the prefill attention kernels alone for one 8,192-token chunk (sliding ring; full at offsets 0 and ~92K)
          and layers.attend where its [T, S] scores fit
  sweeps  other block sizes for the grouped GEMMs and the attention, with whatever budget is left

Apart from the engine-path rows, the layers run as a Python loop over per-layer jitted blocks (one compile per
layer kind, not one 49-layer program), which keeps compile time inside the budget; the arithmetic is exactly
flint_jax.prefill's blocks. The loop leaves the device idle for part of the time: its per-layer executables see
new buffers on every call (NVFP4 in runs Y and Z, docs/BENCHMARKS.md: 231.5 and 204.2 ms against 176.9 and 169.3
ms for the engine's path), so its figures are a comparison, not the headline.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flint_jax import device_trace  # noqa: E402
from flint_jax import engine as E  # noqa: E402
from flint_jax import layers as L  # noqa: E402
from flint_jax import model as M  # noqa: E402
from flint_jax import nvfp4  # noqa: E402
from flint_jax import prefill as P  # noqa: E402
from flint_jax import prefill_pipeline as PP  # noqa: E402
from flint_jax.config import FlintConfig  # noqa: E402
from flint_jax.device_memory import model_shortfall  # noqa: E402
from flint_jax.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P  # noqa: E402
from flint_jax import params as params_mod  # noqa: E402
from flint_jax.pallas_kernels import grouped_matmul as gm  # noqa: E402
from flint_jax.pallas_kernels import prefill_attention as pa  # noqa: E402
from flint_jax.state import FullCache, KVState, RingCache, init_state, write_full, write_ring  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
VLLM_GB200_8K_MS = 145.0
T0 = time.time()

# Blocks timed besides the table's at the synthetic model's routing (section_moe "program_routing"): 128-row tiles
# split an expert past 256 rows into fewer idle rows than a second 256-row visit.
# (A (block, tails) pair: that block with those tail blocks.)
PROGRAM_ROUTING_EXTRA = {("nvfp4", "swiglu"): [gm.Block(128, 64, 64, 8, 3)],
                         ("nvfp4", "linear"): [(gm.NVFP4_LINEAR_LHS, (gm.Block(64, 64, 64, 4, 3, True),))]}

# Variants of the engine's prefill timed beside its default (--program-variants), each compiled on its own:
# "xla": XLA options (without command buffers the host launches each kernel); "tails": the grouped GEMMs'
# tail-block table (grouped_matmul.TAIL_BLOCKS) while the programs are traced; "cuts": where the chunk is cut into
# separately dispatched programs (prefill_pipeline; () is one program with the reset folded in); "one_program": the
# chunk as engine.prefill_chunk after a separate engine.reset_slots_in_place call (the engine's path before
# prefill_pipeline: the device idled ~6.8 ms before each chunk while the host handed over ~1,930 buffers, run AS).
# The full layers' KV cache element type of every state this script makes (--kv-dtype; state.KV_DTYPES).
KV_DTYPE = "bf16"
PROGRAM_VARIANTS = {
    "default": {},
    "one_program": {"one_program": True},
    "cuts_none": {"cuts": ()},
    "cuts_2": {"cuts": (2,)},
    "cuts_2_5_14": {"cuts": (2, 5, 14)},
    "no_command_buffers": {"xla": {"xla_gpu_enable_command_buffer": ""}},
    "no_tails": {"tails": {}},  # one tile size per grouped GEMM (the table before c3fee07)
    "down_tails": {"tails": {**gm.TAIL_BLOCKS, ("nvfp4", "linear"): (gm.Block(64, 64, 64, 4, 3, True),)}},
}

# Block sweep candidates. Spills checked on the CPU for sm_90 with Triton 3.6 and ptxas -v (docs/KERNELS.md, "Backend
# and GPU checks without a GPU"), as the prefill calls them (rows gathered / scattered by index): the BF16 blocks and
# the NVFP4 blocks listed as spill-free have none; the NVFP4 SwiGLU default spills 192 bytes at 255 registers.
GM_SWEEP = {  # candidates; the one the table picks for the shape is timed first (phase main), the rest in sweeps
    ("bf16", "swiglu"): [gm.Block(128, 128, 64, 8, 3), gm.Block(64, 128, 64, 8, 3), gm.Block(64, 64, 64, 4, 4)],
    ("bf16", "linear"): [gm.Block(128, 128, 64, 8, 3), gm.Block(64, 128, 64, 4, 3), gm.Block(64, 256, 64, 8, 3)],
    # NVFP4 (packed decode): 16 warps hold the 256-row tile's two FP32 accumulators in 64 registers per thread
    # (128 in all, 16 bytes spilled; 8 warps: 255 and 192 bytes spilled); BK 32 bytes (28 spilled); BN 32 and
    # 128-row tiles without spills, at the price of narrower dots or decoding each weight tile twice.
    ("nvfp4", "swiglu"): [gm.Block(256, 64, 64, 8, 3), gm.Block(256, 64, 64, 16, 3), gm.Block(256, 64, 64, 16, 2),
                          gm.Block(256, 64, 32, 16, 4), gm.Block(256, 64, 32, 8, 3), gm.Block(256, 32, 64, 8, 3),
                          gm.Block(128, 64, 64, 8, 3), gm.Block(128, 64, 64, 16, 3)],
    # The table's (128, 64, 64, 4, 3, lhs) and the 256-row tiles that decode each weight tile once (8 warps: no
    # spill; 16 warps: 8 bytes), and the table's tile at 8 warps.
    ("nvfp4", "linear"): [gm.NVFP4_LINEAR_LHS, gm.Block(256, 64, 64, 8, 3), gm.Block(256, 64, 64, 16, 3),
                          gm.Block(128, 64, 64, 8, 3, True)],
}
# 256-row blocks (32 tokens x 8 heads) halve the K/V each program streams from L2 per query token (computed: ~4.3 GB
# per full layer's 8K chunk at 128 rows); 16 warps keep their [256, 128] accumulator at 64 registers per thread.
# Measured in run AM: slower than the default inside the prefill program (docs/BENCHMARKS.md).
ATTN_SWEEP = [pa.DEFAULT_BLOCK, pa.Block(128, 64, 8, 2), pa.Block(128, 64, 8, 3, pv="bf16x2"), pa.Block(128, 128, 8, 3),
              pa.Block(64, 64, 4, 3), pa.Block(256, 64, 16, 3), pa.Block(256, 64, 16, 2), pa.Block(256, 32, 8, 3),
              pa.Block(256, 64, 8, 2)]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Run:
    """Results, budget and output files."""

    def __init__(self, args):
        self.args = args
        self.deadline = T0 + args.budget_s
        self.results: dict = {"meta": {}, "check": {}, "moe": {}, "attn": {}, "prefill": {}, "ttft": {}, "routing": {},
                              "skipped": [], "errors": []}
        os.makedirs(args.out, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def allows(self, need_s: float, what: str) -> bool:
        if self.left() < need_s:
            msg = f"{what}: skipped, {self.left():.0f} s of budget left, needs about {need_s:.0f} s"
            log(msg)
            self.results["skipped"].append(msg)
            self.save()
            return False
        return True

    def error(self, what: str, e: BaseException) -> None:
        msg = f"{what}: {type(e).__name__}: {str(e)[:600]}"
        log("ERROR " + msg)
        traceback.print_exc(limit=3)
        self.results["errors"].append(msg)
        self.save()

    def save(self) -> None:
        with open(os.path.join(self.args.out, "bench_prefill.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        with open(os.path.join(self.args.out, "bench_prefill.md"), "w") as f:
            f.write(markdown(self.results))


def sync(x):
    return jax.block_until_ready(x)


def time_fn(fn, reps: int = 3):
    """(first call s, [ms of the next reps]); fn() must return arrays to wait for."""
    t = time.perf_counter()
    sync(fn())
    first = time.perf_counter() - t
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        sync(fn())
        ms.append(1e3 * (time.perf_counter() - t))
    return first, ms


def kernel_ms(fn) -> float | None:
    """Device time of one call of fn(): the sum of its kernels' durations from a profiler trace, ms (None without
    device events, on the CPU). A one-layer wall-clock time carries the host's dispatch and varies by tens of
    percent between identical calls (run AM: the default attention block at 0.55 and 0.94 ms a few seconds apart),
    too much to rank blocks by; the sweeps rank by this instead."""
    summary = device_trace.trace_call(fn)
    return None if summary is None else summary["kernel_us_per_step"] / 1e3


def rank_ms(row: dict) -> float:
    """What the sweeps rank by: device time where there is one, else wall time."""
    return row.get("device_ms") or row["ms"]


def bf16_ulp_stats(a, b, value_max: float | None = None) -> dict:
    """Kernel output a against reference b. ulps count BF16 steps between the two (large where a value near 0
    flips sign, so not the pass criterion); `scaled_err` is max |a - b| / (2^-7 |b| + 2^-8 rms(b)), the tests'
    tolerance (tests/test_kernels_attention.assert_ulp_close): <= 1 means every element is within one BF16 ulp of
    its own magnitude plus half an ulp of the output's scale, i.e. summation order alone."""
    def ordered(x):
        i = np.asarray(jnp.asarray(x, BF16).view(jnp.int16)).astype(np.int32)
        return np.where(i < 0, -32768 - i, i)
    a, b = np.asarray(a), np.asarray(b)
    u = np.abs(ordered(a) - ordered(b))
    fa, fb = np.asarray(a, np.float32), np.asarray(b, np.float32)
    rms = float(np.sqrt(np.mean(fb.astype(np.float64) ** 2)))
    scaled = np.abs(fa - fb) / (2.0 ** -7 * np.abs(fb) + 2.0 ** -8 * rms)
    st = {"max_ulp": int(u.max()), "frac_differ": float((u > 0).mean()), "finite": bool(np.isfinite(fa).all()),
          "max_abs": float(np.abs(fa - fb).max()), "ref_max_abs": float(np.abs(fb).max()), "ref_rms": rms,
          "scaled_err": float(scaled.max())}
    if value_max is not None:
        # Attention with BF16 probabilities (prefill_attention.GPU_PV = "bf16"): each p carries up to 2^-9 relative
        # error, so o = sum p v / l can move by 2^-9 max|v| whatever its own size (a small o from cancelling
        # values too). Bound: 2^-8 max|v| (twice that) + one BF16 ulp of o.
        st["value_max"] = value_max
        st["scaled_err_bf16_p"] = float((np.abs(fa - fb) / (2.0 ** -8 * value_max + 2.0 ** -7 * np.abs(fb))).max())
    return st


def check_ok(st: dict) -> bool:
    err = st.get("scaled_err_bf16_p", st["scaled_err"])
    return st["finite"] and err <= 1.0


# ---- FLOPs ---------------------------------------------------------------------------------------------------------
def prefill_flops(cfg: FlintConfig, start: int, n: int) -> dict:
    """Useful FLOPs of prefilling tokens [start, start + n) after `start` earlier ones (batch 1): matmuls at 2 per
    MAC over the active weights, attention 4 * Hq * D per (query, allowed key), the LM head for the last token."""
    H, D, Hq, KV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    proj = 2 * H * (2 * Hq * D + 2 * KV * D)
    dense = 2 * 3 * H * cfg.intermediate_size
    moe = 2 * 3 * H * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) \
        + 2 * H * cfg.n_routed_experts
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    n_dense = cfg.num_hidden_layers - n_moe
    pos = np.arange(start, start + n, dtype=np.float64)
    keys_full = float(np.sum(pos + 1))
    keys_slide = float(np.sum(np.minimum(pos + 1, cfg.sliding_window)))
    attn = 4 * Hq * D * (len(cfg.full_layers) * keys_full + len(cfg.sliding_layers) * keys_slide)
    mm = n * (cfg.num_hidden_layers * proj + n_dense * dense + n_moe * moe) + 2 * H * cfg.vocab_size
    return {"matmul": mm, "attention": attn, "total": mm + attn}


# ---- layer drivers ----------------------------------------------------------------------------------------------
def _chunk_inputs(lengths, n_new, T):
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = lengths[:, None] + t
    valid = t < n_new[:, None]
    return positions, valid, lengths + n_new


class Runner:
    """A chunked prefill as a Python loop over per-layer jitted blocks. impl: "kernels" (flint_jax.prefill) or
    "reference" (model.attention_block + the MoE on the tiled reference GEMMs)."""

    def __init__(self, cfg: FlintConfig, impl: str, gm_blocks=(None, None), attn_block=None):
        self.cfg = cfg
        if impl == "kernels":
            def attn(h, layer, cache, positions, valid, lengths_after, sliding):
                return P.attention_block(h, layer, cache, positions, valid, lengths_after, cfg, sliding,
                                         block=attn_block)

            def mlp(h, layer):
                return P.mlp_block(h, layer, cfg, blocks=gm_blocks)
        else:
            def attn(h, layer, cache, positions, valid, lengths_after, sliding):
                return M.attention_block(h, layer, cache, positions, valid, lengths_after, cfg, sliding)

            def mlp(h, layer):
                return P.mlp_block(h, layer, cfg, reference=True)
        self.attn = jax.jit(attn, static_argnames=("sliding",), donate_argnames=("cache",))
        self.mlp = jax.jit(mlp)
        self.embed = jax.jit(lambda table, tokens: table[tokens])
        self.inputs = jax.jit(_chunk_inputs, static_argnames=("T",))
        self.head = jax.jit(lambda fn, w, h, n_new: L.logits_from_hidden(M.last_hidden(h, n_new), fn, w,
                                                                          cfg.rms_norm_eps))
        self.on_mlp_input = None  # f(layer index, h, layer, valid) before each layer's MLP half (routing_balance)

    def chunk(self, params, state: KVState, tokens, n_new):
        T = tokens.shape[1]
        positions, valid, lengths_after = self.inputs(state.lengths, n_new, T=T)
        h = self.embed(params.embed, tokens)
        caches = []
        for i, (layer, cache) in enumerate(zip(params.layers, state.layers)):
            h, cache = self.attn(h, layer, cache, positions, valid, lengths_after, sliding=self.cfg.is_sliding(i))
            if self.on_mlp_input is not None:
                self.on_mlp_input(i, h, layer, valid)
            h = self.mlp(h, layer)
            caches.append(cache)
        return h, KVState(layers=tuple(caches), lengths=lengths_after)

    def prefill(self, params, tokens: np.ndarray, chunk: int, max_len: int):
        """tokens [1, N]: chunks of `chunk` tokens (the last one padded); returns the last token's logits."""
        N = tokens.shape[1]
        state = init_state(self.cfg, 1, max_len, kv_dtype=KV_DTYPE)
        logits = None
        for lo in range(0, N, chunk):
            part = np.zeros((1, chunk), np.int32)
            n = min(chunk, N - lo)
            part[0, :n] = tokens[0, lo:lo + n]
            n_new = jnp.array([n], jnp.int32)
            h, state = self.chunk(params, state, jnp.asarray(part), n_new)
            if lo + chunk >= N:
                logits = self.head(params.final_norm, params.lm_head, h, n_new)
        return logits


class ProgramRunner:
    """The engine's prefill (the product path): each chunk is `prefill_pipeline.prefill`, a few jitted programs cut
    at layer boundaries (embedding, the 49 layers unrolled with the prefill kernels, LM head at each row's last
    token, sampling) over a donated state, the row reset folded into the first chunk. No Python runs between layers
    inside a program, and the host dispatches the later segments while the device runs the first. A PROGRAM_VARIANTS
    entry changes the cuts, compiles the segments on their own (XLA options, a tail-block table swapped in while they
    trace), or runs the chunk as the one program engine.prefill_chunk after engine.reset_slots_in_place."""

    def __init__(self, cfg: FlintConfig, variant: dict | None = None):
        self.cfg = cfg
        self.variant = variant or {}
        self.cuts = self.variant.get("cuts", PP.DEFAULT_CUTS)
        self.one_program = self.variant.get("one_program", False)
        fn = E.prefill_chunk.__wrapped__ if self.one_program else PP._segment.__wrapped__
        if "xla" in self.variant or "tails" in self.variant:
            # a new function object: jax's trace cache is keyed on it, so this variant traces on its own
            fn = functools.wraps(fn)(lambda *a, _fn=fn, **k: _fn(*a, **k))
            static = ("cfg", "impl") if self.one_program else ("cfg", "impl", "first", "stop")
            self.program = jax.jit(fn, static_argnames=static, donate_argnames=("state",) if self.one_program
                                   else ("caches",), compiler_options=self.variant.get("xla"))
        else:
            self.program = E.prefill_chunk if self.one_program else PP._segment
        self.settings = (jnp.full((1,), DEFAULT_TEMPERATURE, jnp.float32), jnp.full((1,), DEFAULT_TOP_K, jnp.int32),
                         jnp.full((1,), DEFAULT_TOP_P, jnp.float32))
        self.keys = jax.random.split(jax.random.key(0), 1)
        # Like the engine, keep one state and empty it between prompts (in place, donated) instead of allocating a
        # fresh one per prompt: new state buffers cost 35-43 ms per 8K prompt in run Y (docs/BENCHMARKS.md; the
        # "fresh state" figure each run reports), most likely the update of the command buffers (CUDA graphs) that
        # XLA recorded for the old addresses, ~3,300 kernel nodes.
        self.states: dict[int, KVState] = {}

    def chunk_program(self, params, state: KVState, tokens, n_new, reset):
        saved = gm.TAIL_BLOCKS
        if "tails" in self.variant:  # read when the programs are traced (their first call)
            gm.TAIL_BLOCKS = self.variant["tails"]
        try:
            if self.one_program:
                if reset is not None:
                    state = E.reset_slots_in_place(state, jnp.asarray(reset))
                return self.program(params, state, tokens, n_new, self.keys, *self.settings, cfg=self.cfg,
                                    impl="pallas")
            return PP.prefill(params, state, tokens, n_new, self.keys, *self.settings, reset=reset, cfg=self.cfg,
                              impl="pallas", cuts=self.cuts, segment=self.program)
        finally:
            gm.TAIL_BLOCKS = saved

    def prefill(self, params, tokens: np.ndarray, chunk: int, max_len: int, on_chunk=None):
        """tokens [1, N] in chunks of `chunk` (the last one padded); returns the first generated token. on_chunk(c)
        is called after each chunk has finished (synchronised) with {start, tokens, ms}; returning True stops."""
        N = tokens.shape[1]
        state = self.states.pop(max_len, None)
        if state is None:
            state = init_state(self.cfg, 1, max_len, kv_dtype=KV_DTYPE)
        reset = np.ones((1,), bool)  # the prompt starts a new request: its row is emptied with the first chunk
        nxt = None
        for lo in range(0, N, chunk):
            t = time.perf_counter()
            part = np.zeros((1, chunk), np.int32)
            n = min(chunk, N - lo)
            part[0, :n] = tokens[0, lo:lo + n]
            nxt, state = self.chunk_program(params, state, part, np.array([n], np.int32), reset)
            reset = None
            if on_chunk is not None:
                sync(nxt)
                if on_chunk({"start": lo, "tokens": n, "ms": 1e3 * (time.perf_counter() - t)}) and lo + chunk < N:
                    self.states[max_len] = state
                    return None
        self.states[max_len] = state
        return nxt


class PartsRunner:
    """The kernels' prefill split into separately jitted, separately synchronised parts, for a time breakdown:
    attention core (prefill_attention kernel + K/V write), attention projections (norm, QKV, head norms, RoPE, Wo and
    the residual), MoE MLP (routing, grouped GEMMs, shared expert, combine), dense MLP, embed + LM head."""

    def __init__(self, cfg: FlintConfig, gm_blocks=(None, None), attn_block=None):
        self.cfg = cfg

        def proj(h, layer, positions, sliding):
            a = L.rmsnorm(h, layer.attn_norm, cfg.rms_norm_eps)
            return L.project_qkv(a, layer.attn, positions, cfg, sliding)

        interpret = jax.default_backend() == "cpu"

        def core(q, k, v, cache, positions, valid, lengths_after, sinks, sliding):
            q_pos = jnp.where(valid, positions, -1)
            if sliding:
                o = pa.ring_attention(q, k, v, q_pos, cache, sinks, cfg.sliding_window, block=attn_block,
                                      interpret=interpret)
                return o, write_ring(cache, k, v, positions, valid)
            cache = write_full(cache, k, v, positions, valid)
            return pa.full_attention(q, q_pos, cache, lengths_after, sinks, block=attn_block,
                                     interpret=interpret), cache

        def out(h, o, w):
            return h + L.linear(o.reshape(*h.shape[:2], -1), w)

        self.proj = jax.jit(proj, static_argnames=("sliding",))
        self.core = jax.jit(core, static_argnames=("sliding",), donate_argnames=("cache",))
        self.out = jax.jit(out)
        self.mlp = jax.jit(lambda h, layer: P.mlp_block(h, layer, cfg, blocks=gm_blocks))
        self.base = Runner(cfg, "kernels", gm_blocks, attn_block)

    def prefill(self, params, tokens: np.ndarray, chunk: int, max_len: int, on_chunk=None):
        """Returns (parts: seconds per part, per_chunk: [{start, tokens, ms}], complete: bool); on_chunk(c) may
        return True to stop after chunk c."""
        cfg, N = self.cfg, tokens.shape[1]
        state = init_state(cfg, 1, max_len, kv_dtype=KV_DTYPE)
        parts = {"attention core": 0.0, "attention projections": 0.0, "MoE MLP": 0.0, "dense MLP": 0.0,
                 "embed + LM head": 0.0}
        per_chunk = []

        def tick(key, t):
            now = time.perf_counter()
            parts[key] += now - t
            return now

        for lo in range(0, N, chunk):
            t_chunk = t = time.perf_counter()
            part = np.zeros((1, chunk), np.int32)
            n = min(chunk, N - lo)
            part[0, :n] = tokens[0, lo:lo + n]
            n_new = jnp.array([n], jnp.int32)
            positions, valid, lengths_after = self.base.inputs(state.lengths, n_new, T=chunk)
            h = sync(self.base.embed(params.embed, jnp.asarray(part)))
            t = tick("embed + LM head", t)
            caches = []
            for i, (layer, cache) in enumerate(zip(params.layers, state.layers)):
                sl = cfg.is_sliding(i)
                q, k, v = sync(self.proj(h, layer, positions, sliding=sl))
                t = tick("attention projections", t)
                o, cache = sync(self.core(q, k, v, cache, positions, valid, lengths_after, layer.attn.sinks,
                                          sliding=sl))
                t = tick("attention core", t)
                h = sync(self.out(h, o, layer.attn.o))
                t = tick("attention projections", t)
                h = sync(self.mlp(h, layer))
                t = tick("MoE MLP" if cfg.is_moe(i) else "dense MLP", t)
                caches.append(cache)
            state = KVState(layers=tuple(caches), lengths=lengths_after)
            if lo + chunk >= N:
                sync(self.base.head(params.final_norm, params.lm_head, h, n_new))
                t = tick("embed + LM head", t)
            per_chunk.append({"start": lo, "tokens": n, "ms": 1e3 * (time.perf_counter() - t_chunk)})
            if on_chunk and on_chunk(per_chunk[-1]) and lo + chunk < N:
                return parts, per_chunk, False
        return parts, per_chunk, True


# ---- sections -------------------------------------------------------------------------------------------------------
def section_check(run: Run, cfg: FlintConfig, tiny: bool) -> None:
    """Kernels vs references at moderate shapes (compiled on the GPU; interpret mode with --tiny)."""
    interpret = jax.default_backend() == "cpu"
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    rows = 96 if tiny else 4096
    key = jax.random.split(jax.random.key(11), 8)
    ids = jax.random.randint(key[0], (rows,), 0, E)
    ids = jnp.where(jnp.arange(rows) < rows // 4, 3, ids)  # a crowded expert
    ids = jnp.where(ids == 5, 6, ids)  # an empty one
    ids = jnp.sort(ids)
    sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
    x = jax.random.normal(key[1], (rows, H), F32).astype(BF16)
    xa = jax.random.normal(key[2], (rows, I), F32).astype(BF16)
    src = jax.random.randint(key[6], (rows,), 0, rows)  # gathered rows (repeats, like a token's K slots)
    dst = jax.random.permutation(key[7], rows)  # scattered rows
    for kind in ("bf16", "nvfp4"):
        if kind == "bf16":
            g = (jax.random.normal(key[3], (E, I, H), F32) / math.sqrt(H)).astype(BF16)
            u = (jax.random.normal(key[4], (E, I, H), F32) / math.sqrt(H)).astype(BF16)
            d = (jax.random.normal(key[5], (E, H, I), F32) / math.sqrt(I)).astype(BF16)
        else:
            gsc = jnp.linspace(0.5, 2.0, E).astype(F32)
            g, u, d = (dataclasses.replace(nvfp4.random(k, s, 1 / math.sqrt(s[-1])), global_scale=gsc)
                       for k, s in ((key[3], (E, I, H)), (key[4], (E, I, H)), (key[5], (E, H, I))))
        # Arrays go in as arguments (closed-over arrays would become constants of the compiled program).
        for name, fn, ref, args in (
                ("grouped_swiglu", functools.partial(gm.grouped_swiglu, interpret=interpret), gm.ref_grouped_swiglu,
                 (x, g, u, sizes)),
                ("grouped_matmul down", functools.partial(gm.grouped_matmul, interpret=interpret),
                 gm.ref_grouped_matmul, (xa, d, sizes)),
                ("grouped_matmul down, weights as rhs", functools.partial(  # the table before run N
                    gm.grouped_matmul, interpret=interpret, block=gm.Block(64 if tiny else 128, 128, 64, 8, 3)),
                 gm.ref_grouped_matmul, (xa, d, sizes)),
                ("grouped_swiglu, rows gathered by index",
                 lambda x, g, u, s, r: gm.grouped_swiglu(x, g, u, s, rows=r, interpret=interpret),
                 lambda x, g, u, s, r: gm.ref_grouped_swiglu(x, g, u, s, rows=r), (x, g, u, sizes, src)),
                ("grouped_matmul down, rows scattered by index",
                 lambda x, d, s, r: gm.grouped_matmul(x, d, s, out_rows=r, out_size=rows, interpret=interpret),
                 lambda x, d, s, r: gm.ref_grouped_matmul(x, d, s, out_rows=r, out_size=rows),
                 (xa, d, sizes, dst)),
                # The 8K table's SwiGLU block with its tail blocks (this check's 4,096 rows would pick the few-rows
                # table): the crowded and the small experts end in tiles of every size.
                ("grouped_swiglu, rows gathered, 8K table's block and tails",
                 lambda x, g, u, s, r: gm.grouped_swiglu(
                     x, g, u, s, rows=r, interpret=interpret, block=table_block(kind, "swiglu", tiny),
                     tails=table_tails(kind, "swiglu", tiny)),
                 lambda x, g, u, s, r: gm.ref_grouped_swiglu(x, g, u, s, rows=r), (x, g, u, sizes, src))):
            what = f"{name} {kind}"
            try:
                st = bf16_ulp_stats(jax.jit(fn)(*args), jax.jit(ref)(*args))
                st["ok"] = check_ok(st)
                run.results["check"][what] = st
                log(f"check {what}: {st}")
            except Exception as e:  # noqa: BLE001
                run.error(f"check {what}", e)
    # Router logits: three BF16 parts on the tensor cores (prefill.router_logits_bf16x3) against the FP32 einsum.
    try:
        router = jax.random.normal(key[3], (E, H), F32) * 0.02
        bias = jax.random.normal(key[4], (E,), F32) * 0.01
        got = jax.jit(P.router_logits_bf16x3)(x, router)
        want, scale = jax.jit(lambda x, w: (L.router_logits(x, w), L.router_logits(jnp.abs(x), jnp.abs(w))))(
            x, router)
        ids_got = jax.jit(lambda l: L.route_from_logits(l, bias, cfg)[0])(got)
        ids_want = jax.jit(lambda l: L.route_from_logits(l, bias, cfg)[0])(want)
        rel = float(jnp.max(jnp.abs(got - want) / scale))
        rows_differ = float(jnp.mean(jnp.any(ids_got != ids_want, axis=-1)))
        run.results["check_router"] = {"max_err_over_abs_sum": rel, "rows_with_other_experts": rows_differ,
                                       "rows": int(x.shape[0]), "ok": rel < 2 ** -20}
        log(f"check router_logits: max |err| / sum|terms| {rel:.2e}, rows routed differently {rows_differ:.4%}")
    except Exception as e:  # noqa: BLE001
        run.error("check router_logits", e)
    # Attention: Flint's heads, a chunk after some history (the ring wraps), two rows of different lengths.
    Hq, KV, D, W = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    B, T, S = 2, (24 if tiny else 1024), (96 if tiny else 4096)
    hist = jnp.array([(7 if tiny else 700), 3], jnp.int32)
    n_new = jnp.array([T, T // 3], jnp.int32)
    ks = jax.random.split(jax.random.key(12), 6)
    q = jax.random.normal(ks[0], (B, T, Hq, D), F32).astype(BF16)
    k = jax.random.normal(ks[1], (B, T, KV, D), F32).astype(BF16)
    v = jax.random.normal(ks[2], (B, T, KV, D), F32).astype(BF16)
    Hh = int(hist.max())
    hk = jax.random.normal(ks[3], (B, Hh, KV, D), F32).astype(BF16)
    hv = jax.random.normal(ks[4], (B, Hh, KV, D), F32).astype(BF16)
    hpos = jnp.broadcast_to(jnp.arange(Hh), (B, Hh))
    hval = hpos < hist[:, None]
    t = jnp.arange(T)[None]
    positions, valid = hist[:, None] + t, t < n_new[:, None]
    q_pos = jnp.where(valid, positions, -1)
    sinks = jnp.linspace(-3.0, 3.0, Hq).astype(F32).at[0].set(-jnp.inf)
    ring = write_ring(RingCache(jnp.zeros((B, KV, W, D), BF16), jnp.zeros((B, KV, W, D), BF16),
                                jnp.full((B, W), -1, jnp.int32)), hk, hv, hpos, hval)
    full = write_full(write_full(FullCache(jnp.zeros((B, KV, S, D), BF16), jnp.zeros((B, KV, S, D), BF16)),
                                 hk, hv, hpos, hval), k, v, positions, valid)
    rows_ok = np.asarray(valid)
    for what, fn, ref, args in (
            ("ring_attention", functools.partial(pa.ring_attention, window=W, interpret=interpret),
             functools.partial(pa.ref_ring_attention, window=W), (q, k, v, q_pos, ring, sinks)),
            ("full_attention", functools.partial(pa.full_attention, interpret=interpret), pa.ref_full_attention,
             (q, q_pos, full, hist + n_new, sinks))):
        try:
            got = jax.jit(fn)(*args)
            # The reference's P @ V is an FP32 einsum: keep XLA from running it in TF32 on the GPU.
            with jax.default_matmul_precision("highest"):
                want = jax.jit(ref)(*args)
            bf16_p = pa.resolve_pv(None, interpret) == "bf16"
            value_max = float(jnp.max(jnp.abs(jnp.concatenate([v.reshape(-1), hv.reshape(-1)]).astype(F32))))
            st = bf16_ulp_stats(np.asarray(got, np.float32)[rows_ok].astype(jnp.bfloat16),
                                np.asarray(want, np.float32)[rows_ok].astype(jnp.bfloat16),
                                value_max if bf16_p else None)
            st["ok"] = check_ok(st)
            run.results["check"][what] = st
            log(f"check {what}: {st}")
        except Exception as e:  # noqa: BLE001
            run.error(f"check {what}", e)
    run.save()


def moe_inputs(cfg: FlintConfig, tokens: int, counts=None):
    """`tokens` tokens routed uniformly at random (top-k distinct): (the (token, slot) pairs' rows sorted by expert
    [N*K, H], group sizes [E], the tokens [N, H], the sort order [N*K]: sorted pair r is pair order[r], token
    order[r] // K). counts [E] (summing to N*K): these rows per expert instead, the pairs in random order."""
    E, I, H, K = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    ks = jax.random.split(jax.random.key(21), 8)
    b = jax.random.normal(ks[0], (tokens, H), F32).astype(BF16)
    scores = jax.random.uniform(ks[1], (tokens, E))
    _, ids = jax.lax.top_k(scores, K)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    if counts is not None:
        sizes = jnp.asarray(counts, jnp.int32)
        order = jax.random.permutation(ks[2], tokens * K)
    x = b[order // K]
    return x, sizes, b, order.astype(jnp.int32)


def table_block(kind: str, mode: str, tiny: bool) -> gm.Block:
    """The 8K table's block (--tiny: its rows cut to 64, what interpret mode can afford)."""
    b = gm.BLOCKS[(kind, mode)]
    return dataclasses.replace(b, bm=min(b.bm, 64)) if tiny else b


def table_tails(kind: str, mode: str, tiny: bool) -> tuple[gm.Block, ...]:
    """The 8K table's tail blocks (--tiny: 32 and 16 rows, below table_block's 64)."""
    tails = gm.TAIL_BLOCKS.get((kind, mode), ())
    return tuple(dataclasses.replace(t, bm=32 >> i) for i, t in enumerate(tails)) if tiny else tails


def visits(counts: np.ndarray, bm: int) -> int:
    """Tiles of bm rows the grouped kernels run for these rows per expert (grouped_matmul.group_layout)."""
    return int(np.sum(-(-np.asarray(counts) // bm)))


def routing_balance(runner: "Runner", params, tokens: np.ndarray, cfg: FlintConfig) -> dict:
    """Rows per expert at each MoE layer of this model on this prompt (one chunk through the per-layer loop, the
    routing of layers.route on the MLP half's input): how far the synthetic model's routing is from uniform. The
    grouped kernels' work depends on it: each expert's rows run in tiles of BM rows (grouped_matmul), so an expert
    past a tile boundary costs a whole extra visit (with NVFP4, another decode of its weight tiles)."""
    E = cfg.n_routed_experts

    @jax.jit
    def counts(h, router, bias, norm, valid):
        b = L.rmsnorm(h, norm, cfg.rms_norm_eps).reshape(-1, h.shape[-1])
        ids, _ = L.route(b, router, bias, cfg)
        ids = jnp.where(valid.reshape(-1, 1), ids, E)  # padding tokens are not counted
        return jnp.sum(ids.reshape(-1)[:, None] == jnp.arange(E)[None, :], axis=0)

    per_layer = {}

    def hook(i, h, layer, valid):
        if hasattr(layer.mlp, "router"):
            per_layer[i] = counts(h, layer.mlp.router, layer.mlp.router_bias, layer.mlp_norm, valid)

    runner.on_mlp_input = hook
    try:
        N = tokens.shape[1]
        state = init_state(cfg, 1, N, kv_dtype=KV_DTYPE)
        sync(runner.chunk(params, state, jnp.asarray(tokens), jnp.array([N], jnp.int32))[0])
    finally:
        runner.on_mlp_input = None
    layers = {i: np.asarray(c) for i, c in per_layer.items()}
    rows = N * cfg.num_experts_per_tok
    out = {"tokens": N, "pairs": rows, "experts": E, "mean_rows": rows / E, "layers": {}}
    for i, c in layers.items():
        out["layers"][i] = {"max": int(c.max()), "min": int(c.min()), "empty": int(np.sum(c == 0)),
                            **{f"visits_{bm}": visits(c, bm) for bm in (64, 128, 256)}, "counts": c.tolist()}
    v256 = sorted(out["layers"].items(), key=lambda kv: kv[1]["visits_256"])
    out["median_layer"] = v256[len(v256) // 2][0] if v256 else None
    # Uniformly random routing (what section_moe's sweep uses) for comparison: the expected visits, sampled.
    rng = np.random.default_rng(0)
    uni = np.bincount(np.argsort(rng.random((N, E)), axis=1)[:, :cfg.num_experts_per_tok].reshape(-1), minlength=E)
    out["uniform"] = {"max": int(uni.max()), **{f"visits_{bm}": visits(uni, bm) for bm in (64, 128, 256)}}
    return out


def section_moe(run: Run, cfg: FlintConfig, tokens: int, tiny: bool, phase: str = "main", counts=None,
                kinds: tuple[str, ...] | None = None, label: str | None = None) -> None:
    """Expert GEMMs of one MoE layer. phase "main": our kernels with the table's blocks and our reference; "jax":
    jax's options (BF16; run after the model's headline numbers: ragged_dot_mgpu unrolls its 256 groups, and a
    long compile must not eat their budget); "sweep": the other block candidates (the best per kernel is reported);
    "program_routing": the table's blocks (and PROGRAM_ROUTING_EXTRA) at `counts` rows per expert instead of uniform
    routing, the results under `label`."""
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    K = cfg.num_experts_per_tok
    x, sizes, tok, order = jax.jit(moe_inputs, static_argnums=(0, 1))(cfg, tokens, counts)
    R = x.shape[0]
    res = run.results["moe"]
    res["shape"] = {"tokens": tokens, "pairs": R, "experts": E, "H": H, "I": I}
    fl_gate = 2 * R * H * I
    fl_layer = 3 * fl_gate
    interpret = jax.default_backend() == "cpu"
    for kind in kinds or (("nvfp4", "bf16") if not tiny else ("nvfp4",)):
        if phase == "jax" and (kind != "bf16" or tiny):
            continue
        if phase == "sweep" and kind not in run.args.sweep_kinds.split(","):
            continue
        if not run.allows(15 if not tiny else 2, f"moe {kind} {phase}"):
            break
        ks = jax.random.split(jax.random.key(22), 3)

        @jax.jit
        def make(ks):
            if kind == "bf16":
                return tuple((jax.random.normal(k, s, F32) / math.sqrt(s[-1])).astype(BF16)
                             for k, s in ((ks[0], (E, I, H)), (ks[1], (E, I, H)), (ks[2], (E, H, I))))
            return tuple(nvfp4.random(k, s, 1 / math.sqrt(s[-1]))
                         for k, s in ((ks[0], (E, I, H)), (ks[1], (E, I, H)), (ks[2], (E, H, I))))
        g, u, d = make(ks)
        act = jax.jit(gm.ref_grouped_swiglu)(x, g, u, sizes) if phase != "jax" else None
        out = res.setdefault(label or kind, {})
        picks = []
        # As flint_jax.prefill calls them: SwiGLU gathers each pair's token row by index, the down projection
        # scatters each result to its pair's row (the sorted copy and the un-permuting gather are not made).
        index_args = ({"rows": order // K}, {"out_rows": order, "out_size": R})
        for (mode, w_args, xin), idx in zip((("swiglu", (g, u), tok), ("linear", (d,), act)), index_args):
            default = gm.default_block(kind, mode, R / E)
            tails = gm.default_tails(kind, mode, R / E)
            # "table": what the prefill runs (the table's block, and its tail blocks where it has them)
            table = ["table"] + ([default] if tails else [])
            extra = PROGRAM_ROUTING_EXTRA.get((kind, mode), [])
            cands = {"main": table + [c for c in extra if isinstance(c, tuple)], "jax": [],
                     "sweep": [b for b in GM_SWEEP[(kind, mode)] if b != default],
                     "program_routing": table + extra}[phase]
            for blk in cands:
                if not run.allows(4 if not tiny else 1, f"moe {kind} {mode} {blk}"):
                    break
                opts = ({"block": None} if blk == "table" else
                        {"block": blk[0], "tails": blk[1]} if isinstance(blk, tuple) else {"block": blk, "tails": ()})
                fn = (jax.jit(functools.partial(gm.grouped_swiglu, interpret=interpret, **opts, **idx))
                      if mode == "swiglu" else
                      jax.jit(functools.partial(gm.grouped_matmul, interpret=interpret, **opts, **idx)))
                if blk == "table":
                    blk = f"table {default}" + (f" + tails {[t.bm for t in tails]}" if tails else "")
                elif isinstance(blk, tuple):
                    blk = f"{blk[0]} + tails {[t.bm for t in blk[1]]}"
                try:
                    first, ms = time_fn(lambda: fn(xin, *w_args, sizes))
                    m = min(ms)
                    flops = 2 * fl_gate if mode == "swiglu" else fl_gate
                    row = out[f"ours {mode} {blk}"] = {
                        "ms": m, "tflops": flops / m / 1e9, "compile_s": first, "mode": mode,
                        "block": dataclasses.asdict(blk) if isinstance(blk, gm.Block) else blk}
                    dev = kernel_ms(lambda: fn(xin, *w_args, sizes)) if phase != "jax" else None
                    if dev:
                        row.update(device_ms=dev, device_tflops=flops / dev / 1e9)
                    log(f"moe {kind} ours {mode} {blk}: {m:.3f} ms, {flops / m / 1e9:.1f} TFLOP/s"
                        + (f"; device {dev:.3f} ms" if dev else ""))
                except Exception as e:  # noqa: BLE001
                    run.error(f"moe {kind} ours {mode} {blk}", e)
            timed = [v for v in out.values() if isinstance(v, dict) and v.get("mode") == mode]
            picks.append(min(timed, key=rank_ms) if timed else None)
        if all(p is not None for p in picks):
            total = sum(rank_ms(p) for p in picks)
            out["ours layer (best blocks so far)"] = {"ms": total, "tflops": fl_layer / total / 1e9,
                                                      "blocks": [p["block"] for p in picks]}
        if phase in ("sweep", "program_routing"):
            del g, u, d, act
            run.save()
            continue
        # Our tiled plain-JAX reference (the whole layer's three GEMMs).
        if phase == "main" and run.allows(10 if not tiny else 1, f"moe {kind} reference"):
            try:
                ref = jax.jit(lambda x, g, u, d, sizes: gm.ref_grouped_matmul(gm.ref_grouped_swiglu(x, g, u, sizes),
                                                                               d, sizes))
                first, ms = time_fn(lambda: ref(x, g, u, d, sizes), reps=2)
                out["reference (tiled einsum) layer"] = {"ms": min(ms), "tflops": fl_layer / min(ms) / 1e9}
                log(f"moe {kind} reference layer: {min(ms):.2f} ms")
            except Exception as e:  # noqa: BLE001
                run.error(f"moe {kind} reference", e)
        # jax's options, on one gate projection (BF16 only: they take one dtype for both operands).
        if phase == "jax":
            rhs = jnp.swapaxes(g, 1, 2)  # [E, H, I]
            for label, flag in (("lax.ragged_dot (default GPU lowering)", False),
                                ("lax.ragged_dot (pallas triton lowering flag)", True)):
                if not run.allows(15, f"moe {label}"):
                    break
                try:
                    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", flag)
                    f = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=F32).astype(BF16))
                    first, ms = time_fn(lambda: f(x, rhs, sizes), reps=2)
                    out[f"{label}, gate only"] = {"ms": min(ms), "tflops": fl_gate / min(ms) / 1e9,
                                                  "compile_s": first}
                    log(f"moe {label}: {min(ms):.2f} ms ({fl_gate / min(ms) / 1e9:.1f} TFLOP/s useful)")
                except Exception as e:  # noqa: BLE001
                    out[f"{label}, gate only"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    run.error(f"moe {label}", e)
                finally:
                    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", False)
            if run.allows(20, "moe ragged_dot_mgpu"):
                try:
                    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
                    f = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, block_m=128, block_n=128, block_k=64,
                                                  max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True))
                    first, ms = time_fn(lambda: f(x, g, group_sizes=sizes), reps=2)
                    out["ragged_dot_mgpu (Mosaic GPU), gate only"] = {"ms": min(ms), "compile_s": first,
                                                                      "tflops": fl_gate / min(ms) / 1e9}
                    log(f"moe ragged_dot_mgpu: {min(ms):.3f} ms ({fl_gate / min(ms) / 1e9:.1f} TFLOP/s)")
                except Exception as e:  # noqa: BLE001
                    out["ragged_dot_mgpu (Mosaic GPU), gate only"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    run.error("moe ragged_dot_mgpu", e)
        del g, u, d, act
        run.save()


def section_attn(run: Run, cfg: FlintConfig, T: int, long_ctx: int, tiny: bool, phase: str = "main") -> None:
    """Prefill attention for one chunk of T queries: sliding ring; full at offset 0 and at ~long_ctx. phase "main":
    the default block and the references; "sweep": other blocks on the full layer at offset 0."""
    Hq, KV, D, W = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    B = 1
    ks = jax.random.split(jax.random.key(31), 4)
    q = jax.random.normal(ks[0], (B, T, Hq, D), F32).astype(BF16)
    k = jax.random.normal(ks[1], (B, T, KV, D), F32).astype(BF16)
    sinks = jnp.zeros((Hq,), F32)
    res = run.results["attn"]
    interpret = jax.default_backend() == "cpu"
    cases = ((0, "ring"), (0, "full"), (long_ctx - T, "full")) if phase == "main" else ((0, "full"), (0, "ring"))
    for offset, mode in cases:
        S = offset + T
        positions = (offset + jnp.arange(T, dtype=jnp.int32))[None]
        if mode == "ring":
            ring = RingCache(k[:, :W].swapaxes(1, 2) if T >= W else jnp.zeros((B, KV, W, D), BF16),
                             k[:, :W].swapaxes(1, 2) if T >= W else jnp.zeros((B, KV, W, D), BF16),
                             jnp.full((B, W), -1, jnp.int32))
            keys_per_q = np.minimum(np.arange(T) + 1, W)
        else:
            full = FullCache(jnp.zeros((B, KV, S, D), BF16) + 0.01, jnp.zeros((B, KV, S, D), BF16) + 0.01)
            keys_per_q = offset + np.arange(T) + 1
        flops = 4 * Hq * D * float(keys_per_q.sum())
        cands = [pa.DEFAULT_BLOCK] if phase == "main" else ATTN_SWEEP
        base = None  # the sweep compares every block's output with the default block's
        for blk in cands:
            label = f"{mode} T={T} offset={offset} {blk}"
            if not run.allows(5, f"attn {label}"):
                break
            try:
                if mode == "ring":
                    f = jax.jit(functools.partial(pa.ring_attention, window=W, block=blk, interpret=interpret))
                    args = (q, k, k, positions, ring, sinks)
                else:
                    f = jax.jit(functools.partial(pa.full_attention, block=blk, interpret=interpret))
                    args = (q, positions, full, jnp.array([S], jnp.int32), sinks)
                first, ms = time_fn(lambda: f(*args), reps=2)
                m = min(ms)
                res[label] = {"ms": m, "tflops": flops / m / 1e9, "compile_s": first}
                dev = kernel_ms(lambda: f(*args))
                diff = ""
                if dev:
                    res[label].update(device_ms=dev, device_tflops=flops / dev / 1e9)
                    diff = f"; device {dev:.3f} ms, {flops / dev / 1e9:.1f} TFLOP/s"
                if phase != "main":
                    o = np.asarray(f(*args), np.float32)
                    if base is None:
                        base = o
                    else:
                        res[label]["max_abs_diff_vs_default"] = d = float(np.max(np.abs(o - base)))
                        diff += f", max |o - default| {d:.3g}"
                log(f"attn ours {label}: {m:.3f} ms, {flops / m / 1e9:.1f} TFLOP/s{diff}")
            except Exception as e:  # noqa: BLE001
                run.error(f"attn {label}", e)
        if phase != "main":
            run.save()
            continue
        # The reference where its [T, S] scores fit comfortably (up to ~12 GB of FP32 scores).
        score_bytes = 4 * Hq * T * (S + (W if mode == "ring" else 0))
        if score_bytes <= 12e9 and run.allows(10, f"attn reference {mode} offset={offset}"):
            try:
                if mode == "ring":
                    rf = jax.jit(functools.partial(pa.ref_ring_attention, window=W))
                    args = (q, k, k, positions, ring, sinks)
                else:
                    rf = jax.jit(pa.ref_full_attention)
                    args = (q, positions, full, jnp.array([S], jnp.int32), sinks)
                first, ms = time_fn(lambda: rf(*args), reps=2)
                res[f"reference {mode} T={T} offset={offset}"] = {"ms": min(ms), "tflops": flops / min(ms) / 1e9}
                log(f"attn reference {mode} offset={offset}: {min(ms):.2f} ms")
            except Exception as e:  # noqa: BLE001
                run.error(f"attn reference {mode} offset={offset}", e)
        elif score_bytes > 12e9:
            res[f"reference {mode} T={T} offset={offset}"] = {
                "skipped": f"layers.attend would materialise {score_bytes / 1e9:.0f} GB of FP32 scores"}
        run.save()


def kernel_category(name: str) -> str:
    """The part of a prefill a GPU kernel belongs to, from its name (Pallas kernels are named by pallas_call; XLA's
    GEMMs come from cuBLAS/CUTLASS)."""
    n = name.lower()
    if "prefill_attention" in n:
        return "attention (Pallas)"
    if "grouped_" in n:
        return "MoE grouped GEMMs (Pallas)"
    # (cuBLAS's Hopper GEMM kernels are named nvjet_*; runs W-AD counted them as "other XLA", ~15 ms of it)
    if any(k in n for k in ("gemm", "cutlass", "xmma", "cublas", "matmul", "nvjet")):
        return "dense GEMMs (XLA: QKV, O, shared expert, dense MLP, LM head)"
    return "other XLA (norms, RoPE, routing, sort, gathers, cache writes, copies)"


def profile_prefill(runner, params, tokens: np.ndarray, chunk: int, out_dir: str) -> dict | None:
    """One prefill under the profiler: its device span, kernel time by part (kernel_category) and the top kernels.
    None where the trace has no device events (CPU)."""
    N = tokens.shape[1]
    events = device_trace.trace_kernels(lambda: runner.prefill(params, tokens, chunk, N), out_dir)
    if not events:
        return None
    summary = device_trace.summarize(events, 1)
    # Every kernel, with the trace's own arguments of its first launch (the HLO op it ran, where the trace names
    # it), so a fusion can be traced back to its source op through an XLA dump (XLA_FLAGS=--xla_dump_to=...).
    first_args = {}
    for e in events:
        first_args.setdefault(e["name"], e.get("args", {}))
    with open(os.path.join(out_dir, "kernels.json"), "w") as f:
        json.dump([{**r, "args": first_args.get(r["name"], {})} for r in summary["rows"]], f, indent=1,
                  default=str)
    parts: dict = {}
    for r in summary["rows"]:
        c = kernel_category(r["name"])
        parts[c] = parts.get(c, 0.0) + r["us_per_step"] / 1e3
    gaps = device_trace.idle_gaps(events, 1)
    # The longest idle stretch (runs AO-AR: ~9-11 ms before the program's first kernel) and what the host did then.
    gap = device_trace.longest_gap(events)
    host = []
    if gap is not None:
        host = [{"name": r["name"][:100], "count": r["count"], "ms": r["overlap_us"] / 1e3}
                for r in device_trace.host_activity(device_trace.read_host_events(out_dir), *gap, top=30)]
        log(f"longest device gap {1e-3 * (gap[1] - gap[0]):.2f} ms; host meanwhile: "
            + "; ".join(f"{r['name'][:70]} x{r['count']} {r['ms']:.2f} ms" for r in host[:30]))
    return {"device_span_ms": device_trace.device_ms(events, 1), "kernel_ms": summary["kernel_us_per_step"] / 1e3,
            "launches": int(summary["launches_per_step"]), "idle_ms": gaps["idle_us_per_step"] / 1e3,
            "idle_before": [{"name": r["name"][:90], "gaps": int(r["gaps_per_step"]), "ms": r["idle_us_per_step"] / 1e3,
                             "mean_us": r["mean_us"]} for r in gaps["rows"]],
            "longest_gap_ms": None if gap is None else (gap[1] - gap[0]) / 1e3, "host_in_longest_gap": host,
            "parts_ms": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            "top": [{"name": r["name"][:90], "count": int(r["per_step"]), "ms": r["us_per_step"] / 1e3}
                    for r in summary["rows"][:15]]}


def section_prefill(run: Run, cfg: FlintConfig, kind: str, params, tokens: np.ndarray, chunk: int, tiny: bool,
                    reserve: float, which: str) -> None:
    """which="headline": the kernels on the one-chunk prompt; "extras": the kernels in chunks, and the reference
    on the one-chunk prompt. The kernels use the block tables' defaults."""
    N = tokens.shape[1]
    res = run.results["prefill"].setdefault(kind, {})
    fl = prefill_flops(cfg, 0, N)
    res["flops"] = fl
    if which == "headline":
        # The engine's path (prefill_pipeline) is the headline; the per-layer loop beside it for comparison
        # (it sees new buffers on every call; it was 28-55 ms slower per 8K prompt in runs Y and Z).
        todo = [("program", f"one chunk of {N}" + ("" if v == "default" else f", {v}"), N, v)
                for v in run.args.program_variants.split(",")]
        todo.append(("kernels", f"one chunk of {N}, per-layer calls", N, None))
    else:  # (--tiny: the TTFT run already covers chunking)
        todo = (([] if tiny else [("kernels", f"chunks of {chunk}", chunk, None)])
                + [("reference", f"one chunk of {N}", N, None)])
    for impl, label, c, variant in todo:
        # first call (compile) + two timed runs on the H200: per-layer loop 12-14 s per row; the whole-chunk
        # program's first call took 22-42 s (runs W-Z)
        need = {"program": 75, "kernels": 25}.get(impl, 30) if not tiny else 3
        if not run.allows(need + reserve, f"prefill {kind} {impl} {label}"):
            continue
        runner = ProgramRunner(cfg, PROGRAM_VARIANTS[variant]) if impl == "program" else Runner(cfg, impl)
        try:
            # The program's first timed call also records its command buffer (~300 ms more in runs AN-AQ), so one
            # timed call was left; with one the BF16 program read 132.8 and 137.8 ms in one run (run AQ).
            reps = 1 if tiny else 4 if impl == "program" else 2
            first, ms = time_fn(lambda: runner.prefill(params, tokens, c, N), reps=reps)
            m = min(ms)
            res[f"{impl}, {label}"] = {"ms": m, "tflops": fl["total"] / m / 1e9, "first_call_s": first,
                                       "all_ms": ms}
            log(f"prefill {kind} {impl} {label}: {m:.1f} ms, {fl['total'] / m / 1e9:.1f} TFLOP/s "
                f"(first call {first:.1f} s)")
            if impl == "program":  # the host's share: when runner.prefill returns (all dispatched) and when done
                back, done = [], []
                for _ in range(3):
                    t = time.perf_counter()
                    out = runner.prefill(params, tokens, c, N)
                    back.append(1e3 * (time.perf_counter() - t))
                    sync(out)
                    done.append(1e3 * (time.perf_counter() - t))
                res[f"{impl}, {label}"].update(returns_after_ms=back, done_after_ms=done)
                log(f"prefill {kind} {impl} {label}: the call returns after "
                    + ", ".join(f"{b:.1f}" for b in back) + " ms, done after " + ", ".join(f"{d:.1f}" for d in done))
            if impl == "program":  # the same prompt into a freshly allocated state (new buffer addresses)
                runner.states.clear()
                t = time.perf_counter()
                sync(runner.prefill(params, tokens, c, N))
                res[f"{impl}, {label}"]["fresh_state_ms"] = 1e3 * (time.perf_counter() - t)
                log(f"prefill {kind} {impl} {label}, fresh state: {res[f'{impl}, {label}']['fresh_state_ms']:.1f} ms")
        except Exception as e:  # noqa: BLE001
            run.error(f"prefill {kind} {impl} {label}", e)
            continue
        if run.args.profile and impl != "reference" and run.allows(10 + reserve, f"profile {kind} {label}"):
            try:
                trace_dir = f"trace_{kind}_{impl}" + (f"_{variant}" if variant not in (None, "default") else "")
                prof = profile_prefill(runner, params, tokens, c, os.path.join(run.args.out, trace_dir))
                res[f"profile, {impl}, {label}"] = prof if prof is not None else {"skipped": "no device events (CPU)"}
                if prof is not None:
                    log(f"profile {kind} {label}: {prof['device_span_ms']:.1f} ms on the device, "
                        f"{prof['launches']} kernels; " + ", ".join(f"{k.split(' (')[0]} {v:.1f} ms"
                                                                      for k, v in prof["parts_ms"].items()))
            except Exception as e:  # noqa: BLE001
                run.error(f"profile {kind} {label}", e)
        if impl == "kernels" and which == "headline" and "routing" not in run.args.skip.split(","):
            try:
                rb = run.results["routing"][kind] = routing_balance(runner, params, tokens, cfg)
                med = rb["layers"][rb["median_layer"]]
                log(f"routing {kind}: rows per expert {rb['mean_rows']:.0f} on average; median layer "
                    f"{rb['median_layer']}: max {med['max']}, {med['empty']} empty, {med['visits_256']} visits of 256 "
                    f"rows (uniform routing: max {rb['uniform']['max']}, {rb['uniform']['visits_256']})")
            except Exception as e:  # noqa: BLE001
                run.error(f"routing {kind}", e)
        run.save()


def section_ttft(run: Run, cfg: FlintConfig, kind: str, params, n_tokens: int, chunk: int, gm_blocks,
                 attn_block, tiny: bool) -> None:
    res = run.results["ttft"].setdefault(kind, {})
    tokens = np.asarray(jax.random.randint(jax.random.key(41), (1, n_tokens), 0, cfg.vocab_size), np.int32)
    max_len = -(-n_tokens // 64) * 64
    fl = prefill_flops(cfg, 0, n_tokens)
    res.update({"tokens": n_tokens, "chunk": chunk, "flops": fl})
    n_chunks = -(-n_tokens // chunk)
    # The engine's path first (prefill_pipeline per chunk): the TTFT a user sees.
    try:
        prog = ProgramRunner(cfg)
        t = time.perf_counter()
        sync(prog.prefill(params, tokens[:, :chunk], chunk, max_len))
        res["program_warmup_s"] = time.perf_counter() - t
        log(f"ttft {kind} (engine program): compiled and warmed up in {res['program_warmup_s']:.1f} s")
        per_chunk = []

        def on_program_chunk(c):
            per_chunk.append(c)
            return run.left() < 3
        t = time.perf_counter()
        nxt = prog.prefill(params, tokens, chunk, max_len, on_chunk=on_program_chunk)
        wall = time.perf_counter() - t
        if nxt is None:
            msg = (f"ttft {kind} (engine program): budget ran out after {len(per_chunk)} of {n_chunks} chunks "
                   f"(partial: see program_per_chunk)")
            run.results["skipped"].append(msg)
            log(msg)
            res.update({"program_partial": True, "program_per_chunk": per_chunk})
        else:
            res.update({"program_ttft_s": wall, "program_per_chunk": per_chunk,
                        "program_tflops": fl["total"] / wall / 1e12})
            log(f"ttft {kind} {n_tokens} tokens (engine program): {wall:.2f} s; chunks (ms) "
                + ", ".join(f"{c['ms']:.0f}" for c in per_chunk))
        del prog
    except Exception as e:  # noqa: BLE001
        run.error(f"ttft {kind} (engine program)", e)
    run.save()
    if not run.allows(30, f"ttft {kind} breakdown (parts)"):
        return
    pr = PartsRunner(cfg, gm_blocks, attn_block)
    try:
        # Warm up (compile) on a short run with the same shapes: the first chunk of the same state size.
        t = time.perf_counter()
        pr.prefill(params, tokens[:, :chunk], chunk, max_len)
        res["warmup_s"] = time.perf_counter() - t
        log(f"ttft {kind}: compiled and warmed up in {res['warmup_s']:.1f} s")
        # Each chunk costs more than the last (full layers read the growing cache); stop early if over budget.
        t = time.perf_counter()

        def on_chunk(c):
            log(f"ttft {kind} chunk at {c['start']}: {c['ms']:.1f} ms")
            return run.left() < 3
        parts, per_chunk, complete = pr.prefill(params, tokens, chunk, max_len, on_chunk=on_chunk)
        wall = time.perf_counter() - t
        if not complete:
            msg = f"ttft {kind}: budget ran out after {len(per_chunk)} of {n_chunks} chunks (partial: see per_chunk)"
            run.results["skipped"].append(msg)
            log(msg)
            res.update({"partial": True, "per_chunk": per_chunk, "parts_s": parts})
            run.save()
            return
        res.update({"ttft_s": wall, "per_chunk": per_chunk, "parts_s": parts, "n_chunks": n_chunks,
                    "tflops": fl["total"] / wall / 1e12})
        log(f"ttft {kind} {n_tokens} tokens: {wall:.2f} s; parts {json.dumps({k: round(v, 3) for k, v in parts.items()})}")
    except Exception as e:  # noqa: BLE001
        run.error(f"ttft {kind}", e)
    run.save()


# ---- report -----------------------------------------------------------------------------------------------------------
def _dev(row: dict) -> str:
    return f"{row['device_ms']:.3f}" if row.get("device_ms") else "-"


def markdown(r: dict) -> str:
    try:
        return _markdown(r)
    except Exception as e:  # noqa: BLE001  (the JSON has everything; never lose a run to the report)
        return f"# Prefill benchmark\n\nMarkdown report failed ({type(e).__name__}: {e}); see bench_prefill.json.\n"


def _markdown(r: dict) -> str:
    m = r.get("meta", {})
    lines = [f"# Prefill benchmark ({m.get('device', '?')}, {m.get('mode', '')})", "",
             f"jax {m.get('jax', '?')}, config {m.get('config', '?')}, full-layer KV caches "
             f"{m.get('kv_dtype', 'bf16')}, budget {m.get('budget_s', '?')} s, wall {m.get('wall_s', '?')} s.", ""]
    if r.get("check"):
        lines += ["## Kernels vs references (GPU check)", "",
                  "| kernel | max abs err | ref rms | scaled err (<= 1 passes) | BF16 values differing | ok |",
                  "|---|---|---|---|---|---|"]
        for k, v in r["check"].items():
            lines.append(f"| {k} | {v['max_abs']:.2e} | {v.get('ref_rms', float('nan')):.3g} | "
                         f"{v.get('scaled_err', float('nan')):.2f} | {v['frac_differ']:.4%} | {v['ok']} |")
        lines.append("")
    if r.get("check_router"):
        c = r["check_router"]
        lines += [f"Router logits (three BF16 parts on the tensor cores vs the FP32 einsum, {c['rows']} rows): max "
                  f"|error| / sum of |terms| {c['max_err_over_abs_sum']:.2e}, rows routed to other experts "
                  f"{c['rows_with_other_experts']:.4%}, ok {c['ok']}.", ""]
    moe = r.get("moe", {})
    if moe:
        lines += [f"## MoE expert GEMMs, one layer ({moe.get('shape')})", "",
                  "| weights | variant | ms (wall) | TFLOP/s | device ms |", "|---|---|---|---|---|"]
        for kind in [k for k in moe if k != "shape"]:
            for k, v in moe[kind].items():
                if "ms" in v:
                    lines.append(f"| {kind} | {k} | {v['ms']:.3f} | {v['tflops']:.1f} | {_dev(v)} |")
                else:
                    lines.append(f"| {kind} | {k} | {v.get('error', v.get('skipped', ''))[:120]} | | |")
        lines.append("")
    for kind, rb in r.get("routing", {}).items():
        u = rb["uniform"]
        lines += [f"## Routing of the synthetic {kind} model ({rb['tokens']} tokens, {rb['mean_rows']:.0f} rows per "
                  "expert on average)", "",
                  "Tiles the grouped GEMMs run per MoE layer (visits of 64, 128 and 256 rows; uniformly random routing "
                  f"for comparison: max {u['max']} rows, {u['visits_64']} / {u['visits_128']} / {u['visits_256']} "
                  "visits). Layers by visits of 256 rows:", "",
                  "| layer | max rows | empty experts | visits 64 | visits 128 | visits 256 |",
                  "|---|---|---|---|---|---|"]
        ordered = sorted(rb["layers"].items(), key=lambda kv: kv[1]["visits_256"])
        picks = ordered if len(ordered) <= 6 else ordered[:2] + [ordered[len(ordered) // 2]] + ordered[-3:]
        lines += [f"| {i}{' (median)' if i == rb['median_layer'] else ''} | {v['max']} | {v['empty']} | "
                  f"{v['visits_64']} | {v['visits_128']} | {v['visits_256']} |" for i, v in picks]
        lines.append("")
    if r.get("attn"):
        lines += ["## Prefill attention (batch 1, one chunk)", "", "| case | ms (wall) | TFLOP/s | device ms |",
                  "|---|---|---|---|"]
        for k, v in r["attn"].items():
            if isinstance(v, dict) and "ms" in v:
                lines.append(f"| {k} | {v['ms']:.3f} | {v['tflops']:.1f} | {_dev(v)} |")
            elif isinstance(v, dict) and "skipped" in v:
                lines.append(f"| {k} | skipped: {v['skipped']} | | |")
        lines.append("")
    if r.get("prefill"):
        lines += ["## Prefill, batch 1 (target: <= 145 ms for 8,192 tokens, vLLM on a GB200)", "",
                  "| weights | run | ms | TFLOP/s |", "|---|---|---|---|"]
        for kind, d in r["prefill"].items():
            for k, v in d.items():
                if not isinstance(v, dict) or k == "flops" or k.startswith("profile"):
                    continue
                if "ms" in v:
                    lines.append(f"| {kind} | {k} | {v['ms']:.1f} | {v['tflops']:.1f} |")
                    if "returns_after_ms" in v:
                        lines.append(f"| {kind} | {k}: the call returns after (host) | "
                                     f"{statistics.median(v['returns_after_ms']):.1f} | |")
                else:
                    lines.append(f"| {kind} | {k} | {v.get('skipped', '')} | |")
        lines.append("")
    for kind, d in r.get("prefill", {}).items():
        for k, v in d.items():
            if not (k.startswith("profile") and isinstance(v, dict) and "parts_ms" in v):
                continue
            lines += [f"## Where the device time goes: {kind}, {k[len('profile, '):]}", "",
                      f"Device span {v['device_span_ms']:.1f} ms, {v['kernel_ms']:.1f} ms of kernel time in "
                      f"{v['launches']} kernels (one traced prefill).", "", "| part | ms | share |", "|---|---|---|"]
            lines += [f"| {p} | {ms:.1f} | {ms / v['kernel_ms']:.1%} |" for p, ms in v["parts_ms"].items()]
            lines += ["", "| kernel | launches | ms |", "|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['count']} | {t['ms']:.2f} |" for t in v["top"]]
            lines.append("")
            if v.get("idle_before"):
                lines += [f"Device idle inside the traced prefill: {v['idle_ms']:.1f} ms, by the kernel that ends each "
                          "gap:", "", "| idle before | gaps | ms | mean us |", "|---|---|---|---|"]
                lines += [f"| `{t['name']}` | {t['gaps']} | {t['ms']:.2f} | {t['mean_us']:.1f} |"
                          for t in v["idle_before"]]
                lines.append("")
            if v.get("host_in_longest_gap"):
                lines += [f"The host during the longest device gap ({v['longest_gap_ms']:.2f} ms; nested events each "
                          "count):", "", "| host event | count | ms in the gap |", "|---|---|---|"]
                lines += [f"| `{t['name']}` | {t['count']} | {t['ms']:.2f} |" for t in v["host_in_longest_gap"]]
                lines.append("")
    if r.get("ttft"):
        lines += ["## Time to first token, long prompt", ""]
        for kind, d in r["ttft"].items():
            if "program_ttft_s" in d:
                lines += [f"**{kind}**, the engine's path (prefill_pipeline, chunks of {d['chunk']}): TTFT "
                          f"{d['program_ttft_s']:.2f} s ({d['program_tflops']:.1f} TFLOP/s). Chunks (ms): "
                          + ", ".join(f"{c['ms']:.0f}" for c in d["program_per_chunk"]) + ".", ""]
            if "ttft_s" not in d:
                continue
            lines += [f"**{kind}**, breakdown run (each part its own synchronised call): {d['tokens']} tokens in "
                      f"chunks of {d['chunk']}: TTFT {d['ttft_s']:.2f} s "
                      f"({d['tflops']:.1f} TFLOP/s over {d['flops']['total'] / 1e15:.2f} PFLOP useful).", "",
                      "| part | s | share |", "|---|---|---|"]
            tot = sum(d["parts_s"].values())
            for k, v in d["parts_s"].items():
                lines.append(f"| {k} | {v:.3f} | {v / tot:.1%} |")
            lines += ["", "Parts are timed with a device sync after each call (their sum includes launch gaps).",
                      ""]
    for key, title in (("skipped", "Skipped"), ("errors", "Errors")):
        if r.get(key):
            lines += [f"## {title}", ""] + [f"- {s}" for s in r[key]] + [""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="FlintConfig.tiny() on the CPU (interpret mode)")
    ap.add_argument("--out", required=True, help="directory for bench_prefill.json and bench_prefill.md")
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop starting new work after this many seconds")
    ap.add_argument("--check", action="store_true", help="compare kernels with references before timing")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length of the prefill (default 8192)")
    ap.add_argument("--chunk", type=int, default=None, help="chunk size for chunked runs (default 2048; TTFT 8192)")
    ap.add_argument("--long", type=int, default=None, help="TTFT prompt length (default 100000)")
    ap.add_argument("--weights", default="nvfp4,bf16", help="weight formats to run, in order")
    ap.add_argument("--no-sweep", action="store_true", help="skip the block sweeps (table defaults)")
    ap.add_argument("--sweep-kinds", default="nvfp4,bf16", help="weight formats of the grouped-GEMM block sweep")
    ap.add_argument("--profile", action="store_true",
                    help="also trace the one-chunk prefill with the kernels: device time by part and top kernels")
    ap.add_argument("--attn-block", default=None, metavar="ROWS,BK,WARPS,STAGES",
                    help="run with this prefill-attention block instead of prefill_attention.DEFAULT_BLOCK")
    ap.add_argument("--skip", default="",
                    help="comma list of sections to skip: moe,attn,prefill,ttft,extras (chunked and reference runs), "
                         "jax (jax's own MoE options), routing (the model's routing balance and the grouped GEMMs at "
                         "it)")
    ap.add_argument("--program-variants", default="default", metavar="NAME[,NAME]",
                    help="time the engine's prefill in these variants too: "
                         + ", ".join(PROGRAM_VARIANTS) + " (default: default)")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                    help="element type of the full layers' KV caches in the prefill and TTFT runs (default: bf16; "
                         "see state.KV_DTYPES)")
    args = ap.parse_args(argv)
    global KV_DTYPE
    KV_DTYPE = args.kv_dtype
    bad = [v for v in args.program_variants.split(",") if v not in PROGRAM_VARIANTS]
    if bad:
        ap.error(f"--program-variants: unknown {', '.join(bad)}; known: {', '.join(PROGRAM_VARIANTS)}")
    if args.attn_block:
        fields = args.attn_block.split(",")
        if len(fields) != 4 or not all(f.strip().isdigit() for f in fields):
            ap.error(f"--attn-block wants four integers ROWS,BK,WARPS,STAGES, got {args.attn_block!r}")
        pa.DEFAULT_BLOCK = pa.Block(*(int(f) for f in fields))
    run = Run(args)
    tiny = args.tiny
    if tiny:
        jax.config.update("jax_platforms", "cpu")
    cfg = FlintConfig.tiny() if tiny else FlintConfig.flint()
    N = args.tokens or (32 if tiny else 8192)
    chunk = args.chunk or (16 if tiny else 2048)
    long_n = args.long or (80 if tiny else 100_000)
    long_chunk = 16 if tiny else 8192
    skip = set(filter(None, args.skip.split(",")))
    dev = jax.devices()[0]
    run.results["meta"] = {"device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__,
                           "config": "tiny" if tiny else "flint", "mode": "interpret" if tiny else "compiled",
                           "budget_s": args.budget_s, "tokens": N, "chunk": chunk, "long": long_n,
                           "long_chunk": long_chunk, "attn_block": str(pa.DEFAULT_BLOCK),
                           "kv_dtype": KV_DTYPE}
    log(f"device {dev.device_kind}; prompt {N}, chunk {chunk}, long prompt {long_n}; budget {args.budget_s:.0f} s")
    run.save()
    try:
        if args.check:
            try:
                section_check(run, cfg, tiny)
            except Exception as e:  # noqa: BLE001
                run.error("check", e)
        # jax's MoE options and our kernels' default blocks on one layer, then the model: the headline numbers
        # (8K prefill with the kernels, NVFP4 then BF16, and the NVFP4 TTFT) before the extras (chunked runs,
        # references), then the prefill attention alone and the block sweeps with what budget is left.
        if "moe" not in skip:
            try:
                section_moe(run, cfg, N, tiny, "main")
            except Exception as e:  # noqa: BLE001
                run.error("moe", e)
        tokens = np.asarray(jax.random.randint(jax.random.key(40), (1, N), 0, cfg.vocab_size), np.int32)
        kinds = [w for w in args.weights.split(",") if w]
        for i, kind in enumerate(kinds):
            if "prefill" in skip and "ttft" in skip:
                break
            # Keep enough budget for the next format's headline number.
            reserve = 0 if (tiny or i == len(kinds) - 1) else 35
            if not run.allows(60 if not tiny else 5, f"{kind} model (init + prefill)"):
                break
            why = model_shortfall(cfg, kind)
            if why:  # e.g. BF16 Flint on an H100: say so now, not as an XLA allocation failure minutes later
                log(f"{kind}: skipped: {why}")
                run.results["skipped"].append(f"{kind} model: {why}")
                continue
            t = time.perf_counter()
            params = sync(params_mod.init_params(cfg, jax.random.key(0), kind))
            log(f"{kind}: parameters initialised on the device in {time.perf_counter() - t:.1f} s")
            run.results["prefill"].setdefault(kind, {})["init_s"] = time.perf_counter() - t
            if "prefill" not in skip:
                section_prefill(run, cfg, kind, params, tokens, chunk, tiny, reserve, which="headline")
            if "ttft" not in skip and i == 0:
                if run.allows((45 if not tiny else 5) + reserve, f"ttft {kind}"):
                    section_ttft(run, cfg, kind, params, long_n, long_chunk, (None, None), None, tiny)
            if "prefill" not in skip and "extras" not in skip and not (tiny and i > 0):  # --tiny: once
                section_prefill(run, cfg, kind, params, tokens, chunk, tiny, reserve, which="extras")
            del params
            jax.clear_caches()
        if "routing" not in skip:  # the grouped kernels at the synthetic model's own routing (median MoE layer)
            for kind, rb in run.results["routing"].items():
                try:
                    section_moe(run, cfg, N, tiny, "program_routing", counts=rb["layers"][rb["median_layer"]]["counts"],
                                kinds=(kind,), label=f"{kind}, routing of the model's layer {rb['median_layer']}")
                except Exception as e:  # noqa: BLE001
                    run.error(f"moe {kind} at the model's routing", e)
        if "moe" not in skip and "jax" not in skip and not tiny:
            try:
                section_moe(run, cfg, N, tiny, "jax")
            except Exception as e:  # noqa: BLE001
                run.error("moe jax options", e)
        if "attn" not in skip:
            try:
                section_attn(run, cfg, min(N, long_chunk), long_n, tiny, "main")
            except Exception as e:  # noqa: BLE001
                run.error("attn", e)
        if not tiny and not args.no_sweep:
            for name, fn in (("moe", lambda: section_moe(run, cfg, N, tiny, "sweep")),
                             ("attn", lambda: section_attn(run, cfg, min(N, long_chunk), long_n, tiny, "sweep"))):
                if name in skip:
                    continue
                try:
                    fn()
                except Exception as e:  # noqa: BLE001
                    run.error(f"{name} sweep", e)
    finally:
        run.results["meta"]["wall_s"] = round(time.time() - T0, 1)
        run.save()
        log(f"done in {time.time() - T0:.1f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
