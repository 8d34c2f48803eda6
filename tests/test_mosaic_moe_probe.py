"""scripts/probe_mosaic_moe.py on the CPU: its per-expert layout, expert selection and SwiGLU epilogue (emulated in
NumPy, the kernel's per-thread arithmetic) give layers' activations. The kernel itself runs on the GPU in the probe."""
import os
import sys

import flint_jax  # noqa: F401  (XLA flags first)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import probe_mosaic_moe as probe  # noqa: E402
import probe_mosaic_nvfp4 as nv  # noqa: E402


@pytest.mark.parametrize("q", [8, 16])
def test_selected_experts_swiglu_equals_layers(q):
    """Three routed experts (per-expert global scales 0.5-1.5), the shared one; a repeated expert and the shared id."""
    E, H, inter = 3, 2 * q * nv.STEP_BYTES, 64  # 2 * 64 / (64 / q) programs per expert, one step each
    moe = probe.synthetic_moe(jax.random.key(0), E, H, inter)
    b = jax.random.normal(jax.random.key(1), (1, H), jnp.float32).astype(jnp.bfloat16)
    ids = probe.pair_ids(jnp.array([2, 0, 2]), E)
    assert np.asarray(ids).tolist() == [2, 0, 2, E]
    lay = probe.gate_up_layout(moe, q)
    got = probe.emulate_gate_up(nv.x_columns(b, q), ids, *lay, inter=inter, K=H, q=q)
    want = probe.ref_gate_up(b, ids, moe)
    assert got.shape == want.shape == (4, inter)
    # FP32 sums in another order than the reference's: at most one BF16 rounding step apart, mostly equal
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.8
    assert not np.allclose(want[0], want[1])  # different experts give different rows: the selection matters


def test_interleave_puts_gate_and_up_blocks_side_by_side():
    gate, up = jnp.arange(8 * 2).reshape(8, 2), 100 + jnp.arange(8 * 2).reshape(8, 2)
    both = np.asarray(probe._interleave(gate, up, 4))
    np.testing.assert_array_equal(both[:4], np.asarray(gate[:4]))
    np.testing.assert_array_equal(both[4:8], np.asarray(up[:4]))
    np.testing.assert_array_equal(both[8:12], np.asarray(gate[4:]))


def test_layout_needs_nvfp4_and_a_shared_expert():
    moe = probe.synthetic_moe(jax.random.key(0), 2, 1024, 64)
    with pytest.raises(ValueError, match="shared expert"):
        probe.gate_up_layout(moe.__class__(**{**moe.__dict__, "shared_gate": None}))
    with pytest.raises(ValueError, match="sub-steps"):
        probe.parse_variant("q8_st4_s2")


def test_natural_layout_gate_up_equals_layers():
    q = 8
    E, H, inter = 2, 2 * q * nv.STEP_BYTES, 64
    moe = probe.synthetic_moe(jax.random.key(5), E, H, inter)
    b = jax.random.normal(jax.random.key(6), (1, H), jnp.float32).astype(jnp.bfloat16)
    ids = probe.pair_ids(jnp.array([1]), E)
    lay = probe.gate_up_layout(moe, q, natural=True)
    got = probe.emulate_gate_up(nv.x_natural(b, q), ids, *lay, inter=inter, K=H, q=q, natural=True)
    want = probe.ref_gate_up(b, ids, moe)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.8


@pytest.mark.parametrize("norm", [True, False])
def test_in_kernel_top_k_equals_layers_route(norm):
    """select_top_k (the array code the routed kernel runs) against layers.route_from_logits: exact ties between
    experts (equal logits), a correction bias that changes the choice, and the weights' normalisation and scaling."""
    from flint_jax import layers as L
    from flint_jax.config import FlintConfig
    cfg = FlintConfig.flint(n_routed_experts=256, norm_topk_prob=norm, routed_scaling_factor=2.5)
    logits = jax.random.normal(jax.random.key(7), (256,), jnp.float32)
    logits = logits.at[jnp.array([10, 40, 200])].set(3.0)  # a three-way tie at the top
    bias = jnp.zeros((256,), jnp.float32).at[5].set(2.0)  # expert 5 wins by its bias alone
    for b in (bias, jnp.zeros_like(bias)):
        want_ids, want_w = L.route_from_logits(logits, b, cfg)
        ids, weights = probe.select_top_k(logits, b, cfg.num_experts_per_tok, norm, 2.5)
        assert [int(i) for i in ids] == np.asarray(want_ids).tolist()
        np.testing.assert_allclose([float(w) for w in weights()], np.asarray(want_w), rtol=1e-6)
    assert [int(i) for i in ids][:3] == [10, 40, 200]  # ties to the lower index
    assert int(probe.select_top_k(logits, bias, 6, norm, 2.5)[0][0]) == 5


def test_routed_kernel_needs_experts_in_warpgroup_multiples():
    q = 8
    moe = probe.synthetic_moe(jax.random.key(0), 3, 2 * q * nv.STEP_BYTES, 64)
    lay = probe.gate_up_layout(moe, q)
    with pytest.raises(ValueError, match="multiple of 128"):
        probe.mosaic_gate_up(jnp.zeros((8, 128), jnp.bfloat16), (jnp.zeros(3), jnp.zeros(3)), *lay, inter=64,
                             K=2 * q * nv.STEP_BYTES, q=q, route=dict(k=2, norm=True, scaling=1.0))
