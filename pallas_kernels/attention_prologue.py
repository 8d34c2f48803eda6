"""Decode attention prologue: input RMSNorm + QKV projection, then per-head Q/K RMSNorm, RoPE and the KV write.

Two kernels (Pallas, Triton lowering; docs/KERNELS.md "Attention kernels (issue 5)" says why):

* `qkv_projection` -- `rmsnorm(h) @ [Wq; Wk; Wv].T` for B = 1..8 rows in one launch, BF16 or NVFP4 weights, on
  the weight stream of issue 4 (`weight_tiles.stream_rows`, the same K loop and in-register NVFP4 decode as
  `gemv.gemv`). The grid runs over blocks of output rows of the three weights, sized by `gemv.pick_blocks` for the
  concatenated [Hq + 2 KV] x D rows (Flint, NVFP4, B = 1: 320 programs of 16 rows). Each program recomputes the
  input RMSNorm of the (at most 8) rows; the output is rounded to BF16 exactly where `layers.linear` rounds, so it
  is the raw `[B, Hq + 2*KV, D]` Q/K/V before the head norms. (The first version decoded NVFP4 tiles with a
  broadcast-reshape of the scales and fed 16-row tensor-core dots: 48.9 us per Flint layer on the H200, against
  7.7 us for the GEMV kernel on the similar O projection, docs/BENCHMARKS.md.)
* `attention_prologue` -- the above, then a small kernel that finishes Q/K (per-head RMSNorm, RoPE on sliding
  layers) and writes K, V into the cache in place (`input_output_aliases`). The decode path proper
  (`decode_attention.attention_block_decode`) does not use this second kernel: its attention kernel does the same
  finishing step itself (`finish_heads` below), so a sliding layer's block stays at three launches.

Everything per-head (`finish_heads`, `rope_tables`) is written once here and used by both kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax import layer_stack
from flint_jax import layers as L
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels import gemv as G
from flint_jax.pallas_kernels import weight_tiles as wt
from flint_jax.state import (FullCache, RingCache, kv_dtype_of, to_cache_values, values_transposed, write_full,
                             write_ring)

F32, BF16 = jnp.float32, jnp.bfloat16

ROWS = 16  # query heads of one KV head padded to the smallest tensor-core M tile (attention kernels)
# Block table override for the projection: None = gemv.pick_blocks on the concatenated [Hq + 2 KV] x D rows.
QKV_BLOCK: "G.Blocks | None" = None
# Rows (padded to a power of two) from which the projection runs on the tensor cores (gemv.dot_blocks) even where
# gemv's table keeps the FMA path (gemv.TABLE_DOT_MIN_ROWS): below 8 rows x's rows are repeated inside the kernel to
# the MMA's 8 columns (weight_tiles.repeat_rows), so no XLA pad or slice kernel is added. Run DP (H200,
# tune_weight_kernels, 24 layers): at 4 rows the dot path took 12.6 us against 15.8 for the FMA table's blocks; at 2
# rows 12.6 against 9.9. In the batch-4 step (run DR, profile_decode.py, 8K): 15.8 -> 11.9 us per layer. None: gemv's
# table decides.
QKV_DOT_MIN_ROWS: int | None = 4


def _params(num_warps: int = 4, num_stages: int = 3):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---- kernel 1: input RMSNorm + QKV projection ----------------------------------------------------------------

def _qkv_kernel(x_ref, nw_ref, *refs, spec, mp, blocks, eps, row_blocks, col0, ptx, cols):
    """Program j computes `blocks.bn` output columns of one of Q, K, V for all (padded) rows: the issue-4 weight
    stream (weight_tiles.stream_rows, or stream_rows_dot on the tensor cores) with the RMSNorm prologue, one
    `pl.when` branch per weight."""
    out_ref = refs[-1]
    n_ops = spec.num_operands
    wrefs = [refs[i * n_ops:(i + 1) * n_ops] for i in range(3)]
    j = pl.program_id(0)
    bn, bk = blocks.bn, blocks.bk
    xs = wt.XSource(x_ref, wt.x_kind(spec.kind, blocks.dot), nw_ref, eps)
    inv = xs.inv_rms_block(spec.k) if blocks.dot else None  # FMA path: per branch, after its first loads
    for which in range(3):
        lo, hi = row_blocks[which]
        w_refs = wrefs[which]

        # pl.when traces its body at once, so the loop variables are bound correctly.
        @pl.when((j >= lo) & (j < hi))
        def _():
            n0 = pl.multiple_of((j - lo) * bn, bn)
            c0 = pl.multiple_of(col0[which] + n0, bn)
            if blocks.dot:
                acc, = wt.stream_rows_dot(xs, [(spec, w_refs)], n0, bn, bk, inv, ptx=ptx, cols=cols)
                acc = wt.first_columns(acc, mp)
                out_ref[:, pl.ds(c0, bn)] = wt.apply_global_scale(acc.T, wt.dot_scale(spec, w_refs, 0)).astype(BF16)
                return
            scale = wt.epilogue_loads(lambda: wt.global_scale(spec, w_refs, 0))
            accs = wt.stream_rows([xs] * mp, list(range(mp)), [(spec, w_refs)], [0], n0, bn, bk,
                                  wt.row_norms(xs, mp, spec.k),
                                  elementwise=blocks.elementwise, prefetch=blocks.prefetch)
            gs = scale()
            for r in range(mp):
                out_ref[r, pl.ds(c0, bn)] = wt.apply_global_scale(accs[r], gs).astype(BF16)


def qkv_projection(h: jax.Array, attn_norm: jax.Array, attn, cfg: FlintConfig, interpret: bool = False) -> jax.Array:
    """`linear(rmsnorm(h), W)` for W in (q, k, v), in one kernel. h [B, H] bf16 -> [B, Hq + 2*KV, D] bf16
    (Q heads, then K heads, then V heads), each rounded to BF16 like `layers.linear`."""
    B, H = h.shape
    Hq, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if not 1 <= B <= 8:
        raise ValueError(f"qkv_projection: batch must be 1..8, got {B}")
    if H != cfg.hidden_size:
        raise ValueError(f"qkv_projection: h has {H} features, config says {cfg.hidden_size}")
    specs, weight_ops = [], []
    for name, w, n in (("q", attn.q, Hq * D), ("k", attn.k, KV * D), ("v", attn.v, KV * D)):
        spec, ops = wt.weight_operands(w)
        if (spec.n, spec.k) != (n, H):
            raise ValueError(f"qkv_projection: weight {name} has shape {(spec.n, spec.k)}, expected {(n, H)}")
        specs.append(spec)
        weight_ops.append(ops)
    if len({s.kind for s in specs}) != 1:
        raise ValueError(f"qkv_projection: q/k/v weights mix kinds {[s.kind for s in specs]}")
    total = (Hq + 2 * KV) * D
    mp = wt.pow2_rows(B)
    total_spec = wt.WeightSpec(specs[0].kind, 1, total, H)
    if QKV_BLOCK is None and QKV_DOT_MIN_ROWS is not None and mp >= QKV_DOT_MIN_ROWS:
        blocks = G.dot_blocks(total_spec)
    else:
        blocks = G.resolve_blocks(total_spec, mp, 1, QKV_BLOCK)
    bn = min(blocks.bn, *(wt.largest_pow2_divisor(s.n, blocks.bn) for s in specs))
    blocks = blocks._replace(bn=bn)
    cols = mp
    if blocks.dot:
        cols = G.dot_rows(mp)  # x's mp rows are repeated to the MMA's columns in the kernel
        weight_ops = [wt.dot_operands(s, ops) for s, ops in zip(specs, weight_ops)]
    args = [a for ops in weight_ops for a in ops]
    x_kind = wt.x_kind(specs[0].kind, blocks.dot)
    row_blocks, col0, start = [], [], 0
    for s in specs:
        row_blocks.append((start // bn, (start + s.n) // bn))
        col0.append(start)
        start += s.n
    x = h.astype(BF16)
    if mp != B:
        x = jnp.pad(x, ((0, mp - B), (0, 0)))
    nw = attn_norm.astype(BF16)
    if x_kind == "nvfp4":
        nw = nw.reshape(H // wt.GROUP, wt.GROUP)
    kernel = functools.partial(_qkv_kernel, spec=specs[0], mp=mp, blocks=blocks, eps=float(cfg.rms_norm_eps),
                               row_blocks=tuple(row_blocks), col0=tuple(col0), ptx=not interpret, cols=cols)
    operands, in_specs = layer_stack.kernel_args([wt.x_operand(x, x_kind), nw, *args])
    out = pl.pallas_call(
        kernel, grid=(total // bn,), out_shape=jax.ShapeDtypeStruct((mp, total), BF16), in_specs=in_specs,
        compiler_params=_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages), interpret=interpret,
        name="qkv_projection",
    )(*operands)
    return out[:B].reshape(B, Hq + 2 * KV, D)


# ---- the per-head finishing step, shared with the attention kernel ------------------------------------------------

def rope_tables(cfg: FlintConfig) -> jax.Array:
    """inv_freq [D/2] f32, by the same expression as `layers.rope`."""
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=F32) / d))


def rope_cos_sin(positions: jax.Array, cfg: FlintConfig) -> jax.Array:
    """[B, 2, D/2] f32: cos and sin of each sequence's RoPE angles at `positions` [B], by `layers.rope`'s expression
    (computed by XLA, so the values are the reference's). Every sliding layer of a step asks for the same table, and
    XLA's common-subexpression elimination keeps one."""
    angles = positions.astype(F32)[:, None] * rope_tables(cfg)[None, :]
    return jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)


