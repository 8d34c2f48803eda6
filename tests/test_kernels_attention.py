"""Attention kernels of issue 5 (pallas_kernels/attention_prologue.py, decode_attention.py) against their references,
in interpret mode on the CPU (what CI runs); scripts/bench_kernels_attention.py runs the same checks compiled on
the GPU.

Tolerances. The kernels round at the same BF16 points as layers.py, but their FP32 sums run in another order
(blocked dot products, online softmax rescaling, split partials), so a BF16 result can land one ulp away when an
FP32 value sits next to a rounding boundary, and such a flip propagates (a flipped K element changes every score
slightly). Projections and finished Q/K/V: |got - ref| <= 2^-7 |ref| + 2^-8 * rms(ref) (one BF16 ulp, plus room
for values that cancel). Attention outputs and the block output: within 2 BF16 ulps of max|ref| elementwise.
Cache contents outside the written slot and ring positions are exact.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.config import FULL, SLIDING, FlintConfig
from flint_jax.params import init_params
from flint_jax.pallas_kernels import attention_prologue as AP
from flint_jax.pallas_kernels import decode_attention as DA
from flint_jax.state import FullCache, RingCache, full_cache_of, to_cache_values
from kernel_mode import INTERPRET

W, S_MAX = 17, 256
CFG = FlintConfig.tiny(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       sliding_window=W, num_hidden_layers=2, layer_types=(SLIDING, FULL))
SINKS = {"-inf": -np.inf, "0": 0.0, "large": 30.0}


# CI runs interpret mode on the CPU; scripts/bench_kernels_attention.py sets FLINT_PALLAS_COMPILED=1 on the GPU.


def _jit(f, *static):
    return jax.jit(functools.partial(f, interpret=INTERPRET), static_argnames=static)


qkv_k = _jit(AP.qkv_projection, "cfg")
prologue_k = _jit(AP.attention_prologue, "cfg", "sliding")
prologue_r = jax.jit(AP.ref_attention_prologue, static_argnames=("cfg", "sliding"))
attend_k = _jit(DA.decode_attention, "cfg", "sliding", "splits", "min_chunk")
attend_r = jax.jit(DA.ref_decode_attention, static_argnames=("cfg", "sliding", "splits", "min_chunk"))
block_k = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")
block_r = jax.jit(DA.ref_attention_block_decode, static_argnames=("cfg", "sliding", "splits", "min_chunk"))


@functools.cache
def params(weights):
    return init_params(CFG, jax.random.key(0), weights)


def f32(x):
    return np.asarray(x, np.float32)


def assert_ulp_close(got, ref):
    got, ref = f32(got), f32(ref)
    rms = float(np.sqrt(np.mean(ref ** 2)))
    bad = np.abs(got - ref) > 2 ** -7 * np.abs(ref) + 2 ** -8 * rms
    assert not bad.any(), f"{bad.sum()} of {bad.size} beyond one ulp; max diff {np.abs(got - ref).max()}"


def assert_out_close(got, ref, ulps=2):
    got, ref = f32(got), f32(ref)
    assert not np.isnan(got).any() and not np.isnan(ref).any()
    np.testing.assert_allclose(got, ref, rtol=0, atol=ulps * 2 ** -8 * float(np.abs(ref).max()))


def ring_cache(key, positions, cfg=CFG):
    """A ring holding positions max(0, p - W + 1) .. p of each sequence (p = -1: empty), random K/V."""
    B, W = len(positions), cfg.sliding_window
    kk, kv = jax.random.split(key)
    shape = (B, cfg.num_key_value_heads, W, cfg.head_dim)
    slots = np.arange(W)
    pos = np.full((B, W), -1, np.int32)
    for b, p in enumerate(positions):
        if p >= 0:
            held = p - (p - slots) % W  # the newest position <= p in each slot
            pos[b] = np.where(held >= 0, held, -1)
    return RingCache(k=jax.random.normal(kk, shape).astype(jnp.bfloat16),
                     v=jax.random.normal(kv, shape).astype(jnp.bfloat16), pos=jnp.asarray(pos))


def full_cache(key, B):
    kk, kv = jax.random.split(key)
    shape = (B, CFG.num_key_value_heads, S_MAX, CFG.head_dim)
    return FullCache(k=jax.random.normal(kk, shape).astype(jnp.bfloat16),
                     v=jax.random.normal(kv, shape).astype(jnp.bfloat16))


def random_q(key, B):
    return jax.random.normal(key, (B, CFG.num_attention_heads, CFG.head_dim)).astype(jnp.bfloat16)


def sinks_of(kind):
    return jnp.full((CFG.num_attention_heads,), SINKS[kind], jnp.float32).at[1].add(-1.5)


# ---- prologue ----------------------------------------------------------------------------------------------

# Both weight kinds and both cache kinds, without the full cross product (interpret-mode compiles are slow).
@pytest.mark.parametrize("weights,sliding", [("nvfp4", True), ("bf16", False)], ids=["ring-nvfp4", "full-bf16"])
def test_attention_prologue(weights, sliding):
    layer = params(weights).layers[0 if sliding else 1]
    positions = jnp.array([0, W - 1, W, 3 * W + 4], jnp.int32)
    active = jnp.array([True, True, False, True])
    B = len(positions)
    h = jax.random.normal(jax.random.key(2), (B, CFG.hidden_size)).astype(jnp.bfloat16)
    cache = ring_cache(jax.random.key(3), [-1, W - 2, W - 1, 3 * W + 3]) if sliding else full_cache(
        jax.random.key(3), B)
    q, new = prologue_k(h, layer.attn_norm, layer.attn, cache, positions, active, cfg=CFG, sliding=sliding)
    q_ref, new_ref = prologue_r(h, layer.attn_norm, layer.attn, cache, positions, active, cfg=CFG, sliding=sliding)
    assert_ulp_close(q, q_ref)
    assert_ulp_close(new.k, new_ref.k)
    assert_ulp_close(new.v, new_ref.v)
    # Only the written slots changed.
    slot = np.asarray(positions) % W if sliding else np.asarray(positions)
    for b in range(B):
        keep = np.ones(new.k.shape[2], bool)
        if active[b]:
            keep[slot[b]] = False
        np.testing.assert_array_equal(f32(new.k[b][:, keep]), f32(cache.k[b][:, keep]))
    if sliding:
        np.testing.assert_array_equal(np.asarray(new.pos), np.asarray(new_ref.pos))


@pytest.mark.parametrize("v_transposed", [False, True], ids=["v-key-major", "v-transposed"])
def test_attention_prologue_writes_an_fp8_cache(monkeypatch, v_transposed):
    """The prologue-only API on an FP8 full cache (V key-major, the default, or stored transposed): the K/V written
    where the reference's write_full puts them (within one FP8 step), every other entry untouched, q as the
    reference's."""
    from flint_jax import state as ST
    monkeypatch.setattr(ST, "FP8_V_TRANSPOSED", v_transposed)
    prologue_k = _jit(AP.attention_prologue, "cfg", "sliding")  # a fresh trace sees the knob
    layer = params("nvfp4").layers[1]
    positions = jnp.array([0, 63, 64, 190], jnp.int32)
    active = jnp.array([True, False, True, True])
    B = len(positions)
    h = jax.random.normal(jax.random.key(4), (B, CFG.hidden_size)).astype(jnp.bfloat16)
    start = full_cache(jax.random.key(5), B)
    cache = full_cache_of(start.k, start.v, jnp.float8_e4m3fn)
    assert (cache.v.shape == cache.k.shape) != v_transposed
    q, new = prologue_k(h, layer.attn_norm, layer.attn, cache, positions, active, cfg=CFG, sliding=False)
    q_ref, new_ref = prologue_r(h, layer.attn_norm, layer.attn, cache, positions, active, cfg=CFG, sliding=False)
    assert_ulp_close(q, q_ref)
    assert new.v.shape == cache.v.shape
    for got, ref, old in ((new.k, new_ref.k, cache.k), (new.values(), new_ref.values(), cache.values())):
        written = np.zeros(got.shape, bool)
        for b in np.flatnonzero(np.asarray(active)):
            written[b, :, int(positions[b])] = True
        np.testing.assert_array_equal(f32(got)[~written], f32(old)[~written])
        assert fp8_ulps(f32(got)[written], f32(ref)[written]).max() <= 1


