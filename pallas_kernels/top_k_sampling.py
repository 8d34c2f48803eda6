"""Top-k / top-p sampling of the decode step in two Pallas kernels (Triton lowering), without sorting the vocabulary.

`sampling.sample` sorts each row's 151,552 logits to find its top-k and nucleus (cub's radix sort, ~85 us of the
served step with the cumulative sum and the draw, run BA). Rows whose top_k is at most K_MAX (Flint's default is
20), and greedy rows, need only their K_MAX largest logits:

1. `_partial_kernel`, grid (B, chunks of CHUNK logits): each program scales its chunk by the row's temperature
   and takes its k largest values by k rounds of (max, argmax): ties to the lower index, k = the row's top_k
   (1 for a greedy row). A row's top-k lies within the union of its chunks' top-k.
2. `_final_kernel`, grid (B,): k rounds over those candidates give the row's top-k in order (value descending, ties
   to the lower vocabulary id); then the softmax over them, the nucleus (the tokens whose probability mass
   strictly above them is below top_p; the first always stays), and the Gumbel-max draw with the row's noise read
   at the kept ids. A greedy row takes its first candidate.

The noise is `jax.random.gumbel(key, (V,))` per row, the one `jax.random.categorical` adds in `sampling.sample`, so
both paths draw the same token from the same key wherever they keep the same set: always, except (a) ties at the
k-th value (the sort keeps every tied token, these kernels the lowest ids) and (b) a token whose mass above it is
within rounding of top_p (the two sum the probabilities in different orders). `ref_sample_top_k` is the plain-JAX
reference with the kernels' selection rules (`lax.top_k` orders ties the same way); the kernels equal it exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flint_jax.pallas_kernels.weight_tiles import pow2_rows

F32 = jnp.float32
NEG_INF = float("-inf")

K_MAX = 32  # the largest top_k the kernels serve
CHUNK = 1024  # logits per program of the first kernel (Flint: 148 programs per row)
PARTIAL_WARPS, FINAL_WARPS = 4, 8


def supports(top_k: int, temperature: float) -> bool:
    """Whether a row with these settings can be sampled by the kernels (host-side check, per request)."""
    return temperature <= 0 or 1 <= top_k <= K_MAX


def _partial_kernel(logits_ref, temp_ref, k_ref, vals_ref, ids_ref, *, V: int, chunk: int, kmax: int):
    b, p = pl.program_id(0), pl.program_id(1)
    local = jnp.arange(chunk, dtype=jnp.int32)
    x = plgpu.load(logits_ref.at[b, pl.ds(p * chunk, chunk)], mask=p * chunk + local < V, other=NEG_INF)
    x = x.astype(F32) / temp_ref[b]
    slot = jnp.arange(kmax, dtype=jnp.int32)

    def round_(r, carry):
        x, vals, ids = carry
        i = jnp.argmax(x).astype(jnp.int32)  # ties to the lower index
        vals = jnp.where(slot == r, jnp.max(x), vals)
        ids = jnp.where(slot == r, p * chunk + i, ids)
        return jnp.where(local == i, NEG_INF, x), vals, ids

    init = (x, jnp.full((kmax,), NEG_INF, F32), jnp.zeros((kmax,), jnp.int32))
    _, vals, ids = jax.lax.fori_loop(0, k_ref[b], round_, init)
    plgpu.store(vals_ref.at[b, p, :], vals)
    plgpu.store(ids_ref.at[b, p, :], ids)


def _final_kernel(vals_ref, ids_ref, noise_ref, k_ref, greedy_ref, top_p_ref, tok_ref, *, n: int, n_pad: int,
                  kmax: int):
    b = pl.program_id(0)
    pos = jnp.arange(n_pad, dtype=jnp.int32)
    c = plgpu.load(vals_ref.at[b, pl.ds(0, n_pad)], mask=pos < n, other=NEG_INF)
    cid = plgpu.load(ids_ref.at[b, pl.ds(0, n_pad)], mask=pos < n, other=0)
    slot = jnp.arange(kmax, dtype=jnp.int32)

    def round_(r, carry):
        c, vals, ids = carry
        j = jnp.argmax(c).astype(jnp.int32)  # ties to the lower position: the lower vocabulary id
        hit = pos == j
        vals = jnp.where(slot == r, jnp.max(c), vals)
        ids = jnp.where(slot == r, jnp.sum(jnp.where(hit, cid, 0)), ids)
        return jnp.where(hit, NEG_INF, c), vals, ids

    init = (c, jnp.full((kmax,), NEG_INF, F32), jnp.zeros((kmax,), jnp.int32))
    _, vals, ids = jax.lax.fori_loop(0, k_ref[b], round_, init)
    valid = vals > NEG_INF
    e = jnp.where(valid, jnp.exp(vals - jnp.max(vals)), 0.0)
    probs = e / jnp.sum(e)
    above = jnp.sum(jnp.where(slot[None, :] < slot[:, None], probs[None, :], 0.0), axis=1)  # mass before each
    keep = valid & (above < top_p_ref[b])
    noise = plgpu.load(noise_ref.at[b, ids], mask=keep, other=0.0)
    pick = jnp.argmax(jnp.where(keep, vals + noise, NEG_INF)).astype(jnp.int32)
    pick = jnp.where(greedy_ref[b] != 0, 0, pick)
    tok = jnp.sum(jnp.where(slot == pick, ids, 0))
    plgpu.store(tok_ref.at[pl.ds(b, 1)], jnp.broadcast_to(tok, (1,)))


def _gumbel_noise(keys, V: int):
    """[B, V] f32: each row's noise, the one `jax.random.categorical(key, logits)` adds to its logits."""
    return jax.vmap(lambda key: jax.random.gumbel(key, (V,), F32))(keys)


