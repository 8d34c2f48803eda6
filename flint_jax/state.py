"""The hybrid KV state: a ring buffer per sliding layer, a full cache per full-context layer.

Layout `[B, KV, T, D]` (a KV head's keys are contiguous, which is what decode attention streams). With
`FP8_V_TRANSPOSED` on (a profiler variant, off by default), an FP8 full cache's values are stored transposed as
`[B, KV, D, S]` (`values_transposed`; `FullCache.values()` gives them key-major either way). A ring slot remembers
the absolute position it holds (-1 = empty), so masks come from stored positions, never from index arithmetic.
Full caches hold position t at index t; `lengths[b]` says how many tokens sequence b has.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax.config import FlintConfig

MAX_BATCH = 8

# The full-context layers' caches may hold K/V in FP8 (E4M3, the `kv_dtype="fp8"` option): half the bytes that a
# long-context decode step streams, and half the memory. Values are the BF16 K/V rounded to nearest (even) with no
# scale, saturating at +-448 (E4M3's largest finite value: a plain cast would make NaN). K is RMS-normed per head, so
# its values sit far inside that range; V is not normed. The sliding layers' rings stay BF16: 1 MB per layer, read
# by latency-bound kernels. BF16 (the default) keeps the model's own numerics.
KV_DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
FP8_MAX = 448.0
# True: FP8 full caches store V transposed ([B, KV, D, S], `values_transposed`) and the decode kernel puts the keys on
# its dots' M dimension (fewer instructions per key block offline). Measured on an H100 (run EU, docs/BENCHMARKS.md) it
# was no faster than V key-major like K (46.0 vs 45.2 us per full layer at batch 1, 315.9 vs 296.5 us at batch 8, 100K),
# so the default keeps V key-major (runs EJ-ET's layout); the transposed form stays as a profiler variant
# (scripts/profile_decode.py, fp8_v_transposed). Read when a cache is made and when a kernel is traced: set it before
# both.
FP8_V_TRANSPOSED = False


def kv_dtype_of(name) -> jnp.dtype:
    """'bf16' / 'fp8' (or the dtype itself) -> the full caches' element dtype."""
    for key, dtype in KV_DTYPES.items():
        if isinstance(name, str):
            if name == key:
                return jnp.dtype(dtype)
        elif isinstance(name, (type, np.dtype)) and np.dtype(name) == jnp.dtype(dtype):
            return jnp.dtype(dtype)
    raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {name!r}")