# ---- decode attention over a cache that holds the token -------------------------------------------------------

# Lengths 1, W-1, W, W+1 and several wraps of the ring in one batch (position = length - 1), plus an inactive
# sequence (reads nothing: o = 0 when the sink is finite).
RING_POSITIONS = [0, W - 2, W - 1, W, 3 * W + 5, 40]
# With 4 splits and chunks of >= 64 keys (BLOCK_K): lengths at and around the chunk boundaries (64, 128, 192,
# 256 = max_len); with chunks of >= 128 keys, lengths <= 128 use one split of the four and the rest two.
FULL_POSITIONS = [0, 63, 64, 128, 190, 255]
ACTIVE = jnp.array([True] * 5 + [False])


def check_attention(cache, positions, sink, sliding, splits=None, min_chunk=None, cfg=CFG):
    B = len(positions)
    q = random_q(jax.random.key(7), B)
    pos = jnp.asarray(positions, jnp.int32)
    got = attend_k(q, cache, pos, sinks_of(sink), cfg=cfg, sliding=sliding, active=ACTIVE, splits=splits,
                   min_chunk=min_chunk)
    ref = attend_r(q, cache, pos, sinks_of(sink), cfg=cfg, sliding=sliding, active=ACTIVE)
    if sink == "-inf":  # the inactive row is 0/0 in the reference too: compare the others
        got, ref = got[:-1], ref[:-1]
    else:
        assert not f32(got[-1]).any()
    assert_out_close(got, ref)


@pytest.mark.parametrize("sink", list(SINKS))
def test_decode_attention_ring(sink):
    check_attention(ring_cache(jax.random.key(4), RING_POSITIONS), RING_POSITIONS, sink, sliding=True)


def test_decode_attention_ring_split():
    """Rings may be split too (a ring of 100 slots in 2 splits of 64: one full, one partial block)."""
    cfg = CFG.replace(sliding_window=100)
    positions = [0, 63, 64, 99, 100, 370]
    check_attention(ring_cache(jax.random.key(4), positions, cfg), positions, "0", sliding=True, splits=2, cfg=cfg)


@pytest.mark.parametrize("splits,min_chunk", [(1, 64), (4, 64), (4, 128), (3, 64), (33, 64)])
@pytest.mark.parametrize("sink", list(SINKS))
def test_decode_attention_full(splits, min_chunk, sink):
    """3 and 33 splits: not powers of two, so folded by the combine kernel (its partials padded to 4 and 64) even
    where the kernel folds 4 itself; 33 splits of >= 64 keys leave most of them empty at these lengths."""
    check_attention(full_cache(jax.random.key(6), len(FULL_POSITIONS)), FULL_POSITIONS, sink, sliding=False,
                    splits=splits, min_chunk=min_chunk)


def test_default_splits():
    assert DA.default_splits(1, 4, sliding=True) == DA.RING_SPLITS
    # At most 264 programs (one wave). B = 1: 66 (the combine kernel takes any count; 64 as a power of two).
    assert DA.default_splits(1, 4, sliding=False) == (66 if DA.ANY_SPLITS else 64)
    assert DA.default_splits(2, 4, sliding=False) == (33 if DA.ANY_SPLITS else 32)
    # B = 4: 16 splits, folded in the kernel, which needs a power of two.
    assert DA.default_splits(4, 4, sliding=False) == 16
    assert DA.default_splits(8, 4, sliding=False) == 8
    assert DA.default_splits(64, 8, sliding=False) == 1


# ---- the whole block against model.attention_block ---------------------------------------------------------------

def check_two_decode_steps(block, layer, cache, lengths, sliding: bool, seed: int, check_caches: bool = True,
                           full_splits: int | None = 4):
    """Two fused decode steps from `cache` at `lengths` (sequence 1 inactive in the first step) by `block` and by
    the reference: each step's h, and (check_caches) the caches, against the reference's. A full layer runs
    `full_splits` splits (None: the default count) of at least 64 keys."""
    B = len(lengths)
    cache_ref = cache
    pos = jnp.asarray(lengths, jnp.int32)
    for step in range(2):
        h = jax.random.normal(jax.random.key(seed + step), (B, CFG.hidden_size)).astype(jnp.bfloat16)
        active = jnp.array([True, step != 0, True, True])
        got, cache = block(h, layer, cache, pos, active, cfg=CFG, sliding=sliding,
                           splits=None if sliding else full_splits, min_chunk=None if sliding else 64)
        ref, cache_ref = block_r(h, layer, cache_ref, pos, active, cfg=CFG, sliding=sliding)
        assert_out_close(got, ref)
        if check_caches:
            assert_ulp_close(cache.k, cache_ref.k)
            assert_ulp_close(cache.v, cache_ref.v)
            if sliding:
                np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(cache_ref.pos))
        pos = pos + active.astype(jnp.int32)


@pytest.mark.parametrize("weights,sliding", [("bf16", True), ("nvfp4", True), ("nvfp4", False)],
                         ids=["ring-bf16", "ring-nvfp4", "full-nvfp4"])
def test_attention_block_decode_steps(weights, sliding):
    """Two decode steps from caches at mixed lengths (incl. empty, W-1, W, wrapped; full-cache split
    boundaries), one sequence inactive in the first step; each step's h and cache against the reference's."""
    layer = params(weights).layers[0 if sliding else 1]
    lengths = [0, W - 1, W, 3 * W + 2] if sliding else [0, 63, 64, 190]
    cache = ring_cache(jax.random.key(10), [n - 1 for n in lengths]) if sliding else full_cache(
        jax.random.key(10), len(lengths))
    check_two_decode_steps(block_k, layer, cache, lengths, sliding, seed=20)


FP8 = jnp.float8_e4m3fn


