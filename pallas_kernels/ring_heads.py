"""A sliding layer's fused decode attention with one program per query head: no split partials, no `combine`.

    ring_attention_by_head(qkv, attn, cache, positions, active, cfg) -> (o [B, Hq, D] bf16, new ring)   one kernel

The split kernel of decode_attention.py gives each (sequence, KV head, split) program one 64-key block of the ring
and the G query heads of that KV head as the rows of its tensor-core dots, then `combine` folds the 8 splits and
the sink: two launches and a round trip of FP32 partials. Here a program takes one query head and the whole ring
(W = 513 slots on Flint: 8 x 64 keys + 1) of its KV head, and finishes o itself, sink included. The G programs of a
KV head read the same keys, the first from HBM and the others mostly from L2 (G x 256 KB per KV head on Flint).

Per program: the raw q of its head and the raw k, v of its KV head (from `qkv_projection`), Q/K RMSNorm and RoPE
(`attention_prologue.finish_heads`), the K/V write by the first program of each KV head (`store_kv`), then a loop
over the ring's blocks of RING_HEAD_BLOCK_K keys whose loads Triton pipelines through shared memory
(RING_HEAD_STAGES). Scores are FMA dot products (one head: no tensor-core tile to fill) reduced over D; the
softmax state is kept per key lane (a running max, sum and FP32 accumulator [BK, D] for each key position of a
block), so the loop has no reduction across warps; the lanes, the new token (from registers, as in the split
kernel: no program reads a slot another writes) and the sink are folded once after the loop.

Numerics: products of BF16 values are exact in FP32, sums run in another order than `layers.attend`, P stays
FP32 (no TF32 P @ V), so the outputs match the reference within the attention tolerances (tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax import layer_stack
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels.attention_prologue import check_cache, finish_heads, load_rope, rope_cos_sin, store_kv
from flint_jax.state import RingCache

F32, BF16 = jnp.float32, jnp.bfloat16
NEG_INF = float("-inf")

RING_HEAD_BLOCK_K = 64  # keys per loop step
RING_HEAD_WARPS = 4
RING_HEAD_STAGES = 3


def _kernel(qkv_ref, qn_ref, kn_ref, rope_ref, pos_ref, act_ref, sink_ref, k_ref, v_ref, kpos_ref,
            o_ref, k_out, v_out, pos_out, *, Hq, KV, G, D, window, n_slots, eps, block_k):
    dh = D // 2
    b, h = pl.program_id(0), pl.program_id(1)
    kv = h // G
    pos = pos_ref[b]
    active = act_ref[b] != 0
    q_pos = jnp.where(active, pos, -1)
    inv_sqrt_d = 1.0 / math.sqrt(D)

    rope = load_rope(rope_ref, b)  # the per-step cos/sin table (decode_attention.ROPE_TABLE's)
    q1 = qkv_ref[b, pl.ds(h, 1), pl.ds(0, dh)]
    q2 = qkv_ref[b, pl.ds(h, 1), pl.ds(dh, dh)]
    k1 = qkv_ref[b, pl.ds(Hq + kv, 1), pl.ds(0, dh)]
    k2 = qkv_ref[b, pl.ds(Hq + kv, 1), pl.ds(dh, dh)]
    v_new = qkv_ref[b, Hq + KV + kv, :]
    q1, q2 = finish_heads(q1, q2, qn_ref, rope, pos, eps=eps, sliding=True)
    k1, k2 = finish_heads(k1, k2, kn_ref, rope, pos, eps=eps, sliding=True)

    @pl.when(active & (h % G == 0))
    def _():
        store_kv(k1, k2, v_new, k_out, v_out, pos_out, b, kv, pos, ring=True, window=n_slots)

    q1f, q2f = q1.astype(F32), q2.astype(F32)  # [1, dh]
    # The new token: attended from registers (its slot may be rewritten by another program of this launch).
    s_new = jnp.sum(q1f * k1.astype(F32) + q2f * k2.astype(F32)) * inv_sqrt_d
    m0 = jnp.where(active, s_new, NEG_INF)

    idx0 = jnp.arange(block_k)

    def body(i, carry):
        m, l, acc = carry  # [BK], [BK], [BK, D]: one online softmax per key lane
        t0 = i * block_k
        ok = (t0 + idx0 < n_slots) & active
        kp = plgpu.load(kpos_ref.at[b, pl.ds(t0, block_k)], mask=ok, other=-1)
        kb1 = plgpu.load(k_ref.at[b, kv, pl.ds(t0, block_k), pl.ds(0, dh)], mask=ok[:, None], other=0)
        kb2 = plgpu.load(k_ref.at[b, kv, pl.ds(t0, block_k), pl.ds(dh, dh)], mask=ok[:, None], other=0)
        vb = plgpu.load(v_ref.at[b, kv, pl.ds(t0, block_k), :], mask=ok[:, None], other=0)
        sc = (jnp.sum(kb1.astype(F32) * q1f, axis=1) + jnp.sum(kb2.astype(F32) * q2f, axis=1)) * inv_sqrt_d
        live = (kp >= 0) & (kp < q_pos) & (q_pos - kp < window)
        sc = jnp.where(live, sc, NEG_INF)
        m_new = jnp.maximum(m, sc)
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe)
        return m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * vb.astype(F32)

    init = (jnp.full((block_k,), NEG_INF, F32), jnp.zeros((block_k,), F32), jnp.zeros((block_k, D), F32))
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(n_slots, block_k), body, init)

    sink = sink_ref[pl.ds(h, 1)].astype(F32)  # [1]
    big = jnp.maximum(jnp.maximum(jnp.max(m, axis=0, keepdims=True), m0), sink)
    big = jnp.where(jnp.isfinite(big), big, 0.0)
    w = jnp.exp(m - big)  # [BK]
    w0 = jnp.exp(m0 - big)  # [1]: the new token's weight (0 when inactive)
    denom = jnp.sum(l * w, axis=0, keepdims=True) + w0 + jnp.exp(sink - big)
    o = jnp.sum(acc * w[:, None], axis=0) + w0 * v_new.astype(F32)
    o_ref[b, h, :] = (o / denom).astype(BF16)


def ring_attention_by_head(qkv: jax.Array, attn, cache: RingCache, positions: jax.Array, active: jax.Array,
                           cfg: FlintConfig, *, interpret: bool = False, block_k: int | None = None):
    """From the raw projection qkv [B, Hq+2KV, D] (`qkv_projection`) of a sliding layer: finish Q/K, write K/V into
    the ring in place, attend over the window with the sink. One kernel, grid (B, Hq).
    Returns (o [B, Hq, D] bf16, new ring)."""
    B = positions.shape[0]
    Hq, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    check_cache(cache, cfg, B, True, interpret)
    n_slots = cache.k.shape[2]
    block_k = block_k or RING_HEAD_BLOCK_K
    rope = rope_cos_sin(positions, cfg)
    cache_in = [cache.k, cache.v, cache.pos]
    args = [qkv, attn.q_norm, attn.k_norm, rope, positions.astype(jnp.int32), active.astype(jnp.int32),
            attn.sinks.astype(F32), *cache_in]
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, Hq, D), BF16)], [pl.no_block_spec]
    for x in cache_in:  # written in place (a layer of stacked caches: its stack, through a BlockSpec)
        shape, spec = layer_stack.aliased_output(x)
        out_shape.append(shape)
        out_specs.append(spec)
    first = len(args) - len(cache_in)
    kernel = functools.partial(_kernel, Hq=Hq, KV=KV, G=cfg.q_per_kv, D=D, window=cfg.sliding_window,
                               n_slots=n_slots, eps=cfg.rms_norm_eps, block_k=block_k)
    operands, in_specs = layer_stack.kernel_args(args)
    outs = pl.pallas_call(
        kernel, grid=(B, Hq), out_shape=out_shape, in_specs=in_specs, out_specs=out_specs,
        input_output_aliases={first + i: 1 + i for i in range(len(cache_in))},
        compiler_params=plgpu.CompilerParams(num_warps=RING_HEAD_WARPS, num_stages=RING_HEAD_STAGES),
        interpret=interpret, name="decode_attention_ring_by_head",
    )(*operands)
    rest = [layer_stack.like(r, x) for r, x in zip(outs[1:], cache_in)]
    return outs[0], RingCache(k=rest[0], v=rest[1], pos=rest[2])
