"""Flint parameters as an explicit pytree, described once.

`describe(cfg, weights)` returns the parameter tree with a `Leaf` (shape, dtype, init) at every position. From that one
description come the abstract tree (`abstract_params`, no allocation), a random init (`init_params`) and the parameter
counts (`param_count`). Linear weights are `[out, in]` like torch, either a BF16 array or an `NVFP4Weight`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Union

import jax
import jax.numpy as jnp

from flint_jax import nvfp4
from flint_jax.config import FlintConfig
from flint_jax.nvfp4 import NVFP4Weight

Linear = Union[jax.Array, NVFP4Weight]
WeightFormat = Literal["bf16", "nvfp4"]


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class Attention:
    q: Linear  # [Hq*D, H]
    k: Linear  # [KV*D, H]
    v: Linear  # [KV*D, H]
    o: Linear  # [H, Hq*D]
    q_norm: jax.Array  # [D] bf16
    k_norm: jax.Array  # [D] bf16
    sinks: jax.Array  # [Hq] f32, learned sink logit per query head


@_pytree
class DenseMLP:
    gate: Linear  # [I, H]
    up: Linear  # [I, H]
    down: Linear  # [H, I]


@_pytree
class MoE:
    router: jax.Array  # [E, H] f32
    router_bias: jax.Array  # [E] f32 (e_score_correction_bias; zeros when the checkpoint has none)
    gate: Linear  # [E, I, H]
    up: Linear  # [E, I, H]
    down: Linear  # [E, H, I]
    shared_gate: Linear | None  # [Is, H]
    shared_up: Linear | None  # [Is, H]
    shared_down: Linear | None  # [H, Is]


@_pytree
class Layer:
    attn_norm: jax.Array  # [H] bf16 (input_layernorm)
    attn: Attention
    mlp_norm: jax.Array  # [H] bf16 (post_attention_layernorm)
    mlp: DenseMLP | MoE


@_pytree
class Params:
    embed: jax.Array  # [V, H] bf16
    layers: tuple[Layer, ...]
    final_norm: jax.Array  # [H] bf16
    lm_head: Linear  # [V, H]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter's description. `kind` picks the initializer: linear, norm, sink, router, bias."""
    shape: tuple[int, ...]
    kind: str
    quantized: bool = False  # an NVFP4 linear weight

    @property
    def dtype(self):
        return {"router": jnp.float32, "bias": jnp.float32, "sink": jnp.float32}.get(self.kind, jnp.bfloat16)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def describe(cfg: FlintConfig, weights: WeightFormat = "bf16") -> Params:
    """The parameter tree with a `Leaf` at every position. With `weights="nvfp4"` every linear layer (attention,
    MLPs, experts, LM head) is NVFP4; the embedding, norms, sinks and router stay in their own dtypes."""
    if weights not in ("bf16", "nvfp4"):
        raise ValueError(f"weights must be 'bf16' or 'nvfp4', got {weights!r}")
    q = weights == "nvfp4"
    H, D, Hq, KV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def lin(*shape):
        return Leaf(tuple(shape), "linear", q)

    layers = []
    for i in range(cfg.num_hidden_layers):
        attn = Attention(q=lin(Hq * D, H), k=lin(KV * D, H), v=lin(KV * D, H), o=lin(H, Hq * D),
                         q_norm=Leaf((D,), "norm"), k_norm=Leaf((D,), "norm"), sinks=Leaf((Hq,), "sink"))
        if cfg.is_moe(i):
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            shared = cfg.n_shared_experts > 0
            mlp = MoE(router=Leaf((E, H), "router"), router_bias=Leaf((E,), "bias"),
                      gate=lin(E, I, H), up=lin(E, I, H), down=lin(E, H, I),
                      shared_gate=lin(I, H) if shared else None, shared_up=lin(I, H) if shared else None,
                      shared_down=lin(H, I) if shared else None)
        else:
            I = cfg.intermediate_size
            mlp = DenseMLP(gate=lin(I, H), up=lin(I, H), down=lin(H, I))
        layers.append(Layer(attn_norm=Leaf((H,), "norm"), attn=attn, mlp_norm=Leaf((H,), "norm"), mlp=mlp))
    return Params(embed=Leaf((cfg.vocab_size, H), "embed"), layers=tuple(layers),
                  final_norm=Leaf((H,), "norm"), lm_head=lin(cfg.vocab_size, H))