def fp8_ulps(got, ref):
    """|got - ref| in units of ref's FP8 (E4M3) spacing: 2^(e - 3) for normal values, 2^-9 below 2^-6."""
    got, ref = f32(got), f32(ref)
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 2.0 ** -6))) - 3)
    return np.abs(got - ref) / spacing


@pytest.mark.parametrize("amplify", [1.0, 3000.0], ids=["fp8", "fp8-saturating"])
def test_attention_block_decode_fp8_full_cache(amplify):
    """kv_dtype="fp8" (state.KV_DTYPES): two decode steps on an FP8 full cache, 4 splits folded by `combine`, against
    model.attention_block on the same cache. The new K/V are rounded as state.write_full rounds them, and the new
    token attends with those values. "saturating": the attention norm scaled up so V reaches thousands: stored as
    +-448 (E4M3's largest finite value), not NaN. Cache entries other than the written slots stay bit for bit; a
    written value may sit one FP8 step from the reference's (its BF16 value one ulp away, across a rounding
    boundary)."""
    import dataclasses
    layer = params("nvfp4").layers[1]
    layer = dataclasses.replace(layer, attn_norm=(layer.attn_norm.astype(jnp.float32) * amplify).astype(jnp.bfloat16))
    lengths = [0, 63, 64, 190]
    B = len(lengths)
    start = full_cache(jax.random.key(10), B)
    cache = cache_ref = full_cache_of(start.k, start.v, FP8)
    assert cache.v.shape == cache.k.shape  # FP8 keeps V key-major by default (state.FP8_V_TRANSPOSED)
    pos = jnp.asarray(lengths, jnp.int32)
    written = np.zeros(cache.k.shape, bool)
    for step in range(2):
        h = jax.random.normal(jax.random.key(20 + step), (B, CFG.hidden_size)).astype(jnp.bfloat16)
        active = jnp.array([True, step != 0, True, True])
        got, cache = block_k(h, layer, cache, pos, active, cfg=CFG, sliding=False, splits=4, min_chunk=64)
        ref, cache_ref = block_r(h, layer, cache_ref, pos, active, cfg=CFG, sliding=False)
        assert cache.k.dtype == cache.v.dtype == FP8
        assert_out_close(got, ref)
        for b in np.flatnonzero(np.asarray(active)):
            written[b, :, int(pos[b])] = True
        for got_c, ref_c in ((cache.k, cache_ref.k), (cache.values(), cache_ref.values())):
            g, r = f32(got_c), f32(ref_c)
            assert not np.isnan(g).any()
            np.testing.assert_array_equal(g[~written], r[~written])
            assert fp8_ulps(g[written], r[written]).max() <= 1
        pos = pos + active.astype(jnp.int32)
    v = f32(cache.values())[written]
    if amplify > 1:
        assert np.abs(v).max() == 448.0 and (np.abs(v) == 448.0).mean() > 0.5
    else:
        assert np.abs(v).max() < 448.0


def test_values_dot_rounding_modes(monkeypatch):
    """PV_MODE's values dot, alone, against an FP64 product: "bf16x2" (p split into two BF16 parts) is close to
    FP32 rounding (p to about 16 bits), "bf16" rounds p to 8 bits, so its error is far larger; an unknown mode
    is refused by name."""
    kp, kv = jax.random.split(jax.random.key(40))
    p = jax.nn.softmax(3 * jax.random.normal(kp, (16, 64)), axis=1)
    v = jax.random.normal(kv, (64, 128)).astype(jnp.bfloat16)
    exact = np.asarray(p, np.float64) @ np.asarray(v.astype(jnp.float32), np.float64)
    errors = {}
    for mode in ("bf16x2", "bf16"):
        monkeypatch.setattr(DA, "PV_MODE", mode)
        errors[mode] = np.abs(np.asarray(DA._values_dot(p, v), np.float64) - exact).max()
    scale = np.abs(exact).max()
    assert errors["bf16x2"] < 2.0 ** -14 * scale
    assert errors["bf16"] > 8 * errors["bf16x2"]
    monkeypatch.setattr(DA, "PV_MODE", "fp16")
    with pytest.raises(ValueError, match="PV_MODE must be one of"):
        DA._values_dot(p, v)


def block_case(sliding: bool, seed: int, fp8: bool = False):
    """(layer, cache, lengths) for check_two_decode_steps, NVFP4 weights: a sliding layer's ring at lengths around
    the window and its wrap, or a full layer's cache (BF16, or FP8 where fp8; rings stay BF16) at lengths around
    64-key splits."""
    layer = params("nvfp4").layers[0 if sliding else 1]
    lengths = [0, W - 1, W, 3 * W + 2] if sliding else [0, 63, 64, 190]
    if sliding:
        return layer, ring_cache(jax.random.key(seed), [n - 1 for n in lengths]), lengths
    cache = full_cache(jax.random.key(seed), len(lengths))
    if fp8:
        cache = full_cache_of(cache.k, cache.v, FP8)
    return layer, cache, lengths


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_values_dot_in_bf16_parts_decodes_like_the_reference(monkeypatch, kv_dtype):
    """PV_MODE="bf16x2" in the fused decode: a sliding layer (ring) and a full layer (BF16 or FP8 cache, 4 splits),
    two steps each, against the reference, as with the default TF32 values dot. (An FP8 cache takes PV_MODE only
    with FP8_HALF_VALUES off.)"""
    monkeypatch.setattr(DA, "PV_MODE", "bf16x2")
    monkeypatch.setattr(DA, "FP8_HALF_VALUES", False)
    block = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the mode
    for sliding in ((True, False) if kv_dtype == "bf16" else (False,)):
        layer, cache, lengths = block_case(sliding, seed=41, fp8=kv_dtype == "fp8")
        check_two_decode_steps(block, layer, cache, lengths, sliding, seed=42, check_caches=False)