def load_rope(rope_ref, b):
    """Sequence b's (cos, sin) [D/2] from a `rope_cos_sin` table ref: for `finish_heads`'s `rope`."""
    return rope_ref[b, 0, :], rope_ref[b, 1, :]


def finish_heads(x1, x2, w_ref, rope, pos, *, eps: float, sliding: bool):
    """Per-head RMSNorm (+ RoPE on sliding layers) of heads given as halves x1, x2 [R, D/2] bf16 (the two halves
    make rotate-half RoPE a pair of elementwise ops). Returns the finished halves, bf16. rope: the inv_freq ref (the
    angles' cos/sin computed here, at position pos) or a (cos, sin) pair already loaded (`load_rope`)."""
    dh = x1.shape[-1]
    x1f, x2f = x1.astype(F32), x2.astype(F32)
    ss = jnp.sum(x1f * x1f, axis=1) + jnp.sum(x2f * x2f, axis=1)
    r = jax.lax.rsqrt(ss / (2 * dh) + eps)[:, None]
    w1 = w_ref[pl.ds(0, dh)].astype(F32)[None, :]
    w2 = w_ref[pl.ds(dh, dh)].astype(F32)[None, :]
    y1 = (w1 * (x1f * r).astype(BF16).astype(F32)).astype(BF16)
    y2 = (w2 * (x2f * r).astype(BF16).astype(F32)).astype(BF16)
    if not sliding:
        return y1, y2
    if isinstance(rope, tuple):
        c, s = rope[0].astype(F32)[None, :], rope[1].astype(F32)[None, :]
    else:
        ang = pos.astype(F32) * rope[...]  # [D/2]
        c, s = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
    y1f, y2f = y1.astype(F32), y2.astype(F32)
    return (y1f * c - y2f * s).astype(BF16), (y2f * c + y1f * s).astype(BF16)


