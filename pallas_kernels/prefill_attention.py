"""Prefill attention: a chunk of T new queries against the KV state, flash-attention style (Pallas, Triton lowering).

    ring_attention(q, k, v, q_pos, ring, sinks, window)   sliding layer: the keys are the ring as it was before
                                                          this chunk (its stored positions) and the chunk itself
    full_attention(q, q_pos, cache, lengths, sinks)       full layer: the cache, which already holds the chunk,
                                                          keys 0 .. lengths[b] - 1 at their indices

both = layers.attend(q, keys, values, layers.attention_mask(q_pos, k_pos, window), sinks) without ever forming the
[T, S] score matrix, so a chunk of 8K queries can read a 262K-token cache.

q [B, T, Hq, D] BF16 (normed, RoPE'd), q_pos [B, T] int32 (-1 = padding row), sinks [Hq] f32 -> o [B, T, Hq, D] BF16.
Masks come from positions: causal (k_pos <= q_pos), k_pos >= 0, and on sliding layers q_pos - k_pos < window.
Key-loop bounds (which blocks may hold an allowed key) assume what model_step guarantees: row b's chunk
positions are lengths[b] + t, so they only skip blocks that the mask would zero anyway. Sliding layers read the
ring's W slots (only query blocks within W - 1 tokens of the chunk's start), then the chunk's own keys as projected
([B, T, KV, D], no copy) from the first key of the block's window; chunk-key blocks that every query of the block
sees skip the mask arithmetic.

Grid (T / BQ, KV, B). A program takes BQ queries of the G = Hq / KV query heads that share one KV head, as
BQ * G rows (token-major), so each K/V block is loaded once for G heads (GQA). Online softmax in FP32 that starts
from the sink: m = sink, l = 1 (l = 0 for a -inf sink), acc = 0, then per key block
    m' = max(m, max s),  l = l * e^(m - m') + sum e^(s - m'),  acc = acc * e^(m - m') + e^(s - m') @ V
and o = acc / l. With one key block this is layers.attend's arithmetic operation for operation (s = q.k / sqrt(D),
p = e^(s - m), denominator e^(sink - m) + sum p), so the CPU run matches the reference bit for bit in practice;
with several blocks only the FP32 rescaling and summation order differ. A row with no allowed key and a -inf
sink gives 0 (the reference gives 0/0 there; no real token is in that case).

P @ V (`Block.pv`): "f32" is an FP32 dot like the reference's (interpret mode's default; on the GPU it would be
a slow IEEE FP32 dot); "bf16" (the GPU default, `GPU_PV`) rounds p to BF16 for a tensor-core product against the
BF16 values with FP32 accumulation, the usual flash-attention practice: about 2^-9 relative per probability, the
same order as the BF16 rounding of o itself (tests/test_kernels_prefill_attention.py states the tolerance);
"bf16x2" adds a second product with p_lo = bf16(p - p_hi), so p keeps 16 significant bits (about 2^-17), at one
more tensor-core product per block (it was the default until run N measured the cost, docs/BENCHMARKS.md).
The GPU modes also use base-2 exponentials: the scores are scaled by log2(e) / sqrt(D) in one multiply and the
sink by log2(e), and e^x becomes 2^x (the same values up to FP32 rounding); "f32" keeps e^x and / sqrt(D).

Full layers: the key blocks below the block's smallest query position need no mask (every query sees them); a
first loop runs those without the mask arithmetic, a second the rest (the last one or two blocks of a chunk's
diagonal), with the mask.

Block edges: a last block that would run past the end of the keys (or queries) starts earlier instead, at
extent - BK, and masks the keys an earlier block already counted; so no load goes out of bounds and no extent
needs padding (extents shorter than one block are padded by the wrapper).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax import layers as L
from flint_jax.state import FullCache, RingCache, values_transposed

F32, BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Block:
    """rows: query rows per program (BQ = rows // G tokens); bk keys per step."""
    rows: int = 128
    bk: int = 64
    num_warps: int = 8
    num_stages: int = 3  # run N, full layer at 8K: 1.81 ms at 3 stages, 1.96 at 2
    pv: str | None = None  # "f32" | "bf16x2" | "bf16"; None: "f32" in interpret mode, else GPU_PV


DEFAULT_BLOCK = Block()
GPU_PV = "bf16"  # P @ V on the GPU when Block.pv is None (see the module docstring)


def resolve_pv(block: Block | None, interpret: bool) -> str:
    """The P @ V mode a kernel call runs with: Block.pv, else "f32" in interpret mode and GPU_PV compiled."""
    pv = (block.pv if block is not None else None) or ("f32" if interpret else GPU_PV)
    if pv not in ("f32", "bf16x2", "bf16"):
        raise ValueError(f"Block.pv must be 'f32', 'bf16x2' or 'bf16', got {pv!r}")
    return pv


def _bq(block: Block, G: int) -> int:
    if block.rows % G:
        raise ValueError(f"block rows {block.rows} must be a multiple of the query heads per KV head ({G})")
    return block.rows // G


# ---- kernel -----------------------------------------------------------------------------------------------------
def _dot_t(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _kernel(*refs, mode, G, BQ, BK, T, S, W, window, sqrt_d, pv_mode):
    """mode "ring": the ring's W slots (keys [B, KV, W, D], positions rpos [B, W]), then the chunk's T keys
    (ck/cv [B, T, KV, D] as projected, positions = the queries' own q_pos); mode "full": keys = the cache
    [B, KV, S, D], positions = indices below lengths[b]."""
    if mode == "ring":
        q_ref, qpos_ref, sink_ref, rpos_ref, rk_ref, rv_ref, ck_ref, cv_ref, o_ref = refs
    else:
        q_ref, qpos_ref, sink_ref, len_ref, k_ref, v_ref, o_ref = refs
    i, kv, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    D = q_ref.shape[-1]
    R = BQ * G
    # Base-2 exponentials on the GPU paths: the score scale and log2(e) fold into one multiply per score (the
    # "f32" path keeps layers.attend's e^x and / sqrt(D), operation for operation).
    exact = pv_mode == "f32"
    unit = 1.0 if exact else math.log2(math.e)
    exp = jnp.exp if exact else jnp.exp2
    # Last query block first: under the causal mask the late blocks have the most keys, so they start early and
    # the short ones fill the tail of the launch.
    i = pl.num_programs(0) - 1 - i
    t0 = jnp.minimum(i * BQ, T - BQ)
    qt = q_ref[b, pl.ds(t0, BQ), pl.ds(kv * G, G), :].reshape(R, D)
    qp_tok = qpos_ref[b, pl.ds(t0, BQ)]
    qp = jnp.broadcast_to(qp_tok[:, None], (BQ, G)).reshape(R)
    sink = jnp.broadcast_to(sink_ref[pl.ds(kv * G, G)][None, :], (BQ, G)).reshape(R).astype(F32) * unit

    def scores(kt):
        s = _dot_t(qt, kt.astype(qt.dtype))  # an FP8 full cache's keys: exact in BF16
        return s / sqrt_d if exact else s * (unit / sqrt_d)

    # An FP8 full cache may store V transposed (state.values_transposed): its tiles are then [D, BK], dotted as such.
    v_is_t = mode == "full" and values_transposed(v_ref.dtype)
    dot_v = _dot_t if v_is_t else _dot

    def update(carry, s, vt):
        """The online-softmax step for scores s [R, BK] (masked keys at -inf) and values vt [BK, D] (or [D, BK] for
        a transposed cache)."""
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = exp(m - m_safe)
        p = exp(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        if pv_mode == "f32":
            pv = dot_v(p, vt.astype(F32))
        else:
            vt = vt.astype(BF16)  # an FP8 full cache's values: exact in BF16
            p_hi = p.astype(BF16)
            pv = dot_v(p_hi, vt)
            if pv_mode == "bf16x2":
                pv = pv + dot_v((p - p_hi.astype(F32)).astype(BF16), vt)
        return m_new, l, acc * alpha[:, None] + pv

    def step(carry, kt, vt, kp, fresh):
        """One key block: kt/vt [BK, D], kp [BK] positions (-1 = none), fresh [BK] not seen by an earlier block."""
        ok = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None]) & fresh[None, :]
        if window is not None:
            ok = ok & ((qp[:, None] - kp[None, :]) < window)
        return update(carry, jnp.where(ok, scores(kt), -jnp.inf), vt)

    def edge(j, extent):
        """Start of key block j over [0, extent), kept in bounds, and which of its keys are new."""
        s0 = jnp.minimum(j * BK, extent - BK)
        idx = s0 + jnp.arange(BK, dtype=jnp.int32)
        return s0, idx, idx >= j * BK

    # Start from the sink: e^(sink - m) is the denominator's first term (0 for a -inf sink).
    carry = (sink, jnp.where(sink == -jnp.inf, 0.0, 1.0).astype(F32), jnp.zeros((R, D), F32))
    if mode == "ring":
        # Ring keys are older than the chunk: only queries within window - 1 of its start can reach them. (An int32
        # product, not jnp.where of Python ints, which the Triton lowering turns into an i1 loop bound.)
        def ring_body(j, carry):
            s0, _, fresh = edge(j, W)
            return step(carry, rk_ref[b, kv, pl.ds(s0, BK), :], rv_ref[b, kv, pl.ds(s0, BK), :],
                        rpos_ref[b, pl.ds(s0, BK)], fresh)

        reaches_ring = (t0 <= window - 2).astype(jnp.int32)
        carry = jax.lax.fori_loop(0, reaches_ring * pl.cdiv(W, BK), ring_body, carry)

        # Chunk keys: t holds position pos0 + t (the chunk's own q_pos), the block's queries see
        # [t0 - (window - 1), t0 + BQ). Those every real query of the block sees need no mask: positions in
        # [q_max - window + 1, q_min] (chunk keys t = position - pos0). Whole blocks inside that range skip the mask
        # arithmetic (the same operations on unmasked scores, so the same results); the blocks before and after
        # keep it.
        def chunk_body(j, carry):
            s0, _, fresh = edge(j, T)
            return step(carry, ck_ref[b, pl.ds(s0, BK), kv, :], cv_ref[b, pl.ds(s0, BK), kv, :],
                        qpos_ref[b, pl.ds(s0, BK)], fresh)

        def chunk_free(j, carry):
            s0 = pl.multiple_of(j * BK, BK)
            return update(carry, scores(ck_ref[b, pl.ds(s0, BK), kv, :]), cv_ref[b, pl.ds(s0, BK), kv, :])

        j_lo = jnp.maximum(t0 - (window - 1), 0) // BK
        j_hi = pl.cdiv(jnp.minimum(t0 + BQ, T), BK)
        big = jnp.iinfo(jnp.int32).max
        q_min = jnp.min(jnp.where(qp_tok >= 0, qp_tok, big))
        q_max = jnp.max(qp_tok)
        pos0 = qpos_ref[b, pl.ds(0, 1)][0]
        f_lo = jnp.maximum(q_max - (window - 1) - pos0, 0)
        f_hi = jnp.where(q_max >= 0, q_min - pos0, -1)  # last free chunk key (inclusive); none without real rows
        jf0 = jnp.clip((f_lo + BK - 1) // BK, j_lo, j_hi)
        jf1 = jnp.clip((f_hi + 1) // BK, jf0, j_hi)
        carry = jax.lax.fori_loop(j_lo, jf0, chunk_body, carry)
        carry = jax.lax.fori_loop(jf0, jf1, chunk_free, carry)
        carry = jax.lax.fori_loop(jf1, j_hi, chunk_body, carry)
    else:
        length = len_ref[b]

        # Keys every real query of the block may see (index <= the smallest position) need no mask: whole blocks
        # below it skip the mask arithmetic (same operations on unmasked scores, so the same results).
        q_min = jnp.min(jnp.where(qp_tok >= 0, qp_tok, jnp.iinfo(jnp.int32).max))
        q_max = jnp.minimum(jnp.max(qp_tok), length - 1)
        n_full = jnp.minimum((q_max + BK) // BK, pl.cdiv(S, BK))
        n_free = jnp.minimum((jnp.minimum(q_min, S - 1) + 1) // BK, n_full)

        def values(s0):
            return v_ref[b, kv, :, pl.ds(s0, BK)] if v_is_t else v_ref[b, kv, pl.ds(s0, BK), :]

        def free_body(j, carry):
            s0 = pl.multiple_of(j * BK, BK)
            return update(carry, scores(k_ref[b, kv, pl.ds(s0, BK), :]), values(s0))

        def body(j, carry):
            s0, idx, fresh = edge(j, S)
            kp = jnp.where(idx < length, idx, -1)
            return step(carry, k_ref[b, kv, pl.ds(s0, BK), :], values(s0), kp, fresh)

        carry = jax.lax.fori_loop(0, n_free, free_body, carry)
        carry = jax.lax.fori_loop(n_free, n_full, body, carry)

    _, l, acc = carry
    real = (qp >= 0) & (l > 0)  # padding rows (position -1) and rows with nothing to attend give 0
    o = jnp.where(real[:, None], acc / jnp.where(real, l, 1.0)[:, None], 0.0)
    o_ref[b, pl.ds(t0, BQ), pl.ds(kv * G, G), :] = o.reshape(BQ, G, D).astype(o_ref.dtype)


# ---- wrappers -----------------------------------------------------------------------------------------------------
def _pad_axis(x, axis, size, value=0):
    if x.shape[axis] >= size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _check_q(q, q_pos, sinks, KV):
    B, T, Hq, D = q.shape
    if q_pos.shape != (B, T):
        raise ValueError(f"q_pos must be [{B}, {T}], got {q_pos.shape}")
    if Hq % KV:
        raise ValueError(f"{Hq} query heads do not divide into {KV} KV heads")
    if sinks.shape != (Hq,):
        raise ValueError(f"sinks must be [{Hq}], got {sinks.shape}")
    return B, T, Hq, D


def _launch(mode, q, q_pos, sinks, key_ops, *, S, W, window, block, interpret):
    """q / q_pos already padded to the kernel's T (see _padded_len)."""
    B, T, Hq, D = q.shape
    KV = key_ops[1].shape[1]
    G = Hq // KV
    pv_mode = resolve_pv(block, interpret)
    kernel = functools.partial(_kernel, mode=mode, G=G, BQ=_bq(block, G), BK=block.bk, T=T, S=S, W=W,
                               window=window, sqrt_d=math.sqrt(D), pv_mode=pv_mode)
    operands = [q, q_pos, sinks.astype(F32), *key_ops]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, T, Hq, D), BF16),
        grid=(pl.cdiv(T, _bq(block, G)), KV, B),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        compiler_params=plt.CompilerParams(num_warps=block.num_warps, num_stages=block.num_stages),
        interpret=interpret,
        name=f"prefill_attention_{mode}",
    )(*operands)


def _padded_len(T: int, block: Block, G: int) -> int:
    """Chunks shorter than one query block (or one key block) are padded; padding rows have position -1."""
    return max(T, _bq(block, G), block.bk)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, ring: RingCache, sinks: jax.Array,
                   window: int, *, interpret: bool = False, block: Block | None = None) -> jax.Array:
    """Sliding-layer attention of a chunk. q [B, T, Hq, D]; k, v [B, T, KV, D] the chunk's keys/values (BF16);
    q_pos [B, T] (-1 = padding); ring: the layer's RingCache before this chunk is written. -> o [B, T, Hq, D].
    The kernel reads the ring's slots, then the chunk's keys in place (model.attention_block concatenates them)."""
    B, T, Hq, D = _check_q(q, q_pos, sinks, ring.k.shape[1])
    KV = ring.k.shape[1]
    block = block or DEFAULT_BLOCK
    if k.shape != (B, T, KV, D) or v.shape != k.shape:
        raise ValueError(f"chunk k/v must be [{B}, {T}, {KV}, {D}], got {k.shape}, {v.shape}")
    Tp = _padded_len(T, block, Hq // KV)
    qp = _pad_axis(q.astype(BF16), 1, Tp)
    posp = _pad_axis(q_pos.astype(jnp.int32), 1, Tp, -1)
    # The kernel reads the ring and the chunk where they are (no concatenated copy of both per layer: 1.5 ms of an
    # 8K prefill on the H200, run AD); only extents shorter than one key block are padded (empty slots, position -1).
    Wp = max(ring.k.shape[2], block.bk)
    rk, rv = _pad_axis(ring.k, 2, Wp), _pad_axis(ring.v, 2, Wp)
    rpos = _pad_axis(ring.pos.astype(jnp.int32), 1, Wp, -1)
    ck, cv = _pad_axis(k.astype(BF16), 1, Tp), _pad_axis(v.astype(BF16), 1, Tp)
    o = _launch("ring", qp, posp, sinks, [rpos, rk, rv, ck, cv], S=Tp, W=Wp, window=int(window), block=block,
                interpret=interpret)
    return o[:, :T]


def full_attention(q: jax.Array, q_pos: jax.Array, cache: FullCache, lengths: jax.Array, sinks: jax.Array, *,
                   interpret: bool = False, block: Block | None = None) -> jax.Array:
    """Full-layer attention of a chunk against a FullCache that already holds it: keys 0 .. lengths[b] - 1.
    q [B, T, Hq, D], q_pos [B, T] (-1 = padding), lengths [B] -> o [B, T, Hq, D]."""
    B, T, Hq, D = _check_q(q, q_pos, sinks, cache.k.shape[1])
    block = block or DEFAULT_BLOCK
    Tp = _padded_len(T, block, Hq // cache.k.shape[1])
    fk, fv = cache.k, cache.v
    if fk.shape[2] < block.bk:  # a cache shorter than one key block (tests): pad, masked by lengths
        v_axis = 3 if values_transposed(fv.dtype) else 2
        fk, fv = _pad_axis(fk, 2, block.bk), _pad_axis(fv, v_axis, block.bk)
    o = _launch("full", _pad_axis(q.astype(BF16), 1, Tp), _pad_axis(q_pos.astype(jnp.int32), 1, Tp, -1), sinks,
                [lengths.astype(jnp.int32), fk, fv], S=fk.shape[2], W=0, window=None, block=block,
                interpret=interpret)
    return o[:, :T]


# ---- references ---------------------------------------------------------------------------------------------------
def ref_ring_attention(q, k, v, q_pos, ring: RingCache, sinks, window, *, interpret=False, block=None):
    """model.attention_block's sliding-layer attention: ring then chunk, layers.attend with the position mask."""
    del interpret, block
    keys = jnp.concatenate([ring.k, jnp.swapaxes(k, 1, 2)], axis=2)
    vals = jnp.concatenate([ring.v, jnp.swapaxes(v, 1, 2)], axis=2)
    k_pos = jnp.concatenate([ring.pos, q_pos], axis=1)
    return L.attend(q, keys, vals, L.attention_mask(q_pos, k_pos, window), sinks)


def ref_full_attention(q, q_pos, cache: FullCache, lengths, sinks, *, interpret=False, block=None):
    """model.attention_block's full-layer attention (materializes [T, S] scores: small shapes only)."""
    del interpret, block
    S = cache.k.shape[2]
    idx = jnp.arange(S)[None, :]
    k_pos = jnp.where(idx < lengths[:, None], idx, -1)
    return L.attend(q, cache.k, cache.values(), L.attention_mask(q_pos, k_pos, None), sinks)
