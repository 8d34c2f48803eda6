"""Shared numeric assertions for kernel tests: distances in BF16 units in the last place."""
import jax.numpy as jnp
import numpy as np


def bf16_ulps(a, b) -> np.ndarray:
    """|a - b| in BF16 ulps (both rounded to BF16; the ordering of BF16 bit patterns is monotone in value)."""
    def ordered(x):
        i = np.asarray(jnp.asarray(x, jnp.bfloat16).view(jnp.int16)).astype(np.int32)
        return np.where(i < 0, -32768 - i, i)
    return np.abs(ordered(a) - ordered(b))


def assert_bf16_close(out, ref, max_ulp=1, max_frac=0.02):
    """BF16 outputs within `max_ulp` ulps of the reference, and at most `max_frac` of them differing at all: products
    are exact, so only the FP32 summation order (kernel tiles vs XLA) can move a result across a rounding boundary."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    u = bf16_ulps(out, ref)
    assert u.max() <= max_ulp, f"max {u.max()} BF16 ulps"
    assert np.mean(u > 0) <= max_frac, f"{np.mean(u > 0):.3%} of outputs differ"
