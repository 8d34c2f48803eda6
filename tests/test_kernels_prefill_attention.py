"""Prefill attention (pallas_kernels/prefill_attention.py) against layers.attend with layers.attention_mask, in
interpret mode on the CPU. Set FLINT_PALLAS_COMPILED=1 to run the same cases compiled on a GPU.

Tolerance, and why: the kernel runs the reference's operations (s = q.k / sqrt(D), p = e^(s - m), FP32 sums,
o = acc / denominator) but in key blocks: a row's running max can rise from one block to the next, and the
rescaling e^(m - m') and the blockwise sums round differently from the reference's one pass. Those are FP32
rounding differences; after the BF16 rounding of o they flip at most a last bit (we allow 2 BF16 ulps on a few
percent of outputs). Compiled on a GPU (approximate exp2 and division) and with BF16 probabilities (the GPU default:
each p rounded to 2^-9 relative before P @ V), o's error scales with the values, not with o: see assert_close. The
references run at full FP32 matmul precision (`reference`), which XLA on a GPU does not do by default.
"""


import flint_jax  # noqa: F401  (XLA_FLAGS first)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas_kernels import prefill_attention as pa
from flint_jax import state as ST
from flint_jax.state import FullCache, RingCache, full_cache_of, write_full, write_ring
from numerics import assert_bf16_close
from kernel_mode import INTERPRET

BF16, F32 = jnp.bfloat16, jnp.float32
B, T, Hq, KV, D, S = 2, 37, 4, 2, 16, 96
BLOCK = pa.Block(rows=32, bk=16, num_warps=4, num_stages=1)  # 16 tokens x 2 heads per program, 16 keys a step


def pv_mode(block=None) -> str:
    """The P @ V mode a kernel call in this run uses (prefill_attention.resolve_pv)."""
    return pa.resolve_pv(block, INTERPRET)


def assert_close(out, ref, rows, values, pv="f32", max_ulp=2, max_frac=0.05):
    """Compare the real query rows (rows [B, T] bool) of the kernel's output with the reference's.
    FP32 probabilities in interpret mode: at most `max_ulp` BF16 ulps on `max_frac` of the outputs (summation order).
    Otherwise (compiled on a GPU: approximate exp2 and division; BF16 probabilities) the error of o is bounded by
    the values' scale, not by o's own (a small o comes from cancelling values): |err| <= c max|v| + 2^-7 |ref|, with
    c = 2^-8 for BF16 probabilities (each p rounded to 2^-9 relative) and 2^-12 for bf16x2 (p keeps 16 bits)."""
    rows = np.asarray(rows)
    o, r = jnp.asarray(out)[rows], jnp.asarray(ref)[rows]
    vmax = max(float(np.max(np.abs(np.asarray(v, np.float32)))) for v in values)
    if pv == "f32" and INTERPRET:
        # An o that cancels to far below the values' scale (seen: -7.5e-7 against 7.4e-7 with |v| ~ 4, 4 BF16 ulps
        # apart, on an AMD EPYC host) may differ by FP32 summation order at the values' scale: 2^-20 of max |v|.
        assert_bf16_close(o, r, max_ulp, max_frac, abs_slack=2.0 ** -20 * vmax)
        return
    o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
    assert np.all(np.isfinite(o))
    bound = (2.0 ** -8 if pv == "bf16" else 2.0 ** -12) * vmax + 2.0 ** -7 * np.abs(r)
    err = np.abs(o - r)
    assert np.all(err <= bound), f"max error {float((err / bound).max()):.2f} x the bound ({pv})"


def reference(fn, *args, **kwargs):
    """A reference at full FP32 matmul precision (on the GPU XLA's default would round the FP32 P @ V's operands)."""
    with jax.default_matmul_precision("highest"):
        return fn(*args, **kwargs)


