"""scripts/probe_mosaic_nvfp4.py on the CPU: its weight and x layouts and its per-thread decode (emulated in NumPy,
bit for bit) give layers.linear. The kernel itself (inline PTX, no interpreter) runs on the GPU in the probe."""
import os
import sys

import flint_jax  # noqa: F401  (XLA flags first)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layers as L
from flint_jax import nvfp4

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import probe_mosaic_nvfp4 as probe  # noqa: E402


def test_byte_decode_gives_every_code_pair():
    """The decode's integer part: bf16 pattern x 2^126 = E2M1 of each nibble, for all 256 code bytes."""
    for b in range(256):
        lo, hi = (v * 2.0 ** 126 for v in probe.decoded_byte(b))
        assert (lo, hi) == (nvfp4.E2M1_VALUES[b & 15], nvfp4.E2M1_VALUES[b >> 4]), b
        assert np.signbit(lo) == bool(b & 8) and np.signbit(hi) == bool(b & 0x80), b


@pytest.mark.parametrize("q", [4, 8, 16])
def test_layouts_and_decode_equal_linear(q):
    """Two programs, two pipeline steps each; a subnormal and a negative block scale, a global scale != 1."""
    N, K = 2 * (64 // q), 2 * q * probe.STEP_BYTES * 2
    w = nvfp4.random(jax.random.key(0), (N, K), 0.05)
    scales = w.scales.astype(jnp.float32).at[0, :4].set(2.0 ** -8).at[1, 3].multiply(-1)
    w = nvfp4.NVFP4Weight(w.codes, scales.astype(w.scales.dtype), jnp.float32(0.75))
    x = jax.random.normal(jax.random.key(1), (1, K), jnp.float32).astype(jnp.bfloat16)
    codes_m, scales_m = probe.mosaic_layout(w, q)
    got = probe.emulate(probe.x_columns(x, q), codes_m, scales_m, 0.75, N, K, q)
    want = np.asarray(L.linear(x, w), np.float32)[0]
    # FP32 sums in another order than the reference's: at most one BF16 rounding step apart
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("q", [8, 16])
def test_natural_layout_takes_x_as_written(q):
    """natural_layout: x is a free reshape of the producer's [1, K] (no column copy); the 2^63 that the decode's
    scales carry moves into the global scale. Same weight quirks as above."""
    N, K = 2 * (64 // q), 2 * q * probe.STEP_BYTES * 2
    w = nvfp4.random(jax.random.key(0), (N, K), 0.05)
    scales = w.scales.astype(jnp.float32).at[0, :4].set(2.0 ** -8).at[1, 3].multiply(-1)
    w = nvfp4.NVFP4Weight(w.codes, scales.astype(w.scales.dtype), jnp.float32(0.75))
    x = jax.random.normal(jax.random.key(1), (1, K), jnp.float32).astype(jnp.bfloat16)
    codes_m, scales_m, gs = probe.natural_layout(w, q)
    xb = probe.x_natural(x, q)
    np.testing.assert_array_equal(np.asarray(xb).reshape(-1), np.asarray(x).reshape(-1))
    assert float(gs[0]) == 0.75 * 2.0 ** 63
    got = probe.emulate(xb, codes_m, scales_m, float(gs[0]), N, K, q, natural=True)
    want = np.asarray(L.linear(x, w), np.float32)[0]
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.9
    # the repack is lossless: every code nibble and scale byte lands once
    np.testing.assert_array_equal(np.sort(np.asarray(nvfp4.unpack_codes(codes_m)).reshape(-1)),
                                  np.sort(np.asarray(nvfp4.unpack_codes(w.codes)).reshape(-1)))
    assert sorted(np.asarray(scales_m).reshape(-1).tolist()) == sorted(
        np.asarray(jax.lax.bitcast_convert_type(w.scales, jnp.uint8)).reshape(-1).tolist())
    with pytest.raises(ValueError, match="q >= 8"):
        probe.x_natural(x, 4)


def test_layout_rejects_shapes_that_do_not_tile():
    w = nvfp4.random(jax.random.key(0), (24, 1024), 0.05)
    with pytest.raises(ValueError, match="N % 16"):
        probe.mosaic_layout(w, 4)
    with pytest.raises(ValueError, match="K % 2048"):
        probe.mosaic_layout(w, 16)


def test_grouped_steps_put_consecutive_tiles_side_by_side():
    """mosaic_layout(sub=2): pipeline step T holds steps 2T and 2T+1's [64, 64] code tiles as columns 0-63, 64-127."""
    q, N, K = 8, 16, 2 * 8 * probe.STEP_BYTES * 4  # two programs, four steps each
    w = nvfp4.random(jax.random.key(3), (N, K), 0.05)
    one, scales_one = (np.asarray(a) for a in probe.mosaic_layout(w, q))
    two, scales_two = (np.asarray(a) for a in probe.mosaic_layout(w, q, sub=2))
    assert two.shape == (one.shape[0] // 2, 2 * probe.STEP_BYTES)
    tiles = one.reshape(-1, 64, probe.STEP_BYTES)  # [(i, t), 64, 64]
    grouped = two.reshape(-1, 64, 2, probe.STEP_BYTES)  # [(i, T), 64, u, 64]
    for T in range(grouped.shape[0]):
        for u in range(2):
            np.testing.assert_array_equal(grouped[T, :, u], tiles[2 * T + u])
    np.testing.assert_array_equal(scales_one, scales_two)
    with pytest.raises(ValueError, match="sub=3"):
        probe.mosaic_layout(w, q, sub=3)


def test_variant_names():
    assert probe.parse_variant("q16_st4_s2_ov") == dict(q=16, stages=4, sub=2, overlap=True, skip_decode=False,
                                                        natural=False)
    assert probe.parse_variant("q8_st4_ov_nat_res")["natural"]
    assert probe.parse_variant("q8_st2_nd")["skip_decode"]
    with pytest.raises(ValueError, match="unknown part"):
        probe.parse_variant("q8_st2_fast")