def abstract_params(cfg: FlintConfig, weights: WeightFormat = "bf16") -> Params:
    """ShapeDtypeStructs for every array: the tree a checkpoint must fill, allocating nothing."""
    def one(leaf: Leaf):
        if leaf.quantized:
            return nvfp4.abstract(leaf.shape)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return jax.tree.map(one, describe(cfg, weights), is_leaf=_is_leaf)


def _init_leaf(leaf: Leaf, key: jax.Array, cfg: FlintConfig):
    if leaf.kind == "linear":
        std = 1.0 / math.sqrt(leaf.shape[-1])
        if leaf.quantized:
            return nvfp4.random(key, leaf.shape, std)
        return (std * jax.random.normal(key, leaf.shape, jnp.float32)).astype(jnp.bfloat16)
    if leaf.kind == "embed":
        return jax.random.normal(key, leaf.shape, jnp.float32).astype(jnp.bfloat16)
    if leaf.kind == "norm":
        return (1.0 + 0.1 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(jnp.bfloat16)
    if leaf.kind == "sink":
        return jax.random.normal(key, leaf.shape, jnp.float32)
    if leaf.kind == "router":
        return jax.random.normal(key, leaf.shape, jnp.float32) / math.sqrt(leaf.shape[-1])
    if leaf.kind == "bias":
        return 0.1 * jax.random.normal(key, leaf.shape, jnp.float32)
    raise AssertionError(leaf.kind)


# One small compiled program per distinct leaf description (about 20 at the Flint shape): each array is created on
# the device in one launch, and compiling stays seconds, where one jit over the whole tree would take minutes.
_init_leaf_compiled = jax.jit(_init_leaf, static_argnums=(0, 2))


def init_params(cfg: FlintConfig, key: jax.Array, weights: WeightFormat = "bf16") -> Params:
    """Random parameters with sensible scales (synthetic models for tests and benchmarks), created on the default
    device."""
    desc = describe(cfg, weights)
    leaves, treedef = jax.tree.flatten(desc, is_leaf=_is_leaf)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [_init_leaf_compiled(l, k, cfg) for l, k in zip(leaves, keys)])


@dataclasses.dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # per token: routed experts counted top-k of E
    embedding: int  # the input embedding (a lookup, not a matmul)

    def __str__(self) -> str:
        return (f"{self.total / 1e9:.2f}B total, {self.active / 1e9:.2f}B active per token "
                f"({(self.active - self.embedding) / 1e9:.2f}B without the embedding)")


def param_count(cfg: FlintConfig) -> ParamCount:
    """Total and per-token active parameter counts, from the same description as the arrays."""
    desc = describe(cfg)
    total = sum(l.numel for l in jax.tree.leaves(desc, is_leaf=_is_leaf))
    routed = 0
    for layer in desc.layers:
        if isinstance(layer.mlp, MoE):
            routed += sum(x.numel for x in (layer.mlp.gate, layer.mlp.up, layer.mlp.down))
    inactive = routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    return ParamCount(total=total, active=total - inactive, embedding=desc.embed.numel)


def _leaf_bytes(leaf: Leaf) -> float:
    """Bytes of one parameter as stored: NVFP4 codes, E4M3 block scales and an FP32 global scale per matrix."""
    if leaf.quantized:
        return leaf.numel * (0.5 + 1 / nvfp4.BLOCK) + 4 * math.prod(leaf.shape[:-2])
    return leaf.numel * jnp.dtype(leaf.dtype).itemsize


def weight_bytes_total(cfg: FlintConfig, weights: WeightFormat) -> int:
    """Bytes the whole parameter set takes on a device: every expert, the embedding and the LM head."""
    return int(sum(_leaf_bytes(l) for l in jax.tree.leaves(describe(cfg, weights), is_leaf=_is_leaf)))


def weight_bytes_per_token(cfg: FlintConfig, weights: WeightFormat) -> int:
    """Bytes of weights a batch-1 decode step must read: active linears, norms, router, one embedding row."""
    desc = describe(cfg, weights)
    nbytes = _leaf_bytes
    total = sum(nbytes(l) for l in jax.tree.leaves(desc, is_leaf=_is_leaf))
    total -= nbytes(desc.embed) - desc.embed.shape[1] * 2
    for layer in desc.layers:
        if isinstance(layer.mlp, MoE):
            routed = sum(nbytes(x) for x in (layer.mlp.gate, layer.mlp.up, layer.mlp.down))
            total -= routed * (cfg.n_routed_experts - cfg.num_experts_per_tok) / cfg.n_routed_experts
    return int(total)