def chunk(history, n_new, seed=0):
    """A chunk after `history[b]` earlier tokens, row b real for n_new[b] tokens: q, k, v, q_pos, valid, and the
    earlier tokens' k/v [B, max(history), KV, D] with their positions and validity."""
    ks = jax.random.split(jax.random.key(seed), 5)
    hist, n_new = jnp.asarray(history, jnp.int32), jnp.asarray(n_new, jnp.int32)
    q = jax.random.normal(ks[0], (B, T, Hq, D), F32).astype(BF16)
    k = jax.random.normal(ks[1], (B, T, KV, D), F32).astype(BF16)
    v = jax.random.normal(ks[2], (B, T, KV, D), F32).astype(BF16)
    t = jnp.arange(T)[None]
    positions, valid = hist[:, None] + t, t < n_new[:, None]
    H = max(int(hist.max()), 1)
    hk = jax.random.normal(ks[3], (B, H, KV, D), F32).astype(BF16)
    hv = jax.random.normal(ks[4], (B, H, KV, D), F32).astype(BF16)
    hpos = jnp.broadcast_to(jnp.arange(H), (B, H))
    return q, k, v, positions, valid, (hk, hv, hpos, hpos < hist[:, None])


SINKS = {"minus_inf": [-np.inf] * Hq, "zero": [0.0] * Hq, "large": [30.0, 8.0, 3.0, -2.0]}
MIXED_SINKS = [0.5, -np.inf, 2.0, -1.0]
LENGTHS = {"fresh": ([0, 0], [T, T]), "mixed": ([20, 3], [T, 11]), "idle_row": ([50, 7], [T, 0])}


@pytest.mark.parametrize("window", [5, 64])  # smaller and larger than the chunk
@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_ring_attention_matches_reference(window, sinks, lengths):
    q, k, v, positions, valid, (hk, hv, hpos, hvalid) = chunk(*LENGTHS[lengths])
    ring = RingCache(jnp.zeros((B, KV, window, D), BF16), jnp.zeros((B, KV, window, D), BF16),
                     jnp.full((B, window), -1, jnp.int32))
    ring = write_ring(ring, hk, hv, hpos, hvalid)
    q_pos = jnp.where(valid, positions, -1)
    sk = jnp.asarray(SINKS[sinks], F32)
    out = pa.ring_attention(q, k, v, q_pos, ring, sk, window, interpret=INTERPRET, block=BLOCK)
    ref = reference(pa.ref_ring_attention, q, k, v, q_pos, ring, sk, window)
    assert_close(out, ref, np.asarray(valid), (v, hv), pv_mode(BLOCK))


def test_ring_attention_long_chunk_skips_masks_only_where_every_query_sees():
    """A chunk much longer than the window (96 tokens, window 40, 16-key blocks): late query blocks have whole
    chunk-key blocks that need no mask, bounded by the window on one side and causality on the other; rows with a
    wrapped ring before them and a row with padding."""
    Tl, window = 96, 40
    ks = jax.random.split(jax.random.key(11), 5)
    q = jax.random.normal(ks[0], (B, Tl, Hq, D), F32).astype(BF16)
    k = jax.random.normal(ks[1], (B, Tl, KV, D), F32).astype(BF16)
    v = jax.random.normal(ks[2], (B, Tl, KV, D), F32).astype(BF16)
    hist, n_new = jnp.array([57, 0]), jnp.array([Tl, 70])
    t = jnp.arange(Tl)[None]
    positions, valid = hist[:, None] + t, t < n_new[:, None]
    hk = jax.random.normal(ks[3], (B, 57, KV, D), F32).astype(BF16)
    hv = jax.random.normal(ks[4], (B, 57, KV, D), F32).astype(BF16)
    hpos = jnp.broadcast_to(jnp.arange(57), (B, 57))
    ring = write_ring(RingCache(jnp.zeros((B, KV, window, D), BF16), jnp.zeros((B, KV, window, D), BF16),
                                jnp.full((B, window), -1, jnp.int32)), hk, hv, hpos, hpos < hist[:, None])
    q_pos = jnp.where(valid, positions, -1)
    sk = jnp.asarray(MIXED_SINKS, F32)
    out = pa.ring_attention(q, k, v, q_pos, ring, sk, window, interpret=INTERPRET, block=BLOCK)
    ref = reference(pa.ref_ring_attention, q, k, v, q_pos, ring, sk, window)
    assert_close(out, ref, np.asarray(valid), (v, hv), pv_mode(BLOCK))


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_full_attention_matches_reference(sinks, lengths):
    q, k, v, positions, valid, (hk, hv, hpos, hvalid) = chunk(*LENGTHS[lengths], seed=1)
    cache = FullCache(jnp.zeros((B, KV, S, D), BF16), jnp.zeros((B, KV, S, D), BF16))
    cache = write_full(write_full(cache, hk, hv, hpos, hvalid), k, v, positions, valid)
    lengths_after = jnp.asarray(LENGTHS[lengths][0]) + jnp.asarray(LENGTHS[lengths][1])
    q_pos = jnp.where(valid, positions, -1)
    sk = jnp.asarray(SINKS[sinks], F32)
    out = pa.full_attention(q, q_pos, cache, lengths_after, sk, interpret=INTERPRET, block=BLOCK)
    ref = reference(pa.ref_full_attention, q, q_pos, cache, lengths_after, sk)
    assert_close(out, ref, np.asarray(valid), (v, hv), pv_mode(BLOCK))


