"""Token sampling: temperature, top-k, top-p, per request, in one jitted function over the batch.

Flint's defaults are temperature 1.0, top-p 0.95, top-k 20 (FLINT_SPEC section 1). Temperature 0 is greedy.
Every row has its own settings and its own PRNG key, so a request's tokens do not depend on its batch-mates.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.95
DEFAULT_TOP_K = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings. top_k = 0 means no top-k filter; top_p = 1.0 means no nucleus filter."""
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    max_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


# Rows whose top_k is in 1..TOP_K_CANDIDATES draw their nucleus from the row's TOP_K_CANDIDATES largest logits. Both
# filters compute such rows' threshold from that [B, TOP_K_CANDIDATES] prefix with the same operations, so a row's
# filtered logits (and its tokens) do not depend on which path its batch took. The top-k path finds the prefix by
# sorting segments of TOP_K_SEGMENT values and then the segments' candidates (`top_values`): on the H200 a sort of the
# 151,552-token vocabulary took 84 us and `lax.top_k` for k > 16 falls back to that sort (scripts/bench_sampling.py).
TOP_K_CANDIDATES = 64
TOP_K_SEGMENT = 1024


def _threshold(top: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest kept value of each row: top [B, W] the row's largest values in descending order, k [B] in 1..W.
    Top-k keeps values >= the k-th; the nucleus the smallest prefix of those whose probability (softmax over the k)
    reaches top_p. -> [B, 1]."""
    w = top.shape[-1]
    kth = jnp.take_along_axis(top, (k - 1)[:, None], axis=-1)
    top = jnp.where(jnp.arange(w)[None, :] < k[:, None], top, -jnp.inf)
    probs = jax.nn.softmax(top, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    cutoff = jnp.min(jnp.where(before < top_p[:, None], top, jnp.inf), axis=-1, keepdims=True)
    return jnp.maximum(kth, cutoff)


def top_values(x: jax.Array, w: int) -> jax.Array:
    """The w largest values of each row of x [B, V], descending (ties repeated): what `jnp.sort(x)[:, ::-1][:, :w]`
    gives, from sorts of TOP_K_SEGMENT-value segments and of their w largest each (every value among a row's w
    largest is among its segment's w largest)."""
    b, v = x.shape
    seg = TOP_K_SEGMENT
    if v <= 2 * seg or w > seg:
        return jnp.sort(x, axis=-1)[:, ::-1][:, :w]
    pad = -v % seg
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    best = jnp.sort(x.reshape(b, -1, seg), axis=-1)[:, :, seg - w:]  # [B, segments, w], ascending
    return jnp.sort(best.reshape(b, -1), axis=-1)[:, ::-1][:, :w]


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Scaled logits with everything outside top-k and the top-p nucleus set to -inf.
    logits [B, V] f32; per-row temperature (> 0), top_k (0 = off), top_p. The nucleus is the smallest set of
    highest-probability tokens whose probability (after top-k) reaches top_p; the top token is always kept.
    Sorts the whole vocabulary; rows with top_k in 1..TOP_K_CANDIDATES take their threshold from the sorted prefix
    as filter_logits_top does."""
    V = logits.shape[-1]
    x = logits / temperature[:, None]
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    whole = _threshold(sorted_x, jnp.where(top_k > 0, jnp.minimum(top_k, V), V), top_p)
    w = min(TOP_K_CANDIDATES, V)
    prefix = _threshold(sorted_x[:, :w], jnp.clip(top_k, 1, w), top_p)
    thr = jnp.where(((top_k >= 1) & (top_k <= w))[:, None], prefix, whole)
    return jnp.where(x >= thr, x, -jnp.inf)


def filter_logits_top(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """filter_logits for rows whose top_k is in 1..TOP_K_CANDIDATES (`fits_top_k_path`), without sorting the
    vocabulary: the same filtered logits for those rows. Other rows are filtered as if top_k were clipped into
    that range."""
    x = logits / temperature[:, None]
    w = min(TOP_K_CANDIDATES, x.shape[-1])
    thr = _threshold(top_values(x, w), jnp.clip(top_k, 1, w), top_p)
    return jnp.where(x >= thr, x, -jnp.inf)


def fits_top_k_path(top_ks) -> bool:
    """Whether rows with these top_k settings (host ints; leave out greedy rows, which ignore them) can sample with
    `sample(..., top_k_path=True)`."""
    return all(1 <= int(k) <= TOP_K_CANDIDATES for k in top_ks)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           top_k_path: bool = False) -> jax.Array:
    """Next token per row. logits [B, V] f32, keys [B] PRNG keys, settings [B]. Rows with temperature 0 are
    greedy (argmax; ties to the lower id). top_k_path (static): every sampled row's top_k is in
    1..TOP_K_CANDIDATES (`fits_top_k_path`), so the filter need not sort the vocabulary (filter_logits_top); the
    tokens are the same either way."""
    return _sample(logits, keys, temperature, top_k, top_p, top_k_path=bool(top_k_path))


@functools.partial(jax.jit, static_argnames=("top_k_path",))
def _sample(logits, keys, temperature, top_k, top_p, *, top_k_path):
    greedy = jnp.argmax(logits, axis=-1)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    filt = filter_logits_top if top_k_path else filter_logits
    filtered = filt(logits, safe_t, top_k, top_p)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def token_keys(keys: jax.Array, generated: jax.Array) -> jax.Array:
    """The sampling key of each row's next token: fold_in(request key, tokens the request has generated so far).
    keys [B] PRNG keys, generated [B] int. The one convention for prefill and decode, so a request's tokens do not
    depend on how its steps are grouped into calls."""
    return jax.vmap(jax.random.fold_in)(keys, generated)
