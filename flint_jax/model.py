"""The Flint model: the reference forward, and the jitted prefill/decode steps over the hybrid KV state.

`forward(params, tokens, cfg)` is the oracle: full-sequence logits with no cache. `model_step` runs a chunk of T new
tokens per sequence against the state (prefill is a few chunks; decode is T = 1) and returns the final hidden
states; `lm_logits` turns hidden states into FP32 logits. Layers are a Python loop, so a jitted step is one flat
program that XLA can capture whole (no `while` loop).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
# Pallas' interpret mode (the kernels on a CPU) imports this module during the first trace of a program that uses
# them, and the module registers a jax config option: the next call's trace context then differs and the whole program
# is traced and compiled again (the engine's prefill program compiled twice, on its first two requests). Imported
# here, the option exists before any program is traced. (0.1 s of import time; on a GPU it is only imported.)
import jax.experimental.pallas.tpu  # noqa: F401
import jax.numpy as jnp

from flint_jax import layers as L
from flint_jax.config import FlintConfig
from flint_jax.layer_stack import StackedParams, materialize
from flint_jax.params import Params
from flint_jax.state import KVState, StackedCaches, write_full, write_ring


def check_tokens(tokens, cfg: FlintConfig) -> None:
    """Host-side check that token ids are inside the vocabulary (a gather would silently clamp them)."""
    import numpy as np
    t = np.asarray(tokens)
    if t.size and (t.min() < 0 or t.max() >= cfg.vocab_size):
        bad = int(t[(t < 0) | (t >= cfg.vocab_size)].flat[0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params.embed[tokens]


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(params: Params, tokens: jax.Array, cfg: FlintConfig) -> jax.Array:
    """Reference full-sequence logits [B, T, V] FP32 for tokens [B, T] at positions 0..T-1. No cache; differentiable
    with respect to params."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h = embed(params, tokens)
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer{i}"):
            sliding = cfg.is_sliding(i)
            a = L.rmsnorm(h, layer.attn_norm, cfg.rms_norm_eps)
            q, k, v = L.project_qkv(a, layer.attn, positions, cfg, sliding)
            mask = L.attention_mask(positions, positions, cfg.sliding_window if sliding else None)
            o = L.attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask, layer.attn.sinks)
            h = h + L.linear(o.reshape(B, T, -1), layer.attn.o)
            h = L.mlp_block(h, layer, cfg)
    return L.logits_from_hidden(h, params.final_norm, params.lm_head, cfg.rms_norm_eps)


def attention_block(h: jax.Array, layer, cache, positions: jax.Array, valid: jax.Array, lengths_after: jax.Array,
                    cfg: FlintConfig, sliding: bool):
    """`h + Wo(attention(rmsnorm(h)))` for a chunk h [B, T, H] at `positions`, reading and updating the layer's
    cache. Returns (h, cache)."""
    B, T, _ = h.shape
    a = L.rmsnorm(h, layer.attn_norm, cfg.rms_norm_eps)
    q, k, v = L.project_qkv(a, layer.attn, positions, cfg, sliding)
    q_pos = jnp.where(valid, positions, -1)
    if sliding:
        # Keys: what the ring held before this chunk, then the chunk itself.
        keys = jnp.concatenate([cache.k, jnp.swapaxes(k, 1, 2)], axis=2)
        vals = jnp.concatenate([cache.v, jnp.swapaxes(v, 1, 2)], axis=2)
        k_pos = jnp.concatenate([cache.pos, q_pos], axis=1)
        mask = L.attention_mask(q_pos, k_pos, cfg.sliding_window)
        o = L.attend(q, keys, vals, mask, layer.attn.sinks)
        cache = write_ring(cache, k, v, positions, valid)
    else:
        cache = write_full(cache, k, v, positions, valid)
        S = cache.k.shape[2]
        k_pos = jnp.where(jnp.arange(S)[None, :] < lengths_after[:, None], jnp.arange(S)[None, :], -1)
        mask = L.attention_mask(q_pos, k_pos, None)
        o = L.attend(q, cache.k, cache.values(), mask, layer.attn.sinks)
    return h + L.linear(o.reshape(B, T, -1), layer.attn.o), cache


def model_step(params: Params, state: KVState, tokens: jax.Array, n_new: jax.Array, cfg: FlintConfig,
               impl: str = "xla"):
    """Run tokens [B, T] (row b's first n_new[b] are real) at positions lengths[b] + t.
    Returns (hidden [B, T, H] BF16 after the last layer, new state). Not jitted itself: `steps` jits it."""
    h, caches = run_layers(layers_of(params), state.layers, embed(params, tokens), state.lengths, n_new, cfg, impl)
    return h, KVState(layers=caches, lengths=state.lengths + n_new)


