"""Reference math of a Flint layer in plain JAX, with FLINT_SPEC section 2's rounding points.

This is the oracle (`impl="xla"`): every Pallas kernel has a `ref_*` built from these functions and is tested
against them. Shapes: B batch, T tokens, S keys, H hidden, Hq query heads, KV key/value heads, D head_dim,
E experts, I expert intermediate, K top-k.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flint_jax import nvfp4
from flint_jax.config import FlintConfig
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.nvfp4_tiles import NVFP4Tiles, unpack
from flint_jax.params import Linear

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST  # FP32 router logits: no TF32 shortcut on the GPU


def rmsnorm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """`w * bf16(x_f32 * rsqrt(mean(x_f32^2) + eps))` over the last axis; BF16 out."""
    xf = x.astype(F32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(BF16) * normed.astype(BF16)


def weight_values(w: Linear) -> jax.Array:
    """BF16 values of a linear weight (NVFP4 dequantizes exactly), without its global scale."""
    return nvfp4.dequantize(w) if isinstance(w, NVFP4Weight) else w


def linear(x: jax.Array, w: Linear) -> jax.Array:
    """`bf16(f32acc(x @ W.T) * global_scale)`; x [..., K] bf16, W [N, K]."""
    acc = jnp.einsum("...k,nk->...n", x.astype(BF16), weight_values(w), preferred_element_type=F32)
    if isinstance(w, NVFP4Weight):
        acc = acc * w.global_scale
    return acc.astype(BF16)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half (NeoX/HF) RoPE over the whole head_dim at absolute positions.
    x [B, T, N, D] bf16, positions [B, T]. Computed in FP32, rounded to BF16 once."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=F32) / d))  # [D/2]
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(F32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(BF16)


def project_qkv(a: jax.Array, attn, positions: jax.Array, cfg: FlintConfig, sliding: bool):
    """Q, K, V for normed input a [B, T, H]: projections, per-head Q/K RMSNorm, RoPE on sliding layers only.
    Returns q [B, T, Hq, D], k and v [B, T, KV, D], all BF16."""
    B, T, _ = a.shape
    D = cfg.head_dim
    q = linear(a, attn.q).reshape(B, T, cfg.num_attention_heads, D)
    k = linear(a, attn.k).reshape(B, T, cfg.num_key_value_heads, D)
    v = linear(a, attn.v).reshape(B, T, cfg.num_key_value_heads, D)
    q = rmsnorm(q, attn.q_norm, cfg.rms_norm_eps)
    k = rmsnorm(k, attn.k_norm, cfg.rms_norm_eps)
    if sliding:
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
    return q, k, v


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """Which keys each query may read. q_pos [B, T], k_pos [B, S] (-1 = empty slot) -> [B, T, S] bool.
    Causal; on a sliding layer also `q_pos - k_pos < window` (the window counts the query itself)."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    ok = (kp >= 0) & (kp <= qp)
    if window is not None:
        ok &= (qp - kp) < window
    return ok


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sinks: jax.Array) -> jax.Array:
    """Softmax attention with a learned sink logit per query head (the sink takes probability, gives no value).
    q [B, T, Hq, D], k/v [B, KV, S, D] (cache layout; BF16 or FP8), mask [B, T, S], sinks [Hq] -> o [B, T, Hq, D] BF16.
    Query head j reads KV head j // (Hq / KV). Scores, softmax and the value sum are FP32."""
    B, T, Hq, D = q.shape
    KV = k.shape[1]
    qg = q.reshape(B, T, KV, Hq // KV, D)
    k = k.astype(q.dtype)  # an FP8 cache (state.KV_DTYPES): exact in BF16
    s = jnp.einsum("btgjd,bgsd->bgjts", qg, k, preferred_element_type=F32) / math.sqrt(D)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)  # [B, KV, G, T, S]
    sink = sinks.astype(F32).reshape(1, KV, Hq // KV, 1)
    m = jnp.maximum(jnp.max(s, axis=-1), sink)  # [B, KV, G, T]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no key and a -inf sink: keep it finite
    p = jnp.exp(s - m[..., None])
    denom = jnp.exp(sink - m) + jnp.sum(p, axis=-1)
    o = jnp.einsum("bgjts,bgsd->btgjd", p, v.astype(F32), preferred_element_type=F32)
    o = o / jnp.moveaxis(denom, -1, 1)[..., None]
    return o.reshape(B, T, Hq, D).astype(BF16)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`bf16(bf16(silu(gate)) * up)` from BF16 gate and up."""
    return (jax.nn.silu(gate.astype(F32)).astype(BF16).astype(F32) * up.astype(F32)).astype(BF16)


def dense_mlp(b: jax.Array, mlp) -> jax.Array:
    return linear(swiglu(linear(b, mlp.gate), linear(b, mlp.up)), mlp.down)


def route(b: jax.Array, router: jax.Array, bias: jax.Array, cfg: FlintConfig):
    """Sigmoid top-k routing. b [..., H] bf16 -> (expert ids [..., K] int32, weights [..., K] f32).
    Selection by score + correction bias, ties to the lower expert index; weights from the unbiased score,
    normalised to sum 1 when norm_topk_prob, then times routed_scaling_factor."""
    return route_from_logits(router_logits(b, router), bias, cfg)


def router_logits(b: jax.Array, router: jax.Array) -> jax.Array:
    """FP32 router logits [..., E] = b @ router.T at full FP32 precision (FLINT_SPEC: the router is FP32)."""
    return jnp.einsum("...h,eh->...e", b.astype(F32), router.astype(F32), precision=HIGHEST)


def route_from_logits(logits: jax.Array, bias: jax.Array, cfg: FlintConfig):
    """`route` given the FP32 router logits [..., E]."""
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(scores + bias.astype(F32), cfg.num_experts_per_tok)  # stable: ties -> lower index
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), w * cfg.routed_scaling_factor


def _take_expert(w: Linear, ids: jax.Array) -> Linear:
    """The weights of experts `ids` (any shape) from a stacked [E, N, K] weight."""
    return jax.tree.map(lambda a: a[ids], w)


def _expert_linear(x: jax.Array, w: Linear) -> jax.Array:
    """x [N_tok, K_in] against gathered per-row weights [N_tok, N, K_in] -> [N_tok, N] BF16."""
    acc = jnp.einsum("tk,tnk->tn", x.astype(BF16), weight_values(w), preferred_element_type=F32)
    if isinstance(w, NVFP4Weight):
        acc = acc * w.global_scale[:, None]
    return acc.astype(BF16)


def routed_experts_gathered(b: jax.Array, moe, ids: jax.Array) -> jax.Array:
    """Each (token, slot) pair runs its own expert by gathering that expert's weights: right for decode, where
    the tokens are few. b [N, H], ids [N, K] -> expert outputs [N, K, H] BF16."""
    N, K = ids.shape
    flat = ids.reshape(-1)
    x = jnp.repeat(b, K, axis=0)
    h = swiglu(_expert_linear(x, _take_expert(moe.gate, flat)), _expert_linear(x, _take_expert(moe.up, flat)))
    return _expert_linear(h, _take_expert(moe.down, flat)).reshape(N, K, -1)


def _grouped_linear(x: jax.Array, w: Linear, group_sizes: jax.Array, expert_of_row: jax.Array) -> jax.Array:
    """Rows sorted by expert against stacked weights [E, N, K]: x [R, K] -> [R, N] BF16 via ragged_dot."""
    rhs = jnp.swapaxes(weight_values(w), 1, 2)  # [E, K, N]
    acc = jax.lax.ragged_dot(x.astype(BF16), rhs, group_sizes, preferred_element_type=F32)
    if isinstance(w, NVFP4Weight):
        acc = acc * w.global_scale[expert_of_row][:, None]
    return acc.astype(BF16)


def sort_pairs_by_expert(flat: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, sizes) for expert ids flat [P]: order [P] int32 the stable argsort of flat (sorted position -> pair;
    XLA on the GPU runs it as a cub radix sort), sizes [num_experts] int32 the pairs per expert, as a
    compare-and-sum: one fused reduction, where bincount was a scatter-add (0.7 ms per 8K prefill on the H200,
    run AD in docs/BENCHMARKS.md). The sort keys are the narrowest unsigned type that holds the ids (uint8 for
    256 experts): a radix sort runs one pass per key byte, so int32 keys cost four where one does."""
    key_dtype = jnp.uint8 if num_experts <= 1 << 8 else jnp.uint16 if num_experts <= 1 << 16 else flat.dtype
    order = jnp.argsort(flat.astype(key_dtype), stable=True).astype(jnp.int32)
    sizes = jnp.sum(flat[None, :] == jnp.arange(num_experts, dtype=flat.dtype)[:, None], axis=1, dtype=jnp.int32)
    return order, sizes


def routed_experts_grouped(b: jax.Array, moe, ids: jax.Array, num_experts: int) -> jax.Array:
    """The same function as `routed_experts_gathered`, for many tokens: (token, slot) pairs sorted by expert and
    run as grouped matmuls, so no expert's weights are copied per token. b [N, H], ids [N, K] -> [N, K, H]."""
    N, K = ids.shape
    flat = ids.reshape(-1)
    order, sizes = sort_pairs_by_expert(flat, num_experts)
    sorted_ids = flat[order]
    x = b[order // K]
    h = swiglu(_grouped_linear(x, moe.gate, sizes, sorted_ids), _grouped_linear(x, moe.up, sizes, sorted_ids))
    y = _grouped_linear(h, moe.down, sizes, sorted_ids)
    return jnp.zeros_like(y).at[order].set(y).reshape(N, K, -1)


def moe_mlp(b: jax.Array, moe, cfg: FlintConfig) -> jax.Array:
    """`bf16(shared(b) + sum_k w_k * expert_k(b))`, summed in FP32. b [..., H] -> [..., H] BF16."""
    lead = b.shape[:-1]
    flat = b.reshape(-1, b.shape[-1])
    ids, w = route(flat, moe.router, moe.router_bias, cfg)
    if flat.shape[0] * cfg.num_experts_per_tok <= cfg.n_routed_experts:
        outs = routed_experts_gathered(flat, moe, ids)
    else:
        outs = routed_experts_grouped(flat, moe, ids, cfg.n_routed_experts)
    y = jnp.einsum("nk,nkh->nh", w, outs.astype(F32))
    if moe.shared_gate is not None:
        shared = linear(swiglu(linear(flat, moe.shared_gate), linear(flat, moe.shared_up)), moe.shared_down)
        y = y + shared.astype(F32)
    return y.astype(BF16).reshape(*lead, -1)


def mlp_block(h: jax.Array, layer, cfg: FlintConfig) -> jax.Array:
    """Post-attention half of a layer: `h + mlp(rmsnorm(h))`, the sum rounded to BF16."""
    b = rmsnorm(h, layer.mlp_norm, cfg.rms_norm_eps)
    y = dense_mlp(b, layer.mlp) if not hasattr(layer.mlp, "router") else moe_mlp(b, layer.mlp, cfg)
    return h + y


def logits_from_hidden(h: jax.Array, final_norm: jax.Array, lm_head: Linear, eps: float) -> jax.Array:
    """FP32 logits: `rmsnorm(h) @ W_lm.T` with an FP32 accumulator (not rounded to BF16)."""
    if isinstance(lm_head, NVFP4Tiles):  # the Pallas path's tiled head (pallas_path.engine_layout), read back
        lm_head = unpack(lm_head)
    x = rmsnorm(h, final_norm, eps)
    acc = jnp.einsum("...k,nk->...n", x, weight_values(lm_head), preferred_element_type=F32)
    if isinstance(lm_head, NVFP4Weight):
        acc = acc * lm_head.global_scale
    return acc
