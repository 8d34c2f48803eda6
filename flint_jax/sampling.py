"""Token sampling: temperature, top-k, top-p, per request, in one jitted function over the batch.

Flint's defaults are temperature 1.0, top-p 0.95, top-k 20 (FLINT_SPEC section 1). Temperature 0 is greedy.
Every row has its own settings and its own PRNG key, so a request's tokens do not depend on its batch-mates.
"""

from __future__ import annotations

import dataclasses

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


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Scaled logits with everything outside top-k and the top-p nucleus set to -inf.
    logits [B, V] f32; per-row temperature (> 0), top_k (0 = off), top_p. The nucleus is the smallest set of
    highest-probability tokens whose probability (after top-k) reaches top_p; the top token is always kept."""
    V = logits.shape[-1]
    x = logits / temperature[:, None]
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    sorted_x = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_x, -jnp.inf)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep_sorted = before < top_p[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x >= cutoff, x, -jnp.inf)


@jax.jit
def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Next token per row. logits [B, V] f32, keys [B] PRNG keys, settings [B]. Rows with temperature 0 are
    greedy (argmax; ties to the lower id)."""
    greedy = jnp.argmax(logits, axis=-1)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    filtered = filter_logits(logits, safe_t, top_k, top_p)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def token_keys(keys: jax.Array, generated: jax.Array) -> jax.Array:
    """The sampling key of each row's next token: fold_in(request key, tokens the request has generated so far).
    keys [B] PRNG keys, generated [B] int. The one convention for prefill and decode, so a request's tokens do not
    depend on how its steps are grouped into calls."""
    return jax.vmap(jax.random.fold_in)(keys, generated)