def layers_of(params) -> tuple:
    """The per-layer parameter trees that `run_layers` takes: `params.layers`, or for stacked parameters
    (layer_stack.StackedParams) the layers as LayerSlices of the stacks (run_layers materialises them for the blocks
    that do not index the stacks themselves)."""
    return params.layer_slices() if isinstance(params, StackedParams) else params.layers


def run_layers(layers, caches, h: jax.Array, lengths: jax.Array, n_new: jax.Array, cfg: FlintConfig,
               impl: str = "xla", first: int = 0):
    """Layers first .. first + len(layers) - 1 of the model (their params and caches) on h [B, T, H], row b's first
    n_new[b] tokens real, at positions lengths[b] + t (lengths: what the state held before this chunk). Returns
    (h, the layers' new caches as a tuple). model_step runs all of them; prefill_pipeline runs them in segments.
    `caches` may also be the whole model's StackedCaches (state.StackedCaches): they come back updated."""
    T = h.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = lengths[:, None] + t
    valid = t < n_new[:, None]
    lengths_after = lengths + n_new
    blocks = _blocks(impl, T)
    B = h.shape[0]
    rows = blocks.rows(B) if blocks.rows else B
    if rows != B:
        h = jnp.pad(h, ((0, rows - B),) + ((0, 0),) * (h.ndim - 1))
    stacked = isinstance(caches, StackedCaches)
    out = []
    for j, layer in enumerate(layers):
        i = first + j
        cache = caches.cache(i) if stacked else caches[j]
        if not blocks.takes_layer_slices:
            layer, cache = materialize(layer), materialize(cache)
        with jax.named_scope(f"layer{i}"):
            h, cache = blocks.attention(h, layer, cache, positions, valid, lengths_after, cfg, cfg.is_sliding(i))
            h = blocks.mlp(h, layer, cfg)
        if stacked:
            caches = caches.with_cache(i, cache)  # the next layer reads the stacks this one wrote
        else:
            out.append(cache)
    return h[:B], caches if stacked else tuple(out)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The two halves of a layer, as a decode path implements them."""
    attention: callable
    mlp: callable
    takes_layer_slices: bool = False  # the blocks accept layer_stack.LayerSlice parameters
    # B -> the rows the blocks want h to carry (padding rows past B: the caches, positions and valid keep B rows).
    # run_layers pads h once before the first layer and slices it once after the last, instead of every kernel
    # padding its input and slicing its output (pallas_path: decode kernels take 1, 2, 4 or 8 rows).
    rows: Callable[[int], int] | None = None


def _blocks(impl: str, T: int) -> Blocks:
    if impl == "xla":
        return Blocks(attention_block, L.mlp_block)
    if impl == "pallas":
        from flint_jax import pallas_path
        return pallas_path.blocks(T)
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")


def lm_logits(params: Params, h: jax.Array, cfg: FlintConfig, impl: str = "xla") -> jax.Array:
    """FP32 logits from final hidden states. impl="pallas" uses the LM-head kernel where it is the faster one
    (pallas_path.lm_logits), else the reference."""
    if impl == "pallas":
        from flint_jax import pallas_path
        return pallas_path.lm_logits(params, h, cfg)
    return L.logits_from_hidden(h, params.final_norm, params.lm_head, cfg.rms_norm_eps)


def last_hidden(h: jax.Array, n_new: jax.Array) -> jax.Array:
    """Each row's hidden state at its last real token: [B, T, H] -> [B, H]."""
    idx = jnp.maximum(n_new - 1, 0)
    return jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class Model:
    """A Flint model: config and parameters, plus what its checkpoint said about the tokenizer. `flint_jax.load`
    returns one; `Model(cfg, init_params(cfg, key))` builds one from scratch."""
    cfg: FlintConfig
    params: Params
    source: str = ""
    tokenizer_metadata: dict = dataclasses.field(default_factory=dict)

    def forward(self, tokens) -> jax.Array:
        """Reference logits [B, T, V] FP32 for int tokens [B, T] (no cache)."""
        check_tokens(tokens, self.cfg)
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
        return forward(self.params, tokens, self.cfg)

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's FlintTokenizer, or None when it carries none."""
        from flint_jax.chat import FlintTokenizer
        meta = self.tokenizer_metadata
        if "tokenizer_json" in meta:
            return FlintTokenizer.from_tokenizer_json(meta["tokenizer_json"])
        if "tokenizer.ggml.tokens" in meta:
            return FlintTokenizer.from_gguf_metadata(meta)
        return None

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer_metadata.get("tokenizer.chat_template")

    def engine(self, **kwargs):
        """An `Engine` over this model (kwargs: max_batch, max_len, chunk_size, impl, steps_per_dispatch)."""
        from flint_jax.engine import Engine
        return Engine(self.cfg, self.params, tokenizer=self.tokenizer, chat_template=self.chat_template, **kwargs)