def _row_settings(temperature, top_k):
    """(temperature to divide by, rounds k, greedy flag) per row: a greedy row (temperature 0) takes one round."""
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature).astype(F32)
    k = jnp.where(greedy, 1, jnp.clip(top_k, 1, K_MAX)).astype(jnp.int32)
    return t, k, greedy


@functools.partial(jax.jit, static_argnames=("interpret",))
def sample_top_k(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                 *, interpret: bool = False) -> jax.Array:
    """Next token per row, as `sampling.sample` draws it (see the module doc for where the two can differ). logits
    [B, V] f32, keys [B] PRNG keys, settings [B]. Every row must be greedy (temperature 0) or have 1 <= top_k <=
    K_MAX (`supports`): a larger top_k is clipped to K_MAX."""
    B, V = logits.shape
    t, k, greedy = _row_settings(temperature, top_k)
    chunks = -(-V // CHUNK)
    vals, ids = pl.pallas_call(
        functools.partial(_partial_kernel, V=V, chunk=CHUNK, kmax=K_MAX),
        out_shape=(jax.ShapeDtypeStruct((B, chunks, K_MAX), F32), jax.ShapeDtypeStruct((B, chunks, K_MAX), jnp.int32)),
        grid=(B, chunks),
        compiler_params=plgpu.CompilerParams(num_warps=PARTIAL_WARPS, num_stages=1),
        interpret=interpret,
        name="top_k_partial",
    )(logits.astype(F32), t, k)
    noise = _gumbel_noise(keys, V)
    n = chunks * K_MAX
    tok = pl.pallas_call(
        functools.partial(_final_kernel, n=n, n_pad=pow2_rows(n), kmax=K_MAX),
        out_shape=jax.ShapeDtypeStruct((B,), jnp.int32),
        grid=(B,),
        compiler_params=plgpu.CompilerParams(num_warps=FINAL_WARPS, num_stages=1),
        interpret=interpret,
        name="top_k_sample",
    )(vals.reshape(B, n), ids.reshape(B, n), noise, k, greedy.astype(jnp.int32), top_p.astype(F32))
    return tok


@jax.jit
def ref_sample_top_k(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array) -> jax.Array:
    """Plain-JAX reference of `sample_top_k`: the same selection (the k largest, ties to the lower id; the nucleus
    by the mass strictly above each of them), the same noise, in XLA."""
    B, V = logits.shape
    t, k, greedy = _row_settings(temperature, top_k)
    x = logits.astype(F32) / t[:, None]
    vals, ids = jax.lax.top_k(x, min(K_MAX, V))
    slot = jnp.arange(vals.shape[1])
    valid = (slot[None, :] < k[:, None]) & (vals > NEG_INF)
    e = jnp.where(valid, jnp.exp(vals - vals[:, :1]), 0.0)
    probs = e / jnp.sum(e, axis=1, keepdims=True)
    above = jnp.sum(jnp.where(slot[None, None, :] < slot[None, :, None], probs[:, None, :], 0.0), axis=2)
    keep = valid & (above < top_p[:, None])
    noise = _gumbel_noise(keys, V)
    score = jnp.where(keep, vals + jnp.take_along_axis(noise, ids, axis=1), NEG_INF)
    pick = jnp.where(greedy, 0, jnp.argmax(score, axis=1))
    return jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0].astype(jnp.int32)