@pytest.mark.parametrize("v_transposed", [False, True], ids=["v-key-major", "v-transposed"])
def test_full_attention_reads_an_fp8_cache(monkeypatch, v_transposed):
    """kv_dtype="fp8" (state.KV_DTYPES): history and chunk written into an FP8 cache by state.write_full (rounded,
    saturating), read by the kernel as BF16 (exact), against the reference on the same cache; V key-major (the
    default) or stored transposed (state.FP8_V_TRANSPOSED)."""
    monkeypatch.setattr(ST, "FP8_V_TRANSPOSED", v_transposed)
    name = "mixed"
    q, k, v, positions, valid, (hk, hv, hpos, hvalid) = chunk(*LENGTHS[name], seed=4)
    fp8 = jnp.float8_e4m3fn
    cache = full_cache_of(jnp.zeros((B, KV, S, D)), jnp.zeros((B, KV, S, D)), fp8)
    cache = write_full(write_full(cache, hk, hv, hpos, hvalid), k, v, positions, valid)
    assert cache.k.dtype == cache.v.dtype == fp8
    assert cache.v.shape == ((B, KV, D, S) if v_transposed else (B, KV, S, D))
    lengths_after = jnp.asarray(LENGTHS[name][0]) + jnp.asarray(LENGTHS[name][1])
    q_pos = jnp.where(valid, positions, -1)
    sk = jnp.asarray(MIXED_SINKS, F32)
    out = pa.full_attention(q, q_pos, cache, lengths_after, sk, interpret=INTERPRET, block=BLOCK)
    ref = reference(pa.ref_full_attention, q, q_pos, cache, lengths_after, sk)
    assert_close(out, ref, np.asarray(valid), (v, hv), pv_mode(BLOCK))


@pytest.mark.parametrize("pv", ["bf16x2", "bf16"])
def test_split_probabilities_stay_close(pv):
    """The GPU's P @ V variants (and their base-2 exponentials), ring and full layers, each within its mode's bound
    (assert_close)."""
    q, k, v, positions, valid, (hk, hv, hpos, hvalid) = chunk([20, 3], [T, T], seed=2)
    ring = write_ring(RingCache(jnp.zeros((B, KV, 8, D), BF16), jnp.zeros((B, KV, 8, D), BF16),
                                jnp.full((B, 8), -1, jnp.int32)), hk, hv, hpos, hvalid)
    cache = FullCache(jnp.zeros((B, KV, S, D), BF16), jnp.zeros((B, KV, S, D), BF16))
    cache = write_full(write_full(cache, hk, hv, hpos, hvalid), k, v, positions, valid)
    lengths_after = jnp.asarray([20 + T, 3 + T])
    q_pos = jnp.where(valid, positions, -1)
    sk = jnp.asarray(MIXED_SINKS, F32)
    block = pa.Block(rows=32, bk=16, num_warps=4, num_stages=1, pv=pv)
    outs = [(pa.ring_attention(q, k, v, q_pos, ring, sk, 8, interpret=INTERPRET, block=block),
             reference(pa.ref_ring_attention, q, k, v, q_pos, ring, sk, 8)),
            (pa.full_attention(q, q_pos, cache, lengths_after, sk, interpret=INTERPRET, block=block),
             reference(pa.ref_full_attention, q, q_pos, cache, lengths_after, sk))]
    for out, ref in outs:
        assert_close(out, ref, np.asarray(valid), (v, hv), pv)