def test_values_dot_in_fp16_keeps_small_probabilities():
    """An FP8 cache's values dot in FP16 (FP8_HALF_VALUES): p is scaled by P_SCALE before rounding to FP16, so
    probabilities far below FP16's normal range (here ~2^-20 of the maximum) keep 11 significant bits, as TF32
    keeps them; the result is close to FP64 and far closer than p rounded to BF16."""
    kp, kv = jax.random.split(jax.random.key(43))
    v = to_cache_values(3 * jax.random.normal(kv, (64, 128)), FP8).astype(jnp.float16)  # FP8 values, exact in FP16
    p_soft = jax.nn.softmax(3 * jax.random.normal(kp, (16, 64)), axis=1)
    p_small = 2.0 ** -20 * (1 + jax.random.uniform(kp, (16, 64)))
    for p in (p_soft, p_small):
        exact = np.asarray(p, np.float64) @ np.asarray(v.astype(jnp.float32), np.float64)
        scale = np.abs(np.asarray(p, np.float64)) @ np.abs(np.asarray(v.astype(jnp.float32), np.float64))
        got = np.asarray(DA._values_dot(p, v), np.float64)
        assert (np.abs(got - exact) / scale).max() < 2.0 ** -11  # p's rounding: half an ulp of 11 bits at most
        p_bf16 = np.asarray(p.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        coarse = p_bf16 @ np.asarray(v.astype(jnp.float32), np.float64)
        assert np.abs(got - exact).max() * 4 < np.abs(coarse - exact).max()


@pytest.mark.parametrize("scores,values,block_k", [(True, True, 64), (True, True, 128), (True, False, 64),
                                                   (False, True, 64), (False, False, 128)],
                         ids=["fp16-dots", "fp16-dots-128-key-blocks", "fp16-scores", "fp16-values",
                              "bf16-tf32-128-key-blocks"])
def test_fp8_cache_dots_in_fp16_decode_like_the_reference(monkeypatch, scores, values, block_k):
    """FP8_HALF_SCORES / FP8_HALF_VALUES / FP8_BLOCK_K: the fused decode on an FP8 full cache (4 splits) with either
    dot or both on FP16 operands, in blocks of 64 or 128 keys (min_chunk 64 rounded up to whole blocks: the
    lengths cross a 128-key split), two steps against the reference, as with the BF16 / TF32 dots. Rings are BF16
    caches: the knobs leave them alone (a sliding layer checked too)."""
    monkeypatch.setattr(DA, "FP8_HALF_SCORES", scores)
    monkeypatch.setattr(DA, "FP8_HALF_VALUES", values)
    monkeypatch.setattr(DA, "FP8_BLOCK_K", block_k)
    block = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the knobs
    for sliding in (False, True):
        layer, cache, lengths = block_case(sliding, seed=44, fp8=True)  # the ring stays BF16
        check_two_decode_steps(block, layer, cache, lengths, sliding, seed=45, check_caches=sliding)


def test_fp8_block_follows_the_gpu_kind(monkeypatch):
    """FP8_BLOCK_K None: 64-key blocks on an H100 and an H200, 128 elsewhere (no GPU: interpret mode and lowering on
    a CPU host); an int overrides the table on every device."""
    monkeypatch.setattr(DA, "FP8_BLOCK_K", None)
    assert DA.fp8_block_keys("NVIDIA H100 80GB HBM3") == 64
    assert DA.fp8_block_keys("NVIDIA H200") == 64
    assert DA.fp8_block_keys("NVIDIA A100-SXM4-80GB") == DA.fp8_block_keys("") == 128
    # this host: 128 on a CPU (interpret mode, CI); compiled on a GPU (FLINT_PALLAS_COMPILED=1), that GPU's block
    host = DA.gpu_kind()
    assert DA.fp8_block_keys() == DA.full_block_keys(FP8) == (DA.fp8_block_keys(host) if host else 128)
    assert DA.full_block_keys(jnp.bfloat16) == DA.BLOCK_K
    monkeypatch.setattr(DA, "FP8_BLOCK_K", 256)
    assert DA.fp8_block_keys("NVIDIA H100 80GB HBM3") == 256


def test_fp8_full_layers_take_the_gpus_program_shape(monkeypatch):
    """An FP8 cache's full layers run 2-warp programs and aim at 528 programs on an H200 (128 splits at batch 1, 16
    at batch 8: run FI), NUM_WARPS and TARGET_PROGRAMS elsewhere; BF16 caches keep NUM_WARPS and TARGET_PROGRAMS
    on every GPU; FP8_NUM_WARPS and FP8_TARGET_PROGRAMS override the table."""
    for knob in ("FP8_BLOCK_K", "FP8_NUM_WARPS", "FP8_TARGET_PROGRAMS"):
        monkeypatch.setattr(DA, knob, None)
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    assert DA.full_num_warps(FP8, h200) == 2 and DA.full_target_programs(FP8, h200) == 528
    for kind in (h100, ""):
        assert DA.full_num_warps(FP8, kind) == DA.NUM_WARPS
        assert DA.full_target_programs(FP8, kind) == DA.TARGET_PROGRAMS
    assert DA.full_num_warps(jnp.bfloat16, h200) == DA.NUM_WARPS
    assert DA.full_target_programs(jnp.bfloat16, h200) == DA.TARGET_PROGRAMS
    monkeypatch.setattr(DA, "gpu_kind", lambda: h200)
    assert [DA.default_splits(b, 4, False, FP8) for b in (1, 2, 4, 8)] == [128, 64, 32, 16]
    assert [DA.default_splits(b, 4, False) for b in (1, 8)] == [64, 8]
    assert DA.default_splits(1, 4, True, FP8) == DA.RING_SPLITS
    monkeypatch.setattr(DA, "FP8_NUM_WARPS", 4)
    monkeypatch.setattr(DA, "FP8_TARGET_PROGRAMS", 264)
    assert DA.full_num_warps(FP8, h200) == 4 and DA.default_splits(1, 4, False, FP8) == 64


def _lowered_attention_calls(cfg, kv_dtype, rows: int = 1, context: int = 4096):
    """{kernel name: (num_warps, grid)} of the Triton calls of a full layer's decode attention block, lowered for
    CUDA on this host (abstract parameters)."""
    from flint_jax.pallas_path import lowering_for_gpu
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), "nvfp4"))
    layer = params.layers[cfg.full_layers[0]]
    kv = jax.ShapeDtypeStruct((rows, cfg.num_key_value_heads, context, cfg.head_dim), kv_dtype)
    h = jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.bfloat16)
    pos, act = jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.bool_)

    def block(h, layer, k, v, pos, act):
        return DA.attention_block_decode(h, layer, FullCache(k=k, v=v), pos, act, cfg, False)
    with lowering_for_gpu():
        text = jax.jit(block).trace(h, layer, kv, kv, pos, act).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r'grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32, ir = "[^"]*", '
                       r'name = "(decode_attention\w*)", num_stages = \d+ : i32, num_warps = (\d+) : i32', text)
    return {name: (int(warps), (int(x), int(y), int(z))) for x, y, z, name, warps in calls}


