"""Decode attention prologue: input RMSNorm + QKV projection, then per-head Q/K RMSNorm, RoPE and the KV write.

Two kernels (Pallas, Triton lowering; docs/KERNELS.md "Attention kernels (issue 5)" says why):

* `qkv_projection` -- `rmsnorm(h) @ [Wq; Wk; Wv].T` for B = 1..8 rows in one launch, BF16 or NVFP4 weights.
  The grid runs over blocks of `BLOCK_N` output rows of the three weights, so a Flint layer gets 160 programs
  (one program per head would use only 40 of the H200's 132 SMs, and NVFP4 decoding costs ALU work per value).
  Each program recomputes the input RMSNorm of the (at most 8) rows it needs; the result is rounded to BF16
  exactly where `layers.linear` rounds, so it is the raw `[B, Hq + 2*KV, D]` Q/K/V before the head norms.
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

from flint_jax import layers as L
from flint_jax.config import FlintConfig
from flint_jax.nvfp4 import BLOCK as NVFP4_BLOCK
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.state import FullCache, RingCache, write_full, write_ring

F32, BF16 = jnp.float32, jnp.bfloat16

ROWS = 16  # batch rows padded to the smallest tensor-core M tile; B <= 8 rows are real
# Projection blocks. Not yet tuned on the GPU (docs/KERNELS.md): fewer, larger K steps because issue 4 measured
# small-grid GEMVs to be latency-bound per loop step; 8 warps to spread the NVFP4 decode's registers.
BLOCK_N = 32  # output rows (of Wq/Wk/Wv) per program: 160 programs for Flint
BLOCK_K_BF16 = 512  # input columns per step, BF16 weights
BLOCK_K_NVFP4 = 512  # input columns per step, NVFP4 weights (256 code bytes: 256 low + 256 high nibbles)
NORM_BLOCK = 1024  # input columns per step of the RMSNorm statistics pass
QKV_WARPS, QKV_STAGES = 8, 3
# E4M3 scales reach the kernel as float8 and are bitcast to bytes in-kernel (XLA never copies them). If a Triton
# build rejects float8 loads, set this to True: XLA then bitcasts to uint8 outside (issue 4's GEMV does that).
SCALES_BITCAST_IN_XLA = False


def _params(num_warps: int = 4, num_stages: int = 3):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# ---- NVFP4 decoding with integer arithmetic (Triton has no FP4 type; no FP8 cast needed either) ----------------

def _e4m3_bits_to_f32(u: jax.Array) -> jax.Array:
    """E4M3 scale bytes (int32 0..255; bit 7, the sign, ignored: scales are positive) -> f32, exactly."""
    u = u & 0x7F
    e, m = u >> 3, u & 7
    pow2 = jax.lax.bitcast_convert_type(jnp.where(e == 0, 118, e + 117) << 23, F32)  # 2^-9 or 2^(e-10)
    return jnp.where(e == 0, m, m + 8).astype(F32) * pow2


def _e2m1_to_f32(c: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (int32 0..15) -> f32 values, by building the f32 bit pattern."""
    mag = c & 7
    bits = (mag << 22) + 0x3F000000  # exponent e + 126, mantissa bit m: (1 + m/2) * 2^(e-1)
    bits = jnp.where(mag < 2, mag * 0x3F000000, bits)  # e = 0: 0 or 0.5 (0x3F000000 is 0.5f)
    bits = bits | ((c & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, F32)


def _scale_bytes(s: jax.Array) -> jax.Array:
    """E4M3 scales as loaded (float8_e4m3fn, or uint8 with SCALES_BITCAST_IN_XLA) -> their bytes as int32."""
    if s.dtype != jnp.uint8:
        s = jax.lax.bitcast_convert_type(s, jnp.uint8)
    return s.astype(jnp.int32)


def _expand_scales(s: jax.Array, n: int) -> jax.Array:
    """[R, n / 16] f32 scales -> [R, n], each repeated over its 16 values."""
    r = s.shape[0]
    return jnp.broadcast_to(s[:, :, None], (r, n // NVFP4_BLOCK, NVFP4_BLOCK)).reshape(r, n)


# ---- kernel 1: input RMSNorm + QKV projection ----------------------------------------------------------------

def _qkv_kernel(h_ref, norm_ref, *refs, B, H, eps, kinds, row_blocks, col0, block_k, norm_block):
    """Program j computes BLOCK_N output columns of one of Q, K, V for all B rows."""
    out_ref = refs[-1]
    wrefs = refs[:-1]
    j = pl.program_id(0)
    rows = jnp.arange(ROWS)
    rmask = (rows < B)[:, None]

    def ss_body(i, ss):
        x = plgpu.load(h_ref.at[pl.ds(0, ROWS), pl.ds(i * norm_block, norm_block)], mask=rmask, other=0).astype(F32)
        return ss + jnp.sum(x * x, axis=1)

    ss = jax.lax.fori_loop(0, H // norm_block, ss_body, jnp.zeros((ROWS,), F32))
    inv_rms = jax.lax.rsqrt(ss / H + eps)[:, None]

    def normed(start, n):
        x = plgpu.load(h_ref.at[pl.ds(0, ROWS), pl.ds(start, n)], mask=rmask, other=0).astype(F32)
        w = norm_ref[pl.ds(start, n)].astype(F32)
        return (w[None, :] * (x * inv_rms).astype(BF16).astype(F32)).astype(BF16)

    k = 0
    for which, kind in enumerate(kinds):
        lo, hi = row_blocks[which]
        n_refs = 1 if kind == "bf16" else 3
        refs_w, k = wrefs[k:k + n_refs], k + n_refs

        # pl.when traces its body at once, so the loop variables are bound correctly.
        @pl.when((j >= lo) & (j < hi))
        def _():
            r0 = (j - lo) * BLOCK_N
            if kind == "bf16":
                (w_ref,) = refs_w

                def body(i, acc):
                    a = normed(i * block_k, block_k)
                    w = w_ref[pl.ds(r0, BLOCK_N), pl.ds(i * block_k, block_k)]
                    return acc + plgpu.dot(a, w, trans_b=True)

                acc = jax.lax.fori_loop(0, H // block_k, body, jnp.zeros((ROWS, BLOCK_N), F32))
            else:
                c_ref, s_ref, g_ref = refs_w
                nb = block_k // 2  # code bytes per step; low nibbles are columns [c, c+nb), high [H/2+c, ...)
                ns = nb // NVFP4_BLOCK
                half = H // 2

                def body(i, acc):
                    c0 = i * nb
                    codes = c_ref[pl.ds(r0, BLOCK_N), pl.ds(c0, nb)].astype(jnp.int32)
                    s_lo = _scale_bytes(s_ref[pl.ds(r0, BLOCK_N), pl.ds(i * ns, ns)])
                    s_hi = _scale_bytes(s_ref[pl.ds(r0, BLOCK_N), pl.ds(half // NVFP4_BLOCK + i * ns, ns)])
                    w_lo = (_e2m1_to_f32(codes & 15) * _expand_scales(_e4m3_bits_to_f32(s_lo), nb)).astype(BF16)
                    w_hi = (_e2m1_to_f32(codes >> 4) * _expand_scales(_e4m3_bits_to_f32(s_hi), nb)).astype(BF16)
                    acc = acc + plgpu.dot(normed(c0, nb), w_lo, trans_b=True)
                    return acc + plgpu.dot(normed(half + c0, nb), w_hi, trans_b=True)

                acc = jax.lax.fori_loop(0, H // block_k, body, jnp.zeros((ROWS, BLOCK_N), F32))
                acc = acc * g_ref[0]
            plgpu.store(out_ref.at[pl.ds(0, ROWS), pl.ds(col0[which] + r0, BLOCK_N)], acc.astype(BF16),
                        mask=rmask)


def _weight_args(w):
    if isinstance(w, NVFP4Weight):
        scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8) if SCALES_BITCAST_IN_XLA else w.scales
        return "nvfp4", [w.codes, scales, jnp.reshape(w.global_scale, (1,)).astype(F32)]
    return "bf16", [w]


def qkv_projection(h: jax.Array, attn_norm: jax.Array, attn, cfg: FlintConfig, interpret: bool = False) -> jax.Array:
    """`linear(rmsnorm(h), W)` for W in (q, k, v), in one kernel. h [B, H] bf16 -> [B, Hq + 2*KV, D] bf16
    (Q heads, then K heads, then V heads), each rounded to BF16 like `layers.linear`."""
    B, H = h.shape
    Hq, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if not 1 <= B <= 8:
        raise ValueError(f"qkv_projection: batch must be 1..8, got {B}")
    if H != cfg.hidden_size:
        raise ValueError(f"qkv_projection: h has {H} features, config says {cfg.hidden_size}")
    kinds, args, row_blocks, col0 = [], [], [], []
    blocks = 0
    for w, n in ((attn.q, Hq * D), (attn.k, KV * D), (attn.v, KV * D)):
        if tuple(w.shape) != (n, H):
            raise ValueError(f"qkv_projection: weight shape {tuple(w.shape)}, expected {(n, H)}")
        if n % BLOCK_N:
            raise ValueError(f"qkv_projection: {n} output rows is not a multiple of {BLOCK_N}")
        kind, a = _weight_args(w)
        kinds.append(kind)
        args += a
        row_blocks.append((blocks, blocks + n // BLOCK_N))
        col0.append(blocks * BLOCK_N)
        blocks += n // BLOCK_N
    block_k = BLOCK_K_BF16 if kinds[0] == "bf16" else BLOCK_K_NVFP4
    block_k = min(block_k, H)
    if H % block_k:
        raise ValueError(f"qkv_projection: hidden size {H} is not a multiple of {block_k}")
    norm_block = min(NORM_BLOCK, H)
    if H % norm_block:
        raise ValueError(f"qkv_projection: hidden size {H} is not a multiple of {norm_block}")
    kernel = functools.partial(_qkv_kernel, B=B, H=H, eps=cfg.rms_norm_eps, kinds=tuple(kinds),
                               row_blocks=tuple(row_blocks), col0=tuple(col0), block_k=block_k,
                               norm_block=norm_block)
    out = pl.pallas_call(
        kernel, grid=(blocks,), out_shape=jax.ShapeDtypeStruct((B, (Hq + 2 * KV) * D), BF16),
        compiler_params=_params(num_warps=QKV_WARPS, num_stages=QKV_STAGES), interpret=interpret,
        name="qkv_projection",
    )(h, attn_norm, *args)
    return out.reshape(B, Hq + 2 * KV, D)


# ---- the per-head finishing step, shared with the attention kernel ------------------------------------------------

def rope_tables(cfg: FlintConfig) -> jax.Array:
    """inv_freq [D/2] f32, by the same expression as `layers.rope`."""
    d = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=F32) / d))


def finish_heads(x1, x2, w_ref, inv_freq_ref, pos, *, eps: float, sliding: bool):
    """Per-head RMSNorm (+ RoPE on sliding layers) of heads given as halves x1, x2 [R, D/2] bf16 (the two halves
    make rotate-half RoPE a pair of elementwise ops). Returns the finished halves, bf16."""
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
    ang = pos.astype(F32) * inv_freq_ref[...]  # [D/2]
    c, s = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
    y1f, y2f = y1.astype(F32), y2.astype(F32)
    return (y1f * c - y2f * s).astype(BF16), (y2f * c + y1f * s).astype(BF16)


def load_raw_heads(qkv_ref, b, kv, *, Hq: int, KV: int, G: int, D: int):
    """From the raw projection [B, Hq+2KV, D]: the G query heads of KV head kv (rows padded to ROWS, halves),
    and that KV head's k (halves, [1, D/2]) and v ([D])."""
    dh = D // 2
    gmask = (jnp.arange(ROWS) < G)[:, None]
    q1 = plgpu.load(qkv_ref.at[b, pl.ds(kv * G, ROWS), pl.ds(0, dh)], mask=gmask, other=0)
    q2 = plgpu.load(qkv_ref.at[b, pl.ds(kv * G, ROWS), pl.ds(dh, dh)], mask=gmask, other=0)
    k1 = qkv_ref[b, pl.ds(Hq + kv, 1), pl.ds(0, dh)]
    k2 = qkv_ref[b, pl.ds(Hq + kv, 1), pl.ds(dh, dh)]
    v = qkv_ref[b, Hq + KV + kv, :]
    return q1, q2, k1, k2, v


def store_kv(k1, k2, v, k_out, v_out, pos_out, b, kv, p, *, ring: bool, window: int):
    """Write one token's K (halves [1, D/2]) and V [D] at position p into the cache (ring slot p % W)."""
    dh = k1.shape[-1]
    slot = jax.lax.rem(p, window) if ring else p
    k_out[b, kv, pl.ds(slot, 1), pl.ds(0, dh)] = k1
    k_out[b, kv, pl.ds(slot, 1), pl.ds(dh, dh)] = k2
    v_out[b, kv, slot, :] = v
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
    if cache.k.shape[:2] != (B, KV) or cache.k.shape[3] != D or cache.v.shape != cache.k.shape:
        raise ValueError(f"cache k/v shape {cache.k.shape}/{cache.v.shape} does not fit batch {B}, KV {KV}, D {D}")
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
    outs = pl.pallas_call(
        kernel, grid=(B, KV), out_shape=out_shape,
        input_output_aliases={n_in + i: 1 + i for i in range(len(cache_in))},
        compiler_params=_params(num_warps=4, num_stages=1), interpret=interpret, name="attention_finish_qk",
    )(qkv, attn.q_norm, attn.k_norm, rope_tables(cfg), positions.astype(jnp.int32),
      active.astype(jnp.int32), *cache_in)
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