def test_default_blocks_short_chunk_and_short_cache():
    """Extents shorter than one block (a 3-token chunk, a ring of 5, a cache of 40) with the default block."""
    q, k, v, positions, valid, (hk, hv, hpos, hvalid) = chunk([9, 2], [T, T], seed=3)
    q, k, v, positions, valid = q[:, :3], k[:, :3], v[:, :3], positions[:, :3], valid[:, :3]
    sk = jnp.asarray(MIXED_SINKS, F32)
    q_pos = jnp.where(valid, positions, -1)
    ring = write_ring(RingCache(jnp.zeros((B, KV, 5, D), BF16), jnp.zeros((B, KV, 5, D), BF16),
                                jnp.full((B, 5), -1, jnp.int32)), hk, hv, hpos, hvalid)
    out = pa.ring_attention(q, k, v, q_pos, ring, sk, 5, interpret=INTERPRET)
    assert_close(out, reference(pa.ref_ring_attention, q, k, v, q_pos, ring, sk, 5), np.asarray(valid), (v, hv),
                 pv_mode())
    cache = FullCache(jnp.zeros((B, KV, 40, D), BF16), jnp.zeros((B, KV, 40, D), BF16))
    cache = write_full(write_full(cache, hk, hv, hpos, hvalid), k, v, positions, valid)
    lengths_after = jnp.array([12, 5], jnp.int32)
    out = pa.full_attention(q, q_pos, cache, lengths_after, sk, interpret=INTERPRET)
    assert_close(out, reference(pa.ref_full_attention, q, q_pos, cache, lengths_after, sk), np.asarray(valid),
                 (v, hv), pv_mode())


# ---- the GPU lowering, checked on the CPU ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernels_lower_to_triton_for_h200(monkeypatch, lower_for_h200):
    """Both kernels at Flint's shapes (an 8K chunk, window 513, a 100K cache) lower to Triton IR for CUDA (an H200
    described abstractly, no GPU needed). (Compiling the IR to PTX needs the device machine, or a standalone
    Triton 3.6: docs/KERNELS.md, "Prefill (issue 7)".)"""
    S = jax.ShapeDtypeStruct
    Tf, Hf, KVf, Df, Wf, Sf = 8192, 32, 4, 128, 513, 100_000
    q, k = S((1, Tf, Hf, Df), BF16), S((1, Tf, KVf, Df), BF16)
    q_pos, sinks, lens = S((1, Tf), jnp.int32), S((Hf,), F32), S((1,), jnp.int32)
    ring = RingCache(S((1, KVf, Wf, Df), BF16), S((1, KVf, Wf, Df), BF16), S((1, Wf), jnp.int32))
    full = FullCache(S((1, KVf, Sf, Df), BF16), S((1, KVf, Sf, Df), BF16))
    fp8 = FullCache(S((1, KVf, Sf, Df), jnp.float8_e4m3fn), S((1, KVf, Sf, Df), jnp.float8_e4m3fn))
    fp8_t = FullCache(fp8.k, S((1, KVf, Df, Sf), jnp.float8_e4m3fn))  # V transposed (state.FP8_V_TRANSPOSED on)
    for fn, args, v_transposed in (
            (lambda q, k, v, p, r, s: pa.ring_attention(q, k, v, p, r, s, Wf), (q, k, k, q_pos, ring, sinks), False),
            (lambda q, p, c, n, s: pa.full_attention(q, p, c, n, s), (q, q_pos, full, lens, sinks), False),
            (lambda q, p, c, n, s: pa.full_attention(q, p, c, n, s), (q, q_pos, fp8, lens, sinks), False),
            (lambda q, p, c, n, s: pa.full_attention(q, p, c, n, s), (q, q_pos, fp8_t, lens, sinks), True)):
        monkeypatch.setattr(ST, "FP8_V_TRANSPOSED", v_transposed)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