def test_fp8_program_shape_reaches_the_lowered_kernel(monkeypatch):
    """The GPU's FP8 program shape is what the full layer's kernel is launched with. Two sequences on the tiny
    config's 2 KV heads: lowered for CUDA as an H200 the fused full-layer kernel runs 2 warps over a (2, 2, 128)
    grid (528 // 4 programs, capped at MAX_SPLITS = 128); as an unlisted GPU, and on a BF16 cache as an H200,
    NUM_WARPS over (2, 2, 64) (264 // 4 = 66, down to a power of two). At one sequence both counts would hit the
    cap, so the split count would not show whether the cache's target reached `default_splits`. The cache holds
    32,768 slots, which 128 splits of MIN_CHUNK = 256 keys can fill (SPLITS_FIT_MAX_LEN)."""
    for knob in ("FP8_BLOCK_K", "FP8_NUM_WARPS", "FP8_TARGET_PROGRAMS"):
        monkeypatch.setattr(DA, knob, None)
    cfg = FlintConfig.tiny()
    kv, rows, context = cfg.num_key_value_heads, 2, 128 * DA.MIN_CHUNK
    monkeypatch.setattr(DA, "gpu_kind", lambda: "NVIDIA H200")
    assert _lowered_attention_calls(cfg, FP8, rows, context)["decode_attention_fused_full"] == (2, (rows, kv, 128))
    monkeypatch.setattr(DA, "gpu_kind", lambda: "")
    expect = min(DA.MAX_SPLITS, DA.TARGET_PROGRAMS // (rows * kv))
    expect = (DA.NUM_WARPS, (rows, kv, 1 << (expect.bit_length() - 1)))
    assert expect[1][2] < 128
    assert _lowered_attention_calls(cfg, FP8, rows, context)["decode_attention_fused_full"] == expect
    monkeypatch.setattr(DA, "gpu_kind", lambda: "NVIDIA H200")
    # BF16 caches: unchanged on an H200
    assert _lowered_attention_calls(cfg, jnp.bfloat16, rows, context)["decode_attention_fused_full"] == expect


@pytest.mark.parametrize("fit", [True, False], ids=["fit-max-len", "by-target-alone"])
def test_full_layer_splits_fit_the_cache(monkeypatch, fit):
    """SPLITS_FIT_MAX_LEN: a full layer launches no more splits than MIN_CHUNK-key splits can fill in its cache (the
    next power of two): lowered for CUDA as an H200 on FP8 caches (2 sequences, target 128 splits), 4,096 slots give
    16 splits, 4,097 give 32, 32,768 give the target's 128; a 2,048-slot BF16 cache at one sequence 8 of the 128.
    Off, every cache takes the target's count."""
    monkeypatch.setattr(DA, "SPLITS_FIT_MAX_LEN", fit)
    for knob in ("FP8_BLOCK_K", "FP8_NUM_WARPS", "FP8_TARGET_PROGRAMS"):
        monkeypatch.setattr(DA, knob, None)
    monkeypatch.setattr(DA, "gpu_kind", lambda: "NVIDIA H200")
    assert DA.MIN_CHUNK == 256
    assert [DA.max_splits_with_keys(n, 256) for n in (1, 256, 257, 4096, 4097)] == [1, 1, 2, 16, 17]
    cfg = FlintConfig.tiny()
    kv, rows = cfg.num_key_value_heads, 2
    for context, capped in ((4096, 16), (4097, 32), (32768, 128)):
        got = _lowered_attention_calls(cfg, FP8, rows, context)["decode_attention_fused_full"]
        assert got == (2, (rows, kv, capped if fit else 128)), context
        assert DA.default_splits(rows, kv, False, FP8, max_len=context) == (capped if fit else 128)
    got = _lowered_attention_calls(cfg, jnp.bfloat16, 1, 2048)["decode_attention_fused_full"]
    assert got[1] == (1, kv, 8 if fit else 128)  # 264 // 2 programs, capped at MAX_SPLITS
    # min_chunk counts: 128-key chunks fill twice the splits
    assert DA.default_splits(1, 4, False, max_len=2048, min_chunk=128) == (16 if fit else 64)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_full_layer_splits_that_fit_the_cache_decode_alike(monkeypatch, kv_dtype):
    """The splits SPLITS_FIT_MAX_LEN leaves out only ever held neutral partials: at lengths up to the cache's end
    (max_len 256 with 64-key chunks, 4 sequences: 4 splits instead of 32) the fused decode gives the same outputs
    (within a BF16 rounding: the fold sums the same partials, but FP32 sums grouped differently may differ in the
    last bit) and writes the same cache with and without them, and both match the reference for two steps."""
    layer, cache, lengths = block_case(False, seed=50, fp8=kv_dtype == "fp8")
    B, KV = len(lengths), CFG.num_key_value_heads
    assert cache.k.shape[2] == 256
    h = jax.random.normal(jax.random.key(51), (B, CFG.hidden_size)).astype(jnp.bfloat16)
    pos, active = jnp.asarray(lengths, jnp.int32), jnp.ones((B,), bool)
    outs = {}
    for fit in (True, False):
        monkeypatch.setattr(DA, "SPLITS_FIT_MAX_LEN", fit)
        splits = DA.default_splits(B, KV, False, cache.k.dtype, max_len=256, min_chunk=64)
        assert splits == (4 if fit else DA.default_splits(B, KV, False, cache.k.dtype)) and (fit or splits > 4)
        block = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace
        outs[fit] = block(h, layer, cache, pos, active, cfg=CFG, sliding=False, splits=None, min_chunk=64)
        check_two_decode_steps(block, layer, cache, lengths, False, seed=52, check_caches=False, full_splits=None)
    (o_fit, c_fit), (o_all, c_all) = outs[True], outs[False]
    np.testing.assert_allclose(f32(o_fit), f32(o_all), rtol=2 ** -7, atol=1e-6)
    np.testing.assert_array_equal(f32(c_fit.k), f32(c_all.k))


@pytest.mark.parametrize("granule,chunk,active", [(64, 1600, 63), (None, 1664, 61)], ids=["granules", "blocks"])
def test_full_layer_chunks_are_whole_granules(monkeypatch, granule, chunk, active):
    """SPLIT_GRANULE: a full layer's split chunks are multiples of 64 keys even where the loop takes 128-key blocks
    (FP8 caches), so 100K keys in 64 splits are 63 chunks of 1,600 keys, not 61 of 1,664 (whole blocks, the form
    before). A split then ends inside its last block, whose loads stop at the chunk's end: the decode still matches
    the reference at lengths whose chunks end mid-block, both ways."""
    monkeypatch.setattr(DA, "SPLIT_GRANULE", granule)
    monkeypatch.setattr(DA, "FP8_BLOCK_K", 128)
    unit = DA.chunk_unit(DA.full_block_keys(FP8))
    assert unit == (granule or 128)
    _, got_chunk, got_active = DA.split_geometry(jnp.int32(100_000), jnp.bool_(True), fused=True, splits=64,
                                                 min_chunk=256, unit=unit)
    assert (int(got_chunk), int(got_active)) == (chunk, active)
    block = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the knobs
    layer, cache, lengths = block_case(False, seed=48, fp8=True)
    check_two_decode_steps(block, layer, cache, lengths, False, seed=49, check_caches=False)


@pytest.mark.parametrize("v_transposed,keys_as_m", [(True, True), (True, False)],
                         ids=["v-transposed-keys-on-m", "v-transposed-heads-on-m"])
def test_fp8_cache_layouts_decode_like_the_reference(monkeypatch, v_transposed, keys_as_m):
    """An FP8 full cache keeps V key-major like K by default (checked by the tests above; runs EJ-EU's layout). The
    transposed forms, kept as profiler variants (state.FP8_V_TRANSPOSED on), decode like the reference too: the keys
    on the dots' M dimension (KEYS_AS_M, run EU's first default), or the query heads on M (the values dot takes V^T by
    trans_b)."""
    from flint_jax import state as ST
    monkeypatch.setattr(ST, "FP8_V_TRANSPOSED", v_transposed)
    monkeypatch.setattr(DA, "KEYS_AS_M", keys_as_m)
    block = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the knobs
    layer, cache, lengths = block_case(False, seed=46, fp8=True)
    assert (cache.v.shape == cache.k.shape) != v_transposed
    assert DA.keys_as_m(cache.k.dtype, ring=False) == (v_transposed and keys_as_m)
    check_two_decode_steps(block, layer, cache, lengths, False, seed=47, check_caches=False)


def test_fp8_cache_stores_v_transposed(monkeypatch):
    """With state.FP8_V_TRANSPOSED on, state.init_state / full_cache_of / write_full and the fused kernel's KV write
    agree on the FP8 layout ([B, KV, D, S] V; K and BF16 caches key-major), `FullCache.values()` reads either layout
    key-major, and a key-major V in such a cache is refused by name. Off (the default), FP8 V is key-major."""
    from flint_jax import state as ST
    from flint_jax.state import init_state, write_full
    KV, D = CFG.num_key_value_heads, CFG.head_dim
    assert init_state(CFG, 2, 40, kv_dtype="fp8").layers[CFG.full_layers[0]].v.shape == (2, KV, 40, D)
    monkeypatch.setattr(ST, "FP8_V_TRANSPOSED", True)
    block_k = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the knob
    state = init_state(CFG, 2, 40, kv_dtype="fp8")
    full = state.layers[CFG.full_layers[0]]
    assert full.k.shape == (2, KV, 40, D) and full.v.shape == (2, KV, D, 40)
    assert init_state(CFG, 2, 40).layers[CFG.full_layers[0]].v.shape == (2, KV, 40, D)
    k, v = (jax.random.normal(jax.random.key(i), (2, 3, KV, D)).astype(jnp.bfloat16) for i in (48, 49))
    positions = jnp.array([[5, 6, 7], [0, 1, 2]], jnp.int32)
    valid = jnp.array([[True, True, True], [True, False, True]])
    cache = write_full(full, k, v, positions, valid)
    bf16 = write_full(full_cache_of(full.k, full.values(), jnp.bfloat16), k, v, positions, valid)
    np.testing.assert_array_equal(f32(cache.values()), f32(to_cache_values(bf16.v, FP8)))
    np.testing.assert_array_equal(f32(cache.k), f32(to_cache_values(bf16.k, FP8)))
    assert f32(cache.values())[1, :, 1].max() == 0  # the invalid token is not written
    # the kernel's write (fused decode, one step at position 9 of sequence 0) lands where write_full puts it
    layer = params("nvfp4").layers[1]
    lengths = jnp.array([9, 3], jnp.int32)
    h = jax.random.normal(jax.random.key(50), (2, CFG.hidden_size)).astype(jnp.bfloat16)
    active = jnp.array([True, False])
    _, got = block_k(h, layer, cache, lengths, active, cfg=CFG, sliding=False, splits=1, min_chunk=64)
    _, ref = block_r(h, layer, cache, lengths, active, cfg=CFG, sliding=False)
    assert got.v.shape == cache.v.shape
    assert fp8_ulps(got.values(), ref.values()).max() <= 1
    changed = np.asarray(f32(got.values()) != f32(cache.values()))
    assert changed[0, :, 9].any() and not np.delete(changed[0], 9, axis=1).any() and not changed[1].any()
    with pytest.raises(ValueError, match=r"FP8_V_TRANSPOSED on, an FP8 full cache stores V transposed: "
                                         r"\[B, KV, D, S\]"):
        block_k(h, layer, FullCache(k=cache.k, v=cache.values()), lengths, active, cfg=CFG, sliding=False)


def test_ring_caches_must_stay_bf16():
    """kv_dtype applies to the full layers; an FP8 ring is refused with a message that says so."""
    layer = params("nvfp4").layers[0]
    ring = ring_cache(jax.random.key(3), [5, 9])
    ring = RingCache(k=ring.k.astype(FP8), v=ring.v.astype(FP8), pos=ring.pos)
    h = jnp.zeros((2, CFG.hidden_size), jnp.bfloat16)
    with pytest.raises(ValueError, match="ring caches hold BF16"):
        DA.attention_block_decode(h, layer, ring, jnp.array([6, 10]), jnp.array([True, True]), CFG, True,
                                  interpret=True)


def test_model_attention_block_signature():
    """The adapter with model.attention_block's signature equals model.attention_block for T = 1."""
    from flint_jax.model import attention_block
    layer = params("nvfp4").layers[0]
    cache = ring_cache(jax.random.key(11), [W - 1, 2 * W + 3])
    h = jax.random.normal(jax.random.key(12), (2, 1, CFG.hidden_size)).astype(jnp.bfloat16)
    pos = jnp.array([[W], [2 * W + 4]], jnp.int32)
    valid = jnp.ones((2, 1), bool)
    args = (h, layer, cache, pos, valid, pos[:, 0] + 1)
    got, got_cache = jax.jit(functools.partial(DA.model_attention_block, interpret=INTERPRET),
                             static_argnames=("cfg", "sliding"))(*args, cfg=CFG, sliding=True)
    ref, ref_cache = jax.jit(attention_block, static_argnames=("cfg", "sliding"))(*args, cfg=CFG, sliding=True)
    assert got.shape == ref.shape == h.shape
    assert_out_close(got, ref)
    np.testing.assert_array_equal(np.asarray(got_cache.pos), np.asarray(ref_cache.pos))


# ---- the GPU lowering, checked on the CPU ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernels_lower_to_triton_for_h200(lower_for_h200):
    """Every kernel of this issue lowers to Triton IR for CUDA (an H200 described abstractly, no GPU needed):
    catches ops the Triton lowering lacks, non-power-of-two tiles, and select/broadcast shape mismatches that
    interpret mode accepts. (Compiling that IR to PTX needs the device machine.)"""
    pos, active = jnp.array([3, 40], jnp.int32), jnp.array([True, False])
    h = jnp.zeros((2, CFG.hidden_size), jnp.bfloat16)
    q = jnp.zeros((2, CFG.num_attention_heads, CFG.head_dim), jnp.bfloat16)
    for weights in ("bf16", "nvfp4"):
        for sliding in (True, False):
            layer = params(weights).layers[0 if sliding else 1]
            cache = ring_cache(jax.random.key(0), [2, 39]) if sliding else full_cache(jax.random.key(0), 2)
            fns = [lambda c: DA.attention_block_decode(h, layer, c, pos, active, CFG, sliding, 1 if sliding else 4,
                                                       64)]
            if weights == "nvfp4":
                fns += [lambda c: AP.attention_prologue(h, layer.attn_norm, layer.attn, c, pos, active, CFG, sliding),
                        lambda c: DA.decode_attention(q, c, pos, layer.attn.sinks, CFG, sliding, active,
                                                      2 if sliding else 4)]
            caches = [cache] if sliding else [cache, full_cache_of(cache.k, cache.v, FP8)]
            for fn in fns:
                for c in caches:
                    text = jax.jit(fn).trace(c).lower(lowering_platforms=("cuda",)).as_text()
                    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("pv_mode,fp8_ptx,fp8_half", [("bf16x2", False, False), ("tf32", True, False),
                                                      ("bf16x2", True, False), ("tf32", True, True)])
def test_attention_knobs_lower_to_triton(monkeypatch, pv_mode, fp8_ptx, fp8_half, lower_for_h200):
    """The values dot's modes (PV_MODE), the FP8 tiles' PTX decode (FP8_PTX, off by default) and the FP16 dots on
    FP8 caches (FP8_HALF_SCORES / _VALUES) lower for the H200 too: a ring, and a full layer on an FP8 cache (its PTX
    in the IR where FP8_PTX and a dot still takes BF16 or FP32 tiles)."""
    monkeypatch.setattr(DA, "PV_MODE", pv_mode)
    monkeypatch.setattr(DA, "FP8_PTX", fp8_ptx)
    monkeypatch.setattr(DA, "FP8_HALF_SCORES", fp8_half)
    monkeypatch.setattr(DA, "FP8_HALF_VALUES", fp8_half)
    pos, active = jnp.array([3, 40], jnp.int32), jnp.array([True, False])
    h = jnp.zeros((2, CFG.hidden_size), jnp.bfloat16)
    full = full_cache(jax.random.key(0), 2)
    for sliding, cache in ((True, ring_cache(jax.random.key(0), [2, 39])),
                           (False, full_cache_of(full.k, full.v, FP8))):
        layer = params("nvfp4").layers[0 if sliding else 1]
        fn = lambda c: DA.attention_block_decode(h, layer, c, pos, active, CFG, sliding, 1 if sliding else 4, 64)
        text = jax.jit(fn).trace(cache).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
        if not sliding:
            assert (DA._BF16_2POW120 in text) == (fp8_ptx and not fp8_half)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("in_kernel,fold", [(True, 4), (True, 2), (False, 4)],
                         ids=["combine-in-kernel", "combine-in-kernel-folds-in-two-loads", "combine-kernel"])
def test_combine_modes(monkeypatch, in_kernel, fold, lower_for_h200):
    """Both ways of folding the split partials (the last-arriving split, `fold` splits per load, or the
    `combine` kernel) give the reference's results, and the lowering launches `combine` only in the second."""
    monkeypatch.setattr(DA, "COMBINE_IN_KERNEL", in_kernel)
    monkeypatch.setattr(DA, "FOLD_VALUES", fold * DA.pow2_rows(CFG.q_per_kv) * CFG.head_dim)
    attend = _jit(DA.decode_attention, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the flag
    check = functools.partial(check_attention, sink="large", sliding=False, splits=4, min_chunk=128)
    globals_attend = globals()["attend_k"]
    try:
        globals()["attend_k"] = attend
        check(full_cache(jax.random.key(6), len(FULL_POSITIONS)), FULL_POSITIONS)
    finally:
        globals()["attend_k"] = globals_attend
    layer = params("nvfp4").layers[1]
    h = jnp.zeros((2, CFG.hidden_size), jnp.bfloat16)
    fn = lambda c: DA.attention_block_decode(h, layer, c, jnp.array([3, 40]), jnp.array([True, True]), CFG,  # noqa
                                             False, 4, 64)
    text = jax.jit(fn).trace(full_cache(jax.random.key(0), 2)).lower(lowering_platforms=("cuda",)).as_text()
    assert ("decode_attention_combine" in text) != in_kernel


@pytest.mark.parametrize("weights,ring_splits,window,block_k,preload,fold_in_kernel", [
    ("bf16", 8, 200, 64, True, False), ("nvfp4", 8, 200, 64, True, False),
    ("nvfp4", 8, 200, 64, True, True),  # folded by the last-arriving split instead of `combine`
    ("nvfp4", 16, 200, 64, True, False), ("nvfp4", 16, 200, 64, True, True),
    ("nvfp4", 8, 200, 64, False, False),  # the loop over blocks
    ("bf16", 8, 131, 16, True, False),  # 8 blocks of 16 and 3 extra slots, read one by one by split 0
    ("bf16", 8, 131, 16, True, True),  # ... folded in the kernel
    ("nvfp4", 8, 137, 16, True, False),  # 9 extra slots: too many, so splits of 2 blocks and the loop
])
def test_attention_block_decode_split_ring(monkeypatch, weights, ring_splits, window, block_k, preload,
                                           fold_in_kernel):
    """A sliding layer whose ring is split over several programs (200 slots in chunks of 64: four hold keys, the
    rest fold as empty; or Flint's layout scaled down: a block per split plus a few extra slots), fused finish +
    write + attend, the splits folded by `combine` or in the kernel, two steps, against the reference."""
    monkeypatch.setattr(DA, "RING_SPLITS", ring_splits)
    monkeypatch.setattr(DA, "BLOCK_K", block_k)
    monkeypatch.setattr(DA, "RING_PRELOAD", preload)
    monkeypatch.setattr(DA, "COMBINE_IN_KERNEL", fold_in_kernel)
    chunk, extra, pre = DA.ring_geometry(window, ring_splits)
    assert pre == (preload and window != 137) and extra == (3 if window == 131 else 0)
    block_k = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace
    cfg = CFG.replace(sliding_window=window)
    layer = params(weights).layers[0]
    lengths = [0, 64, window - 1, window, 777]
    B = len(lengths)
    cache = cache_ref = ring_cache(jax.random.key(30), [n - 1 for n in lengths], cfg)
    pos = jnp.asarray(lengths, jnp.int32)
    for step in range(2):
        h = jax.random.normal(jax.random.key(31 + step), (B, cfg.hidden_size)).astype(jnp.bfloat16)
        active = jnp.array([True, True, step == 0, True, True])
        got, cache = block_k(h, layer, cache, pos, active, cfg=cfg, sliding=True)
        ref, cache_ref = block_r(h, layer, cache_ref, pos, active, cfg=cfg, sliding=True)
        assert_out_close(got, ref)
        assert_ulp_close(cache.k, cache_ref.k)
        np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(cache_ref.pos))
        pos = pos + active.astype(jnp.int32)


@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_rope_table_matches_in_kernel_rope(monkeypatch, weights):
    """Sliding layers with RoPE's cos/sin from the per-step XLA table (DA.ROPE_TABLE) against the in-kernel cos/sin
    and the reference, at positions whose angles need the large-argument range reduction (up to ~262K)."""
    layer = params(weights).layers[0]
    lengths = [0, 5, W + 3, 100_003, 262_000]
    B = len(lengths)
    cache = ring_cache(jax.random.key(50), [n - 1 for n in lengths])
    pos = jnp.asarray(lengths, jnp.int32)
    active = jnp.ones((B,), bool)
    h = jax.random.normal(jax.random.key(51), (B, CFG.hidden_size)).astype(jnp.bfloat16)
    table = AP.rope_cos_sin(pos, CFG)
    angles = np.asarray(pos, np.float64)[:, None] * np.asarray(AP.rope_tables(CFG), np.float64)[None, :]
    np.testing.assert_allclose(np.asarray(table[:, 0]), np.cos(angles), atol=2e-2)  # f32 angles: |err| ~ ulp(angle)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(DA, "ROPE_TABLE", on)
        run = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace per setting
        outs[on] = run(h, layer, jax.tree.map(jnp.copy, cache), pos, active, cfg=CFG, sliding=True)
    ref, ref_cache = block_r(h, layer, jax.tree.map(jnp.copy, cache), pos, active, cfg=CFG, sliding=True)
    for on in (False, True):
        got, got_cache = outs[on]
        assert_out_close(got, ref)
        assert_ulp_close(got_cache.k, ref_cache.k)
    if INTERPRET:  # the same XLA cos/sin either way on the CPU: the same bits
        np.testing.assert_array_equal(f32(outs[True][0]), f32(outs[False][0]))


@pytest.mark.parametrize("weights", ["nvfp4", "bf16"])
@pytest.mark.parametrize("B", [1, 2, 3, 4, 8])
def test_qkv_projection(weights, B):
    """The projection kernel alone (RMSNorm prologue + Q, K, V weights in one grid) against the reference."""
    layer = params(weights).layers[0]
    h = (3 * jax.random.normal(jax.random.key(40 + B), (B, CFG.hidden_size))).astype(jnp.bfloat16)
    got = qkv_k(h, layer.attn_norm, layer.attn, cfg=CFG)
    want = AP.ref_qkv_projection(h, layer.attn_norm, layer.attn, CFG)
    assert got.shape == (B, CFG.num_attention_heads + 2 * CFG.num_key_value_heads, CFG.head_dim)
    assert_ulp_close(got, want)


@pytest.mark.parametrize("weights", ["nvfp4", "bf16"])
def test_qkv_projection_four_rows_on_the_tensor_cores(weights, monkeypatch):
    """At 4 rows (QKV_DOT_MIN_ROWS) the projection runs on the tensor cores with x's rows repeated to the MMA's 8
    columns in the kernel: its rows are the bits of the same rows in an 8-row batch (the 8-row dot path), and
    within an ulp of the 4-row FMA path."""
    layer = params(weights).layers[0]
    h8 = (3 * jax.random.normal(jax.random.key(47), (8, CFG.hidden_size))).astype(jnp.bfloat16)
    run = jax.jit(lambda h: AP.qkv_projection(h, layer.attn_norm, layer.attn, CFG, interpret=INTERPRET))
    four = np.asarray(run(h8[:4]).astype(jnp.float32))
    eight = np.asarray(run(h8).astype(jnp.float32))
    np.testing.assert_array_equal(four, eight[:4])
    monkeypatch.setattr(AP, "QKV_DOT_MIN_ROWS", None)
    fma = jax.jit(lambda h: AP.qkv_projection(h, layer.attn_norm, layer.attn, CFG, interpret=INTERPRET))(h8[:4])
    assert_ulp_close(jnp.asarray(four).astype(jnp.bfloat16), fma)


def test_qkv_projection_load_order_knobs_keep_the_output_bits(monkeypatch):
    """The norm prologue after the first weight loads, the global scale before the K loop (weight_tiles knobs):
    the same bits as the old order."""
    from flint_jax.pallas_kernels import weight_tiles as wt
    layer = params("nvfp4").layers[0]
    h = (3 * jax.random.normal(jax.random.key(45), (1, CFG.hidden_size))).astype(jnp.bfloat16)
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(wt, "NORM_AFTER_LOADS", flag)
        monkeypatch.setattr(wt, "EARLY_EPILOGUE_LOADS", flag)
        outs.append(np.asarray(AP.qkv_projection(h, layer.attn_norm, layer.attn, CFG, interpret=INTERPRET)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("neutral", [True, False], ids=["neutral-partials", "partials-with-data-only"])
@pytest.mark.parametrize("splits,min_chunk", [(4, 128), (33, 64)])
def test_full_layer_splits_past_the_data(monkeypatch, neutral, splits, min_chunk):
    """Splits past a sequence's keys (and every split of the inactive sequence): with NEUTRAL_PARTIALS they store
    m = -inf, l = 0, acc = 0 and `combine` folds all of them; without, they store nothing and `combine` reads only
    the splits that hold data. Interpret mode fills unwritten outputs with NaN, so a split that neither stores nor
    is skipped would show here."""
    monkeypatch.setattr(DA, "NEUTRAL_PARTIALS", neutral)
    monkeypatch.setattr(DA, "COMBINE_IN_KERNEL", False)
    attend = _jit(DA.decode_attention, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the flag
    monkeypatch.setitem(globals(), "attend_k", attend)
    check_attention(full_cache(jax.random.key(6), len(FULL_POSITIONS)), FULL_POSITIONS, "large", sliding=False,
                    splits=splits, min_chunk=min_chunk)


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8", "fp8-v-transposed"])
def test_full_layer_first_block_preloaded(monkeypatch, cache_kind):
    """FULL_PRELOAD: each full-layer split loads its first key block before the query's prologue and its loop starts
    at the second block. Two fused decode steps (lengths 0, 63, 64, 190 in 4 splits of 64 keys: empty splits, a
    split ending mid-block; one sequence inactive) on BF16 and FP8 caches (V key-major and transposed, keys on M),
    and, on a BF16 cache, the unfused kernel at 4 and 33 splits with every sink, decode like the reference."""
    from flint_jax import state as ST
    monkeypatch.setattr(DA, "FULL_PRELOAD", True)
    monkeypatch.setattr(ST, "FP8_V_TRANSPOSED", cache_kind == "fp8-v-transposed")
    block = _jit(DA.attention_block_decode, "cfg", "sliding", "splits", "min_chunk")  # a fresh trace sees the knob
    layer, cache, lengths = block_case(False, seed=50, fp8=cache_kind != "bf16")
    check_two_decode_steps(block, layer, cache, lengths, False, seed=51, check_caches=cache_kind == "bf16")
    if cache_kind == "bf16":
        monkeypatch.setitem(globals(), "attend_k", _jit(DA.decode_attention, "cfg", "sliding", "splits", "min_chunk"))
        for splits, min_chunk in ((4, 64), (33, 64)):
            for sink in SINKS:
                check_attention(full_cache(jax.random.key(6), len(FULL_POSITIONS)), FULL_POSITIONS, sink,
                                sliding=False, splits=splits, min_chunk=min_chunk)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_full_layer_preload_lowers_to_triton(monkeypatch, lower_for_h200):
    """FULL_PRELOAD's kernels lower for the H200 (BF16 and FP8 full caches), and differ from the default's."""
    pos, active = jnp.array([3, 40], jnp.int32), jnp.array([True, False])
    h = jnp.zeros((2, CFG.hidden_size), jnp.bfloat16)
    full = full_cache(jax.random.key(0), 2)
    layer = params("nvfp4").layers[1]
    for cache in (full, full_cache_of(full.k, full.v, FP8)):
        texts = []
        for preload in (False, True):
            monkeypatch.setattr(DA, "FULL_PRELOAD", preload)
            fn = lambda c: DA.attention_block_decode(h, layer, c, pos, active, CFG, False, 4, 64)  # a fresh trace
            texts.append(jax.jit(fn).trace(cache).lower(lowering_platforms=("cuda",)).as_text())
            assert "__gpu$xla.gpu.triton" in texts[-1]
        assert texts[0] != texts[1]