def to_cache_values(x: jax.Array, dtype) -> jax.Array:
    """K/V values as a cache of `dtype` holds them: BF16 as is; FP8 rounded to nearest even, saturating at
    +-FP8_MAX. The kernels (attention_prologue.store_kv) use this very function, so both paths round alike."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        return x.astype(jnp.bfloat16)
    x = x.astype(jnp.float32)  # exact from BF16; one rounding below
    return jnp.minimum(jnp.maximum(x, -FP8_MAX), FP8_MAX).astype(dtype)


def values_transposed(dtype) -> bool:
    """Whether a full cache of element `dtype` stores V transposed, [B, KV, D, S] (each feature's keys contiguous):
    FP8 caches do when FP8_V_TRANSPOSED is on. The decode kernel's values dot contracts over keys; Hopper's `ldmatrix`
    transposes only 16-bit elements, so a key-major FP8 V tile comes out of shared memory in more instructions
    (docs/KERNELS.md, "FP8 full caches"); measured, that did not make the key-major kernel slower (run EU). BF16
    caches keep V key-major like K."""
    return FP8_V_TRANSPOSED and jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16)


def through_cache(x: jax.Array, dtype) -> jax.Array:
    """BF16 values of x as a cache of `dtype` gives them back (exact: every FP8 value is a BF16 value)."""
    return to_cache_values(x, dtype).astype(jnp.bfloat16)


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_pytree
class RingCache:
    k: jax.Array  # [B, KV, W, D] bf16
    v: jax.Array  # [B, KV, W, D] bf16
    pos: jax.Array  # [B, W] int32, absolute position in each slot, -1 = empty


@_pytree
class FullCache:
    k: jax.Array  # [B, KV, S, D] bf16 or fp8, S = max_len
    v: jax.Array  # [B, KV, S, D]; [B, KV, D, S] for fp8 where values_transposed

    def values(self) -> jax.Array:
        """V key-major, [..., S, D], whatever the stored layout (a transposed view of a transposed FP8 cache)."""
        return jnp.swapaxes(self.v, -1, -2) if values_transposed(self.v.dtype) else self.v


def full_cache_of(k: jax.Array, v: jax.Array, dtype=jnp.bfloat16) -> FullCache:
    """A FullCache of `dtype` holding key-major k/v [B, KV, S, D] (rounded by to_cache_values; V transposed where
    values_transposed)."""
    k, v = to_cache_values(k, dtype), to_cache_values(v, dtype)
    return FullCache(k=k, v=jnp.swapaxes(v, -1, -2) if values_transposed(dtype) else v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedCaches:
    """Every layer's cache in two stacks, so a step hands the device 5 cache buffers instead of one to three per layer
    (flint_jax.layer_stack does the same for the parameters): `ring` holds the sliding layers' RingCaches with a
    leading layer axis ([n_ring, B, KV, W, D], pos [n_ring, B, W]), `full` the full layers' ([n_full, B, KV, S, D]);
    `where[i]` says which stack and row layer i uses. `cache(i)` is layer i's cache as LayerSlices of the stacks
    (what the decode kernels take: they write it in place through an aliased BlockSpec), `with_cache(i, c)` puts a
    layer's new cache back (the kernels' new stacks, or arrays written into the stack by XLA)."""
    ring: RingCache | None
    full: FullCache | None
    where: tuple[tuple[str, int], ...] = dataclasses.field(metadata=dict(static=True))

    def __len__(self) -> int:
        return len(self.where)

    def _stack(self, kind: str):
        return self.ring if kind == "ring" else self.full

    def cache(self, i: int):
        from flint_jax.layer_stack import LayerSlice
        kind, j = self.where[i]
        stack = self._stack(kind)
        return type(stack)(**{f.name: LayerSlice(getattr(stack, f.name), j) for f in dataclasses.fields(stack)})

    def with_cache(self, i: int, cache) -> "StackedCaches":
        from flint_jax.layer_stack import LayerSlice
        kind, j = self.where[i]
        stack = self._stack(kind)
        new = {}
        for f in dataclasses.fields(stack):
            c = getattr(cache, f.name)
            if isinstance(c, LayerSlice):  # a kernel's output: the whole new stack
                if c.index != j or c.keep_axis or c.stack.shape != getattr(stack, f.name).shape:
                    raise ValueError(f"layer {i}'s cache came back as another layer's slice")
                new[f.name] = c.stack
            else:
                new[f.name] = getattr(stack, f.name).at[j].set(c)
        stack = type(stack)(**new)
        return dataclasses.replace(self, **{kind: stack})

    @property
    def layers(self) -> tuple:
        """Every layer's cache as arrays (slices of the stacks)."""
        from flint_jax.layer_stack import materialize
        return tuple(materialize(self.cache(i)) for i in range(len(self)))


def stack_caches(caches: Sequence[RingCache | FullCache]) -> StackedCaches:
    """Per-layer caches -> StackedCaches (copies)."""
    where, rings, fulls = [], [], []
    for c in caches:
        group = rings if isinstance(c, RingCache) else fulls
        where.append(("ring" if group is rings else "full", len(group)))
        group.append(c)

    def stack(group, cls):
        if not group:
            return None
        return cls(**{f.name: jnp.stack([getattr(c, f.name) for c in group]) for f in dataclasses.fields(cls)})
    return StackedCaches(ring=stack(rings, RingCache), full=stack(fulls, FullCache), where=tuple(where))