def load_raw_heads(qkv_ref, b, kv, *, Hq: int, KV: int, G: int, D: int, rows: int = ROWS):
    """From the raw projection [B, Hq+2KV, D]: the G query heads of KV head kv (rows padded to `rows`, halves),
    and that KV head's k (halves, [1, D/2]) and v ([D])."""
    dh = D // 2
    gmask = (jnp.arange(rows) < G)[:, None]
    q1 = plgpu.load(qkv_ref.at[b, pl.ds(kv * G, rows), pl.ds(0, dh)], mask=gmask, other=0)
    q2 = plgpu.load(qkv_ref.at[b, pl.ds(kv * G, rows), pl.ds(dh, dh)], mask=gmask, other=0)
    k1 = qkv_ref[b, pl.ds(Hq + kv, 1), pl.ds(0, dh)]
    k2 = qkv_ref[b, pl.ds(Hq + kv, 1), pl.ds(dh, dh)]
    v = qkv_ref[b, Hq + KV + kv, :]
    return q1, q2, k1, k2, v


def store_kv(k1, k2, v, k_out, v_out, pos_out, b, kv, p, *, ring: bool, window: int):
    """Write one token's K (halves [1, D/2]) and V [D] at position p into the cache (ring slot p % W), rounded to
    the cache's dtype as state.write_full rounds them (an FP8 full cache; where its V is stored transposed,
    state.FP8_V_TRANSPOSED, V goes down one column)."""
    dh = k1.shape[-1]
    slot = jax.lax.rem(p, window) if ring else p
    k_out[b, kv, pl.ds(slot, 1), pl.ds(0, dh)] = to_cache_values(k1, k_out.dtype)
    k_out[b, kv, pl.ds(slot, 1), pl.ds(dh, dh)] = to_cache_values(k2, k_out.dtype)
    if values_transposed(v_out.dtype):
        v_out[b, kv, :, slot] = to_cache_values(v, v_out.dtype)
    else:
        v_out[b, kv, slot, :] = to_cache_values(v, v_out.dtype)
    if ring:
        @pl.when(kv == 0)
        def _():
            pos_out[b, pl.ds(slot, 1)] = jnp.full((1,), p, jnp.int32)


