"""Shared numeric assertions for kernel tests: distances in BF16 units in the last place."""
import jax.numpy as jnp
import numpy as np


def bf16_ulps(a, b) -> np.ndarray:
    """|a - b| in BF16 ulps (both rounded to BF16; the ordering of BF16 bit patterns is monotone in value)."""
    def ordered(x):
        i = np.asarray(jnp.asarray(x, jnp.bfloat16).view(jnp.int16)).astype(np.int32)
        return np.where(i < 0, -32768 - i, i)
    return np.abs(ordered(a) - ordered(b))


def assert_bf16_close(out, ref, max_ulp=1, max_frac=0.02, abs_slack=0.0):
    """BF16 outputs within `max_ulp` ulps of the reference, and at most `max_frac` of them differing at all: products
    are exact, so only the FP32 summation order (kernel tiles vs XLA) can move a result across a rounding boundary.
    abs_slack: an output may instead differ by at most this much in absolute terms (for sums that cancel to far
    below their terms' scale, where a summation-order difference of a few FP32 ulps of the terms is many BF16 ulps
    of the result; XLA's own order depends on the host CPU's vector width)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    u = bf16_ulps(out, ref)
    if abs_slack:
        err = np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
        u = np.where(err <= abs_slack, np.minimum(u, max_ulp), u)
    assert u.max() <= max_ulp, f"max {u.max()} BF16 ulps"
    assert np.mean(u > 0) <= max_frac, f"{np.mean(u > 0):.3%} of outputs differ"


def bf16_ulp_size(x) -> np.ndarray:
    """The spacing of BF16 numbers at |x| (8 significant bits), in FP32."""
    a = np.maximum(np.abs(np.asarray(x, np.float32)), np.float32(2.0 ** -126))
    return np.exp2(np.floor(np.log2(a)) - 7).astype(np.float32)


def assert_residual_close(out, ref, residual, max_ulp=1, max_frac=0.02):
    """`residual + bf16(y)` outputs: the kernel's y may sit `max_ulp` BF16 ulps of y from the reference's (FP32
    summation order, as in assert_bf16_close), and the residual add rounds once more. Where residual and y cancel,
    one ulp of y is many ulps of the sum, so the bound is max_ulp * ulp(y) + ulp(sum), with y = ref - residual."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == jnp.bfloat16
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(o))
    y = r - np.asarray(residual, np.float32)
    bound = max_ulp * bf16_ulp_size(y) + bf16_ulp_size(r)
    err = np.abs(o - r)
    assert np.all(err <= bound), f"max error {float((err / bound).max()):.2f} x the bound"
    assert np.mean(err > 0) <= max_frac, f"{np.mean(err > 0):.3%} of outputs differ"
