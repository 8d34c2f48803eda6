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
