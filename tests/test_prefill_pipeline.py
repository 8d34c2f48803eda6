"""flint_jax.prefill_pipeline: the engine's prefill chunk cut into separately jitted segments equals the chunk as one
program (engine.prefill_chunk after engine.reset_slots_in_place), for both impls, with rows emptied on the way."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import engine as E
from flint_jax import prefill_pipeline as PP
from flint_jax.config import FlintConfig
from flint_jax.params import init_params
from flint_jax.state import init_state


def test_segments_cover_the_layers_once():
    assert PP.segments(49, (2, 8)) == [(0, 2), (2, 8), (8, 49)]
    assert PP.segments(5, (2, 8)) == [(0, 2), (2, 5)]  # a cut at or past the last layer is dropped
    assert PP.segments(5, ()) == [(0, 5)]
    assert PP.segments(5, (3, 0, 1, 3)) == [(0, 1), (1, 3), (3, 5)]  # sorted, duplicates and 0 dropped
    with pytest.raises(ValueError, match="layer indices"):
        PP.segments(5, (2.5,))


def _settings(B):
    return (jnp.asarray(np.array([0.7, 1.0][:B], np.float32)), jnp.full((B,), 20, jnp.int32),
            jnp.full((B,), 0.95, jnp.float32))


@pytest.mark.parametrize("impl,weights,cuts",
                         [("xla", "bf16", (1, 3)), ("pallas", "nvfp4", (1, 3)), ("xla", "bf16", ())])
def test_pipelined_chunks_equal_the_one_program_chunks(impl, weights, cuts):
    """Two rows, three chunks (window 5: the rings wrap), cuts that make three segments (or none: one segment with
    the embedding and the head). Row 0 starts a new request at the third chunk (reset) while row 1 continues: the
    tokens sampled and every cache buffer equal the one-program path's bit for bit."""
    cfg = FlintConfig.tiny()
    params = init_params(cfg, jax.random.key(3), weights)
    B, C = 2, 7
    keys = jax.random.split(jax.random.key(5), B)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32) for _ in range(3)]
    n_news = [np.array([7, 4], np.int32), np.array([3, 7], np.int32), np.array([5, 6], np.int32)]
    resets = [np.array([True, True]), np.array([False, False]), np.array([True, False])]
    one, piped = init_state(cfg, B, 32), init_state(cfg, B, 32)
    for tokens, n_new, reset in zip(chunks, n_news, resets):
        one = E.reset_slots_in_place(one, jnp.asarray(reset))
        a, one = E.prefill_chunk(params, one, tokens, n_new, keys, *_settings(B), cfg=cfg, impl=impl)
        b, piped = PP.prefill(params, piped, tokens, n_new, keys, *_settings(B), reset=reset, cfg=cfg, impl=impl,
                              cuts=cuts)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(one.lengths), np.asarray(piped.lengths))
    assert np.asarray(piped.lengths).tolist() == [5, 4 + 7 + 6]
    for i, (x, y) in enumerate(zip(jax.tree.leaves(one), jax.tree.leaves(piped))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"state leaf {i}")


def test_bad_reset_and_cuts_are_refused():
    cfg = FlintConfig.tiny()
    params = init_params(cfg, jax.random.key(3))
    state = init_state(cfg, 2, 16)
    with pytest.raises(ValueError, match="one flag per row"):
        PP.prefill(params, state, np.zeros((2, 4), np.int32), np.array([4, 4]), jax.random.split(jax.random.key(0), 2),
                   *_settings(2), reset=np.array([True]), cfg=cfg)
    with pytest.raises(ValueError, match="layer indices"):
        E.Engine(cfg, params, max_batch=1, max_len=16, prefill_cuts=("2",))
