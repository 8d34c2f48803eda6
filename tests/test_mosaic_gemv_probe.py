"""The Mosaic GPU GEMVs of scripts/probe_mosaic_gemv.py in the Mosaic GPU interpreter on the CPU, against
layers.linear: the arithmetic of the probe that decides the decode kernels' port (docs/DECODE_PATH.md)."""
import os
import sys

import flint_jax  # noqa: F401  (XLA flags first)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from flint_jax import layers as L
from flint_jax import nvfp4

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import probe_mosaic_gemv as probe  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the interpreter path; the GPU runs the probe")


def test_nvfp4_gemv_equals_linear():
    """Two row tiles, two K splits, two steps per split; negative and subnormal scales, a global scale."""
    N, K = 128, 2048
    w = nvfp4.random(jax.random.key(0), (N, K), 0.05)
    scales = w.scales.astype(jnp.float32).at[0, :8].set(2.0 ** -8).at[1, 3].multiply(-1)  # subnormal E4M3, sign
    w = nvfp4.NVFP4Weight(w.codes, scales.astype(w.scales.dtype), jnp.float32(0.75))
    x = jax.random.normal(jax.random.key(1), (1, K), jnp.float32).astype(jnp.bfloat16)
    got = probe.mosaic_linear_nvfp4(x, w, splits=2, interpret=InterpretGPUParams())
    want = L.linear(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2 ** -8 * float(jnp.abs(want.astype(jnp.float32)).max()))


def test_e2m1_and_e4m3_decoders_cover_every_code():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(probe._e2m1_times_2(codes)) / 2, np.asarray(nvfp4.E2M1_VALUES))
    b = jnp.arange(256, dtype=jnp.int32)
    want = np.asarray(jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32))
    got = np.asarray(probe._e4m3(b))
    finite = np.isfinite(want)  # 0x7f / 0xff are NaN in E4M3FN
    np.testing.assert_array_equal(got[finite], want[finite])