# ---- kernel 2 (prologue-only API): finish Q/K and write the cache ----------------------------------------------

def _finish_kernel(qkv_ref, qn_ref, kn_ref, invf_ref, pos_ref, act_ref, *refs, Hq, KV, G, D, eps, sliding, ring, window):
    if ring:
        k_in, v_in, pos_in, q_out, k_out, v_out, pos_out = refs
    else:
        k_in, v_in, q_out, k_out, v_out = refs
        pos_out = None
    b, kv = pl.program_id(0), pl.program_id(1)
    p = pos_ref[b]
    q1, q2, k1, k2, v = load_raw_heads(qkv_ref, b, kv, Hq=Hq, KV=KV, G=G, D=D)
    q1, q2 = finish_heads(q1, q2, qn_ref, invf_ref, p, eps=eps, sliding=sliding)
    k1, k2 = finish_heads(k1, k2, kn_ref, invf_ref, p, eps=eps, sliding=sliding)
    gmask = (jnp.arange(ROWS) < G)[:, None]
    dh = D // 2
    plgpu.store(q_out.at[b, pl.ds(kv * G, ROWS), pl.ds(0, dh)], q1, mask=gmask)
    plgpu.store(q_out.at[b, pl.ds(kv * G, ROWS), pl.ds(dh, dh)], q2, mask=gmask)

    @pl.when(act_ref[b] != 0)
    def _():
        store_kv(k1, k2, v, k_out, v_out, pos_out, b, kv, p, ring=ring, window=window)


