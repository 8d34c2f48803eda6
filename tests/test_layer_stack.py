"""Stacked layer parameters (flint_jax.layer_stack): the same steps, bit for bit, from a few large buffers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layer_stack as LS
from flint_jax import model as M
from flint_jax import prefill_pipeline
from flint_jax.params import init_params
from flint_jax.state import init_state

step = jax.jit(M.model_step, static_argnames=("cfg", "impl"))


def _same_tree(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                                      np.asarray(y).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_stacking_round_trips_and_cuts_the_buffer_count(weights, tiny_cfg, tiny_params, tiny_params_nvfp4):
    params = tiny_params if weights == "bf16" else tiny_params_nvfp4
    sp = LS.stack_layers(params)
    _same_tree(LS.unstack_layers(sp), params)
    n_plain, n_stacked = len(jax.tree.leaves(params)), len(jax.tree.leaves(sp))
    per_layer = len(jax.tree.leaves(params.layers[-1]))
    # one stack per parameter position (dense and MoE layers share the attention's), plus embed/final norm/LM head
    assert n_stacked <= 2 * per_layer + 3 + 3 < n_plain
    assert LS.stack_layers(sp) is sp


def test_default_chunks_keep_kernel_offsets_in_32_bits():
    assert LS.MAX_CHUNK_BYTES < 2**31  # element offsets of any dtype stay below Triton's signed 32-bit range


def test_chunks_respect_the_byte_limit(tiny_cfg, tiny_params):
    sizes = [a.nbytes for a in jax.tree.leaves(tiny_params.layers[-1])]
    limit = 2 * max(sizes)
    sp = LS.stack_layers(tiny_params, max_chunk_bytes=limit)
    assert all(s.nbytes <= limit for s in sp.stacks)
    assert len(sp.stacks) > len(LS.stack_layers(tiny_params).stacks)  # the 3 MoE layers no longer fit one chunk
    _same_tree(LS.unstack_layers(sp), tiny_params)
    assert LS._chunks([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]


def test_delete_frees_the_layer_arrays(tiny_cfg):
    params = init_params(tiny_cfg, jax.random.key(7), "nvfp4")
    copy = jax.tree.map(jnp.copy, params)
    calls = []
    sp = LS.stack_layers(params, delete=True, progress=lambda done, total: calls.append((done, total)))
    assert all(a.is_deleted() for a in jax.tree.leaves(params.layers))
    assert not params.embed.is_deleted()  # embed, final norm and LM head are shared, not copied
    _same_tree(LS.unstack_layers(sp), copy)
    assert calls and calls[-1][0] == calls[-1][1] == len(sp.stacks)


def test_layer_slice_behaves_like_the_layer_array():
    stack = jnp.arange(3 * 4 * 8, dtype=jnp.float32).reshape(3, 4, 8)
    s = LS.LayerSlice(stack, 1)
    assert s.shape == (4, 8) and s.ndim == 2 and s.dtype == jnp.float32
    np.testing.assert_array_equal(s.reshape(2, 16).value(), stack[1].reshape(2, 16))
    e = s.expand()
    assert e.shape == (1, 4, 8)
    np.testing.assert_array_equal(e.reshape(1, 32).value(), stack[1].reshape(1, 32))
    assert s.astype(jnp.float32) is s
    with pytest.raises(TypeError, match="cannot be cast"):
        s.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot reshape"):
        s.reshape(5, 7)
    with pytest.raises(ValueError, match="leading axis"):
        e.reshape(4, 8)


@pytest.mark.parametrize("weights,impl", [("nvfp4", "xla"), ("nvfp4", "pallas"), ("bf16", "pallas")])
def test_stacked_steps_equal_unstacked(weights, impl, tiny_cfg, tiny_params, tiny_params_nvfp4):
    """Prefill (T > 1) and decode: the stacked parameters give the very same hidden states and caches (the kernels
    read the same values through a BlockSpec; the reference reads slices)."""
    params = tiny_params if weights == "bf16" else tiny_params_nvfp4
    cfg = tiny_cfg
    sp = LS.stack_layers(params, max_chunk_bytes=40_000)  # several chunks per position in the tiny model
    toks = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size)
    outs = []
    for p in (params, sp):
        state = init_state(cfg, 2, 16)
        h0, state = step(p, state, toks[:, :6], jnp.array([6, 5]), cfg, impl=impl)
        hs = [h0]
        for i in range(6, 8):  # past the window-5 ring's wrap
            h, state = step(p, state, toks[:, i:i + 1], jnp.array([1, 1]), cfg, impl=impl)
            hs.append(h)
        outs.append((hs, state))
    _same_tree(outs[0], outs[1])


def test_prefill_pipeline_takes_stacked_params(tiny_cfg, tiny_params_nvfp4):
    cfg = tiny_cfg
    sp = LS.stack_layers(tiny_params_nvfp4)
    toks = jax.random.randint(jax.random.key(4), (2, 6), 0, cfg.vocab_size)
    keys = jax.random.split(jax.random.key(0), 2)
    outs = []
    for p in (tiny_params_nvfp4, sp):
        nxt, state = prefill_pipeline.prefill(p, init_state(cfg, 2, 16), toks, jnp.array([6, 4]), keys,
                                              jnp.ones(2), jnp.full(2, 20), jnp.full(2, 0.95), cfg=cfg,
                                              impl="pallas", cuts=(1, 3))
        outs.append((nxt, state))
    _same_tree(outs[0], outs[1])


def test_engine_params_stack_for_pallas_and_spare_shared_params(tiny_cfg):
    from flint_jax.runtime import Runtime, engine_params
    params = init_params(tiny_cfg, jax.random.key(9), "nvfp4")
    shared = Runtime(tiny_cfg, params, None, (), "test", params_shared=True)
    assert engine_params(shared, "xla") is params
    sp = engine_params(shared, "pallas")
    assert isinstance(sp, LS.StackedParams) and shared.params is sp
    assert not any(a.is_deleted() for a in jax.tree.leaves(params))  # shared: copied, not consumed
    owned = Runtime(tiny_cfg, params, None, (), "test")
    engine_params(owned, "pallas")
    assert all(a.is_deleted() for a in jax.tree.leaves(params.layers))  # owned: consumed, not held twice


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_stacked_caches_equal_per_layer_caches(impl, tiny_cfg, tiny_params_nvfp4):
    """StackedCaches (with stacked parameters): the decode kernels write the stacks in place, XLA's blocks write
    slices back; prefill and decode steps give the same bits as per-layer caches, state included."""
    from flint_jax.state import StackedCaches
    cfg = tiny_cfg
    sp = LS.stack_layers(tiny_params_nvfp4)
    toks = jax.random.randint(jax.random.key(5), (2, 9), 0, cfg.vocab_size)
    outs = []
    for stacked in (False, True):
        state = init_state(cfg, 2, 16, stacked=stacked)
        assert isinstance(state.layers, StackedCaches) == stacked
        h0, state = step(sp, state, toks[:, :6], jnp.array([6, 5]), cfg, impl=impl)
        hs = [h0]
        for i in range(6, 8):  # past the window-5 ring's wrap
            h, state = step(sp, state, toks[:, i:i + 1], jnp.array([1, 1]), cfg, impl=impl)
            hs.append(h)
        assert isinstance(state.layers, StackedCaches) == stacked
        caches = state.layers.layers if stacked else state.layers
        outs.append((hs, caches, state.lengths))
    _same_tree(outs[0], outs[1])
    assert len(jax.tree.leaves(init_state(cfg, 2, 16, stacked=True))) == 6  # ring k, v, pos; full k, v; lengths


def test_prefill_pipeline_with_stacked_caches_resets_only_its_segments_rows(tiny_cfg, tiny_params_nvfp4):
    """Two requests through the pipeline (cut into segments), the second reusing row 0: stacked caches give the
    per-layer caches' tokens and state, so each segment empties only its own layers' rings."""
    cfg = tiny_cfg
    sp = LS.stack_layers(tiny_params_nvfp4)
    keys = jax.random.split(jax.random.key(0), 2)
    settings = (jnp.ones(2), jnp.full(2, 20), jnp.full(2, 0.95))
    outs = []
    for stacked in (False, True):
        state = init_state(cfg, 2, 16, stacked=stacked)
        got = []
        for seed, reset in ((6, None), (8, jnp.array([True, False]))):
            toks = jax.random.randint(jax.random.key(seed), (2, 6), 0, cfg.vocab_size)
            nxt, state = prefill_pipeline.prefill(sp, state, toks, jnp.array([6, 0]) if reset is not None else
                                                  jnp.array([6, 4]), keys, *settings, reset=reset, cfg=cfg,
                                                  impl="pallas", cuts=(1, 3))
            got.append(nxt)
        caches = state.layers.layers if stacked else state.layers
        outs.append((got, caches, state.lengths))
    _same_tree(outs[0], outs[1])