@_pytree
class KVState:
    layers: tuple[RingCache | FullCache, ...] | StackedCaches
    lengths: jax.Array  # [B] int32: tokens held per sequence

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        if isinstance(self.layers, StackedCaches):
            return self.layers.full.k.shape[3] if self.layers.full is not None else 0
        full = [c for c in self.layers if isinstance(c, FullCache)]
        return full[0].k.shape[2] if full else 0


def init_state(cfg: FlintConfig, batch: int, max_len: int, stacked: bool = False, kv_dtype="bf16") -> KVState:
    """An empty state for `batch` sequences of up to `max_len` tokens; `stacked`: the caches as StackedCaches;
    kv_dtype: the full caches' element type ('bf16' or 'fp8', see KV_DTYPES)."""
    full_dtype = kv_dtype_of(kv_dtype)
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
            v_shape = (batch, KV, D, max_len) if values_transposed(full_dtype) else (batch, KV, max_len, D)
            layers.append(FullCache(k=jnp.zeros((batch, KV, max_len, D), full_dtype),
                                    v=jnp.zeros(v_shape, full_dtype)))
    return KVState(layers=stack_caches(layers) if stacked else tuple(layers), lengths=jnp.zeros((batch,), jnp.int32))


def state_bytes(cfg: FlintConfig, batch: int, context: int, kv_dtype="bf16") -> int:
    """Bytes of KV state for `batch` sequences with full caches of `context` tokens."""
    per_tok = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, BF16
    full = len(cfg.full_layers) * context * per_tok * kv_dtype_of(kv_dtype).itemsize // 2
    ring = len(cfg.sliding_layers) * cfg.sliding_window * (per_tok + 4)
    return batch * (full + ring) + 4 * batch


def kv_bytes_read(cfg: FlintConfig, context: int, kv_dtype="bf16") -> int:
    """Bytes of K/V a decode step reads for one sequence at `context` tokens (rings hold at most a window)."""
    per_tok = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    full = per_tok * kv_dtype_of(kv_dtype).itemsize // 2
    return full * len(cfg.full_layers) * context + per_tok * len(cfg.sliding_layers) * min(context, cfg.sliding_window)


def reset_slots(state: KVState, slots: jax.Array, layer_range: tuple[int, int] | None = None) -> KVState:
    """Empty the sequences whose `slots[b]` is True, so a new request can take them. Full caches need no
    clearing: everything at or beyond `lengths[b]` is masked. `layer_range` = (lo, hi): for StackedCaches, reset only
    the rings of layers lo .. hi - 1 (a prefill segment's own)."""
    caches = state.layers
    if isinstance(caches, StackedCaches):
        lo, hi = layer_range if layer_range is not None else (0, len(caches))
        rows = [j for kind, j in caches.where[lo:hi] if kind == "ring"]
        if rows:
            pos = caches.ring.pos
            mine = np.zeros((pos.shape[0], 1, 1), bool)
            mine[rows] = True
            pos = jnp.where(mine & slots[None, :, None], -1, pos)
            caches = dataclasses.replace(caches, ring=dataclasses.replace(caches.ring, pos=pos))
    else:
        caches = tuple(dataclasses.replace(c, pos=jnp.where(slots[:, None], -1, c.pos)) if isinstance(c, RingCache)
                       else c for c in caches)
    return KVState(layers=caches, lengths=jnp.where(slots, 0, state.lengths))


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
    """Write a chunk (k/v [B, T, KV, D], positions/valid [B, T]) into a full cache at its absolute positions; invalid
    tokens are dropped."""
    S = cache.k.shape[2]
    idx = jnp.where(valid, positions, S)
    b = jnp.arange(k.shape[0])[:, None]
    k, v = to_cache_values(k, cache.k.dtype), to_cache_values(v, cache.v.dtype)
    # Either index set gives the updated elements as [B, T, KV, D] (advanced indices apart: their axes first).
    v_at = cache.v.at[b, :, :, idx] if values_transposed(cache.v.dtype) else cache.v.at[b, :, idx]
    return FullCache(k=cache.k.at[b, :, idx].set(k, mode="drop"), v=v_at.set(v, mode="drop"))
