"""One prefill chunk as a pipeline of jitted segments (the engine's prefill), so that the host's dispatch of the later
layers overlaps the device's work on the earlier ones.

Calling a jitted program costs the host about 3 us per argument buffer on the H200 before the device sees the
program's first kernel (`scripts/dispatch_overhead.py`, run AS in docs/BENCHMARKS.md: 1,930 buffers, 5.9 ms). The
NVFP4 model has 1,796 parameter buffers and the state 134, so `engine.prefill_chunk`, the chunk as one program, left
the device idle ~6.8 ms at the start of every chunk (run AS, `bench_prefill.py --profile`). Here the chunk runs as
segments cut at layer boundaries (`cuts`): the first one (the embedding and the first `cuts[0]` layers, ~60
buffers) reaches the device in a fraction of a millisecond, and the host dispatches the next segments while the
device runs it. The ops are those of `engine.prefill_chunk`, in the same order.

Each segment also empties the rows that start a new request (`reset`) in its own caches, which replaces the separate
`engine.reset_slots_in_place` call before a request's first chunk (one dispatch of the whole state less).

    nxt, state = prefill_pipeline.prefill(params, state, tokens, n_new, keys, temperature, top_k, top_p,
                                          reset=rows_to_empty, cfg=cfg, impl="pallas")
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from flint_jax import model as M
from flint_jax.config import FlintConfig
from flint_jax.layer_stack import StackedParams
from flint_jax.params import Params
from flint_jax.sampling import sample, token_keys
from flint_jax.state import KVState, StackedCaches, reset_slots

# Layer indices where the chunk is cut. The first segment (embedding + the 2 dense layers, ~60 buffers with NVFP4
# weights) starts the device; the second (6 layers, ~240 buffers, ~0.7 ms of dispatch) is dispatched while the dense
# layers run; the rest (41 layers and the head, ~1,630 buffers, ~5 ms) while those 6 layers run. At 8K tokens a layer
# averages ~2.9 ms of kernels (run AT: 141 ms for 49 layers), so the device stays ahead of the host.
DEFAULT_CUTS = (2, 8)


def segments(num_layers: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """The [lo, hi) layer ranges of `cuts` (layer indices; cuts at 0 or at/after the last layer are dropped)."""
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts):
        raise ValueError(f"prefill cuts must be layer indices (ints), got {tuple(cuts)!r}")
    edges = [0] + sorted({c for c in cuts if 0 < c < num_layers}) + [num_layers]
    return list(zip(edges[:-1], edges[1:]))


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "first", "stop"), donate_argnames=("caches",))
def _segment(x, embed_table, layers, caches, lengths, n_new, reset, head, keys, temperature, top_k, top_p, *,
             cfg: FlintConfig, impl: str, first: int, stop: int):
    """Layers first .. stop - 1 of one chunk: `layers` holds their parameters (a tuple), or is the model's
    StackedParams (its stacks passed once, the segment's layers taken inside); `caches` their caches (a tuple), or
    the model's StackedCaches (returned updated). x: the tokens [B, T] when embed_table is given (the first
    segment), else the hidden states [B, T, H] from the previous segment. lengths: the state's lengths before the
    chunk (rows in `reset` count as empty). head = (final_norm, lm_head) for the last segment, which returns the
    sampled next token per row and the lengths after the chunk; the others return the hidden states."""
    if isinstance(layers, StackedParams):
        layers = layers.layer_slices()[first:stop]
    emptied = reset_slots(KVState(layers=caches, lengths=lengths), reset, layer_range=(first, stop))
    h = embed_table[x] if embed_table is not None else x
    h, caches = M.run_layers(layers, emptied.layers, h, emptied.lengths, n_new, cfg, impl, first)
    if head is None:
        return h, caches, None
    final_norm, lm_head = head
    nxt = sample_first_token(Params(embed=None, layers=(), final_norm=final_norm, lm_head=lm_head), h, n_new, keys,
                             temperature, top_k, top_p, cfg, impl)
    return nxt, caches, emptied.lengths + n_new


def sample_first_token(params: Params, h, n_new, keys, temperature, top_k, top_p, cfg: FlintConfig, impl: str):
    """The token after each row's prompt chunk: logits at its last real token (params.final_norm, params.lm_head),
    sampled with the request's key for its first generated token, `token_keys(keys, 0)`. Shared by this module's last
    segment and `engine.prefill_chunk`."""
    logits = M.lm_logits(params, M.last_hidden(h, n_new), cfg, impl=impl)
    return sample(logits, token_keys(keys, jnp.zeros_like(n_new)), temperature, top_k, top_p)


def prefill(params: Params, state: KVState, tokens, n_new, keys: jax.Array, temperature, top_k, top_p, *,
            reset=None, cfg: FlintConfig, impl: str = "xla", cuts: Sequence[int] = DEFAULT_CUTS, segment=None):
    """One prefill chunk for every row, as `engine.prefill_chunk` computes it (n_new[b] = 0 leaves row b untouched;
    keys [B]: each request's own key), after emptying the rows where reset[b] is True (None: none). The state is
    donated, segment by segment. Returns (next token per row, new state). segment: the jitted segment function
    (default `_segment`; benchmarks pass their own jit of `_segment.__wrapped__`, compiled with other options)."""
    segment = _segment if segment is None else segment
    B = state.lengths.shape[0]
    n_new = jnp.asarray(n_new, jnp.int32)
    reset = jnp.zeros((B,), bool) if reset is None else jnp.asarray(reset, bool)
    if reset.shape != (B,):
        raise ValueError(f"reset must have one flag per row ({B}), got shape {reset.shape}")
    parts = segments(cfg.num_hidden_layers, cuts)
    x, caches, lengths = tokens, [], None
    # Stacked parameters go to every segment whole (slices of them would pass each stack once per layer); stacked
    # caches too, each segment updating its layers' rows and handing the stacks to the next.
    stacked_params = isinstance(params, StackedParams)
    stacked_caches = state.layers if isinstance(state.layers, StackedCaches) else None
    for k, (lo, hi) in enumerate(parts):
        last = k == len(parts) - 1
        x, out, lengths = segment(
            x, params.embed if k == 0 else None, params if stacked_params else params.layers[lo:hi],
            stacked_caches if stacked_caches is not None else state.layers[lo:hi], state.lengths, n_new, reset,
            (params.final_norm, params.lm_head) if last else None,
            *((keys, temperature, top_k, top_p) if last else (None,) * 4), cfg=cfg, impl=impl, first=lo, stop=hi)
        if stacked_caches is not None:
            stacked_caches = out
        else:
            caches.extend(out)
    return x, KVState(layers=stacked_caches if stacked_caches is not None else tuple(caches), lengths=lengths)