def check_cache(cache, cfg: FlintConfig, B: int, sliding: bool, interpret: bool = False) -> None:
    KV, D = cfg.num_key_value_heads, cfg.head_dim
    if sliding != isinstance(cache, RingCache):
        raise ValueError(f"sliding={sliding} but the cache is a {type(cache).__name__}")
    if cache.k.dtype != cache.v.dtype:
        raise ValueError(f"cache k is {cache.k.dtype} but v is {cache.v.dtype}")
    transposed = not sliding and values_transposed(cache.v.dtype)
    v_shape = cache.k.shape[:2] + cache.k.shape[:1:-1] if transposed else cache.k.shape
    if cache.k.shape[:2] != (B, KV) or cache.k.shape[3] != D or cache.v.shape != v_shape:
        raise ValueError(f"cache k/v shape {cache.k.shape}/{cache.v.shape} does not fit batch {B}, KV {KV}, D {D}"
                         + (" (with state.FP8_V_TRANSPOSED on, an FP8 full cache stores V transposed: [B, KV, D, S])"
                            if transposed else ""))
    if sliding and cache.k.dtype != jnp.bfloat16:
        raise ValueError(f"ring caches hold BF16 K/V, got {cache.k.dtype} (kv_dtype applies to full layers only)")
    kv_dtype_of(cache.k.dtype)  # BF16 or FP8, else a ValueError that names the choices
    if sliding and cache.k.shape[2] != cfg.sliding_window:
        raise ValueError(f"ring has {cache.k.shape[2]} slots, sliding_window is {cfg.sliding_window}")
    if D % 2:
        raise ValueError(f"head_dim {D} must be even")
    if not interpret and ((D // 2) & (D // 2 - 1) or D // 2 < 16):  # interpret mode takes any even D
        raise ValueError(f"head_dim {D}: D/2 must be a power of two >= 16 (Triton tiles and tensor-core dots)")
    if cfg.q_per_kv > ROWS:
        raise ValueError(f"{cfg.q_per_kv} query heads per KV head; at most {ROWS} supported")


def finish_and_write(qkv: jax.Array, attn, cache, positions: jax.Array, active: jax.Array, cfg: FlintConfig,
                     sliding: bool, interpret: bool = False):
    """Kernel 2 of the prologue: qkv [B, Hq+2KV, D] raw -> (q [B, Hq, D] ready, cache with k/v written at
    `positions` where `active`)."""
    B = qkv.shape[0]
    Hq, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    check_cache(cache, cfg, B, sliding, interpret)
    ring = isinstance(cache, RingCache)
    kernel = functools.partial(_finish_kernel, Hq=Hq, KV=KV, G=cfg.q_per_kv, D=D, eps=cfg.rms_norm_eps,
                               sliding=sliding, ring=ring, window=cache.k.shape[2])
    cache_in = [cache.k, cache.v] + ([cache.pos] if ring else [])
    out_shape = [jax.ShapeDtypeStruct((B, Hq, D), BF16)] + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in cache_in]
    n_in = 6
    operands, in_specs = layer_stack.kernel_args([qkv, attn.q_norm, attn.k_norm, rope_tables(cfg),
                                                  positions.astype(jnp.int32), active.astype(jnp.int32), *cache_in])
    outs = pl.pallas_call(
        kernel, grid=(B, KV), out_shape=out_shape, in_specs=in_specs,
        input_output_aliases={n_in + i: 1 + i for i in range(len(cache_in))},
        compiler_params=_params(num_warps=4, num_stages=1), interpret=interpret, name="attention_finish_qk",
    )(*operands)
    q = outs[0]
    cache = RingCache(k=outs[1], v=outs[2], pos=outs[3]) if ring else FullCache(k=outs[1], v=outs[2])
    return q, cache


def attention_prologue(h: jax.Array, attn_norm: jax.Array, attn, cache, positions: jax.Array, active: jax.Array,
                       cfg: FlintConfig, sliding: bool, interpret: bool = False):
    """Input RMSNorm, QKV projection, Q/K head norms, RoPE (sliding layers), K/V written into the cache.
    h [B, H] bf16, positions [B] int32 (this token's absolute position), active [B] bool (inactive rows write
    nothing). Returns (q [B, Hq, D] bf16 ready for attention, new cache). Two kernels."""
    qkv = qkv_projection(h, attn_norm, attn, cfg, interpret=interpret)
    return finish_and_write(qkv, attn, cache, positions, active, cfg, sliding, interpret=interpret)


def ref_qkv_projection(h, attn_norm, attn, cfg: FlintConfig):
    a = L.rmsnorm(h, attn_norm, cfg.rms_norm_eps)
    return jnp.concatenate([L.linear(a, attn.q), L.linear(a, attn.k), L.linear(a, attn.v)], axis=-1).reshape(
        h.shape[0], -1, cfg.head_dim)


def ref_attention_prologue(h, attn_norm, attn, cache, positions, active, cfg: FlintConfig, sliding: bool,
                           interpret: bool = False):
    """The same function from layers.py/state.py (T = 1)."""
    del interpret
    a = L.rmsnorm(h[:, None], attn_norm, cfg.rms_norm_eps)
    q, k, v = L.project_qkv(a, attn, positions[:, None], cfg, sliding)
    write = write_ring if sliding else write_full
    return q[:, 0], write(cache, k, v, positions[:, None], active[:, None])
