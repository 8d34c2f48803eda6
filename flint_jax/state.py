"""The hybrid KV state: a ring buffer per sliding layer, a full cache per full-context layer.

Layout `[B, KV, T, D]` (a KV head's keys are contiguous, which is what decode attention streams). A ring slot
remembers the absolute position it holds (-1 = empty), so masks come from stored positions, never from index
arithmetic. Full caches hold position t at index t; `lengths[b]` says how many tokens sequence b has.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flint_jax.config import FlintConfig

MAX_BATCH = 8


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class RingCache:
    k: jax.Array  # [B, KV, W, D] bf16
    v: jax.Array  # [B, KV, W, D] bf16
    pos: jax.Array  # [B, W] int32, absolute position in each slot, -1 = empty


@_pytree
class FullCache:
    k: jax.Array  # [B, KV, S, D] bf16, S = max_len
    v: jax.Array  # [B, KV, S, D] bf16


@_pytree
class KVState:
    layers: tuple[RingCache | FullCache, ...]
    lengths: jax.Array  # [B] int32: tokens held per sequence

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        full = [c for c in self.layers if isinstance(c, FullCache)]
        return full[0].k.shape[2] if full else 0


def init_state(cfg: FlintConfig, batch: int, max_len: int) -> KVState:
    """An empty state for `batch` sequences of up to `max_len` tokens."""
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be in [1, {MAX_BATCH}], got {batch}")
    if not 1 <= max_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_len must be in [1, max_position_embeddings={cfg.max_position_embeddings}], "
                         f"got {max_len}")
    KV, D, W = cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    layers = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sliding(i):
            layers.append(RingCache(k=jnp.zeros((batch, KV, W, D), jnp.bfloat16),
                                    v=jnp.zeros((batch, KV, W, D), jnp.bfloat16),
                                    pos=jnp.full((batch, W), -1, jnp.int32)))
        else:
            layers.append(FullCache(k=jnp.zeros((batch, KV, max_len, D), jnp.bfloat16),
                                    v=jnp.zeros((batch, KV, max_len, D), jnp.bfloat16)))
    return KVState(layers=tuple(layers), lengths=jnp.zeros((batch,), jnp.int32))


def state_bytes(cfg: FlintConfig, batch: int, context: int) -> int:
    """Bytes of KV state for `batch` sequences with full caches of `context` tokens."""
    per_tok = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, BF16
    full = len(cfg.full_layers) * context * per_tok
    ring = len(cfg.sliding_layers) * cfg.sliding_window * (per_tok + 4)
    return batch * (full + ring) + 4 * batch


def kv_bytes_read(cfg: FlintConfig, context: int) -> int:
    """Bytes of K/V a decode step reads for one sequence at `context` tokens (rings hold at most a window)."""
    per_tok = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return per_tok * (len(cfg.full_layers) * context + len(cfg.sliding_layers) * min(context, cfg.sliding_window))


def reset_slots(state: KVState, slots: jax.Array) -> KVState:
    """Empty the sequences whose `slots[b]` is True, so a new request can take them. Full caches need no
    clearing: everything at or beyond `lengths[b]` is masked."""
    layers = tuple(dataclasses.replace(c, pos=jnp.where(slots[:, None], -1, c.pos)) if isinstance(c, RingCache)
                   else c for c in state.layers)
    return KVState(layers=layers, lengths=jnp.where(slots, 0, state.lengths))


def write_ring(cache: RingCache, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array) -> RingCache:
    """Write a chunk into a ring. k/v [B, T, KV, D], positions/valid [B, T]. Of the valid tokens only the last W
    are written (earlier ones would be overwritten anyway), so every written slot is unique."""
    W = cache.k.shape[2]
    n_valid = jnp.sum(valid, axis=1, keepdims=True)
    keep = valid & (jnp.arange(k.shape[1])[None, :] >= n_valid - W)
    slot = jnp.where(keep, positions % W, W)  # W is out of range: dropped
    b = jnp.arange(k.shape[0])[:, None]
    return RingCache(k=cache.k.at[b, :, slot].set(k, mode="drop"),
                     v=cache.v.at[b, :, slot].set(v, mode="drop"),
                     pos=cache.pos.at[b, slot].set(positions, mode="drop"))


def write_full(cache: FullCache, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array) -> FullCache:
    """Write a chunk into a full cache at its absolute positions; invalid tokens are dropped."""
    S = cache.k.shape[2]
    idx = jnp.where(valid, positions, S)
    b = jnp.arange(k.shape[0])[:, None]
    return FullCache(k=cache.k.at[b, :, idx].set(k, mode="drop"), v=cache.v.at[b, :, idx].set(v, mode="drop"))
