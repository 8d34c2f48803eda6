"""The two halves of a layer for a prefill chunk (T > 1 tokens), built from the prefill kernels.

    attention_block(h, layer, cache, positions, valid, lengths_after, cfg, sliding) -> (h, cache)
    mlp_block(h, layer, cfg) -> h

Same signatures and results as model.attention_block and layers.mlp_block (FLINT_SPEC section 2's rounding points):
    attention: rmsnorm, Q/K/V projections, head norms and RoPE as layers.project_qkv (XLA), then
               pallas_kernels.prefill_attention (sliding: the ring before the chunk + the chunk; full: the cache after
               writing the chunk, up to lengths_after), then Wo and the residual. The chunk's K/V are written with
               state.write_ring / state.write_full, exactly as the reference does.
    MoE:       rmsnorm, routing (pallas_kernels.router.top_k_experts, layers.route_from_logits' selection, on
               `router_logits_bf16x3`: FP32 logits from three exact BF16 parts of the router on the tensor cores),
               (token, slot) pairs sorted by expert, grouped_swiglu (gate and up fused, token rows gathered by index)
               and grouped_matmul (down, results scattered to their (token, slot) rows) over only the selected
               experts, the routing-weighted FP32 sum with the shared expert, rounded once. Dense layers (the first
               two) are layers.mlp_block: one GEMM each.

`interpret=None` picks Pallas interpret mode when JAX's default backend is the CPU. `blocks()` returns a
model.Blocks for model_step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flint_jax import layers as L
from flint_jax.config import FlintConfig
from flint_jax.layer_stack import materialize
from flint_jax.pallas_kernels import grouped_matmul as gm
from flint_jax.pallas_kernels import prefill_attention as pa
from flint_jax.pallas_kernels import router as R
from flint_jax.state import write_full, write_ring

F32, BF16 = jnp.float32, jnp.bfloat16


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else interpret


def attention_block(h: jax.Array, layer, cache, positions: jax.Array, valid: jax.Array, lengths_after: jax.Array,
                    cfg: FlintConfig, sliding: bool, *, interpret: bool | None = None,
                    block: pa.Block | None = None):
    """`h + Wo(attention(rmsnorm(h)))` for a chunk h [B, T, H] at `positions` [B, T] (rows' valid tokens first),
    reading and updating the layer's cache. Returns (h, cache)."""
    interpret = _interpret(interpret)
    layer, cache = materialize(layer), materialize(cache)
    B, T, _ = h.shape
    a = L.rmsnorm(h, layer.attn_norm, cfg.rms_norm_eps)
    q, k, v = L.project_qkv(a, layer.attn, positions, cfg, sliding)
    q_pos = jnp.where(valid, positions, -1)
    if sliding:
        o = pa.ring_attention(q, k, v, q_pos, cache, layer.attn.sinks, cfg.sliding_window, interpret=interpret,
                              block=block)
        cache = write_ring(cache, k, v, positions, valid)
    else:
        cache = write_full(cache, k, v, positions, valid)
        o = pa.full_attention(q, q_pos, cache, lengths_after, layer.attn.sinks, interpret=interpret, block=block)
    return h + L.linear(o.reshape(B, T, -1), layer.attn.o), cache


def routed_experts(b: jax.Array, moe, ids: jax.Array, num_experts: int, *, interpret: bool = False,
                   blocks: tuple[gm.Block | None, gm.Block | None] = (None, None),
                   reference: bool = False) -> jax.Array:
    """layers.routed_experts_grouped on the grouped kernels. b [N, H], ids [N, K] -> expert outputs [N, K, H] BF16.
    reference=True runs the same steps with the kernels' plain-JAX references (usable on the GPU at 8K tokens)."""
    N, K = ids.shape
    flat = ids.reshape(-1)
    order, sizes = L.sort_pairs_by_expert(flat, num_experts)  # sorted position -> (token, slot) pair
    swiglu_fn, matmul_fn = ((gm.ref_grouped_swiglu, gm.ref_grouped_matmul) if reference
                            else (gm.grouped_swiglu, gm.grouped_matmul))
    # The gate/up kernel reads each pair's token row by index and the down kernel stores each result at its pair's
    # row: no gathered copy of the activations ([N*K, H]) and no un-permuting gather of the outputs.
    act = swiglu_fn(b, moe.gate, moe.up, sizes, interpret=interpret, block=blocks[0], rows=order // K)
    y = matmul_fn(act, moe.down, sizes, interpret=interpret, block=blocks[1], out_rows=order, out_size=N * K)
    return y.reshape(N, K, -1)


def split_bf16x3(w: jax.Array) -> jax.Array:
    """FP32 w [..., E, H] -> BF16 [..., 3, E, H] with hi + mid + lo == w exactly (24 significant bits in three
    8-bit parts; each remainder is exact in FP32) for every w above 2^-100 or so in magnitude (router weights are)."""
    w = w.astype(F32)
    hi = w.astype(BF16)
    r = w - hi.astype(F32)
    mid = r.astype(BF16)
    lo = (r - mid.astype(F32)).astype(BF16)
    return jnp.stack([hi, mid, lo], axis=-3)


def router_logits_bf16x3(b: jax.Array, router: jax.Array) -> jax.Array:
    """FP32 router logits [N, E] for BF16 activations b [N, H] on the tensor cores: the FP32 router weights in three
    exact BF16 parts, one BF16 GEMM against all three with FP32 accumulation (each product exact), the three partial
    logits added in FP32. layers.router_logits (FP32 einsum) rounds each product instead and sums in another order: the two
    agree to FP32 rounding (a few ulps of the logit). On the H200 that einsum is an FP32 SIMT GEMM: 8.5 ms of the
    8K prefill (run Y, docs/BENCHMARKS.md)."""
    E, H = router.shape
    parts = split_bf16x3(router).reshape(3 * E, H)
    out = jnp.einsum("nh,eh->ne", b.astype(BF16), parts, preferred_element_type=F32)
    return (out[:, :E] + out[:, E:2 * E]) + out[:, 2 * E:]


# Top-k selection in router.top_k_experts (True) or XLA's lax.top_k (False: a full sort of each token's 256 scores,
# 3.2 ms per 8K prefill on the H200, run AD).
ROUTE_KERNEL = True


def moe_mlp(b: jax.Array, moe, cfg: FlintConfig, *, interpret: bool = False,
            blocks: tuple[gm.Block | None, gm.Block | None] = (None, None), reference: bool = False) -> jax.Array:
    """layers.moe_mlp with the routed experts on the grouped kernels. b [..., H] -> [..., H] BF16."""
    lead = b.shape[:-1]
    flat = b.reshape(-1, b.shape[-1])
    if reference:
        ids, w = L.route(flat, moe.router, moe.router_bias, cfg)
    elif not ROUTE_KERNEL:
        ids, w = L.route_from_logits(router_logits_bf16x3(flat, moe.router), moe.router_bias, cfg)
    else:
        # The sigmoid in XLA as layers.route_from_logits computes it, the selection in the kernel (see top_k_experts).
        scores = jax.nn.sigmoid(router_logits_bf16x3(flat, moe.router))
        ids, w = R.top_k_experts(scores, moe.router_bias, cfg, interpret=interpret, rows=R.PREFILL_ROWS,
                                 scores_given=True)
    outs = routed_experts(flat, moe, ids, cfg.n_routed_experts, interpret=interpret, blocks=blocks,
                          reference=reference)
    y = jnp.einsum("nk,nkh->nh", w, outs.astype(F32))
    if moe.shared_gate is not None:
        shared = L.linear(L.swiglu(L.linear(flat, moe.shared_gate), L.linear(flat, moe.shared_up)), moe.shared_down)
        y = y + shared.astype(F32)
    return y.astype(BF16).reshape(*lead, -1)


def mlp_block(h: jax.Array, layer, cfg: FlintConfig, *, interpret: bool | None = None,
              blocks: tuple[gm.Block | None, gm.Block | None] = (None, None), reference: bool = False) -> jax.Array:
    """Post-attention half of a layer: `h + mlp(rmsnorm(h))`, the sum rounded to BF16. `blocks`: (gate/up, down)
    tile sizes of the grouped kernels (None: the table's)."""
    if not hasattr(layer.mlp, "router"):
        return L.mlp_block(h, materialize(layer), cfg)
    # The routed experts' weights stay LayerSlices where the layers are stacked: the grouped kernels index the stacks
    # (no per-layer copy of all 256 experts); XLA's ops get arrays.
    routed = layer.mlp
    layer = materialize(layer)
    moe = layer.mlp if reference else dataclasses.replace(layer.mlp, gate=routed.gate, up=routed.up, down=routed.down)
    b = L.rmsnorm(h, layer.mlp_norm, cfg.rms_norm_eps)
    return h + moe_mlp(b, moe, cfg, interpret=_interpret(interpret), blocks=blocks, reference=reference)


def blocks():
    """model.Blocks with the prefill halves (for model_step with T > 1)."""
    from flint_jax.model import Blocks
    return Blocks(attention_block, mlp_block, takes_layer_slices=True)
