"""NVFP4 weights in the kernel layout: the one place that knows how the bits are arranged.

A linear weight `W [..., N, K]` (torch layout, `y = x @ W.T`) in NVFP4 is three arrays:

    codes        uint8          [..., N, K // 2]   two 4-bit E2M1 codes per byte, "planar halves":
                                                  byte i of a row holds value i (low nibble) and
                                                  value i + K/2 (high nibble)
    scales       float8_e4m3fn  [..., N, K // 16]  one positive E4M3 scale per 16 consecutive values
    global_scale float32        [...]              per tensor ([] or [E] for stacked experts)

    value(n, k) = E2M1(code(n, k)) * scales[n, k // 16]          (exact in BF16)
    y = bf16(f32acc(x @ value.T) * global_scale)                 (FLINT_SPEC section 2)

Why planar halves: a kernel that streams a K-tile of `BK/2` bytes from column `c` needs x at two contiguous
ranges, `x[c : c + BK/2]` and `x[K/2 + c : K/2 + c + BK/2]`, for any tile size, with no shuffle in registers.
docs/NVFP4_LAYOUT.md has the byte-level picture and the mapping from GGUF's block layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16  # values per E4M3 scale
GGUF_BLOCK = 64  # values per GGUF NVFP4 block (36 bytes: 4 scale bytes + 32 code bytes)

# E2M1 code -> value. Bit 3 is the sign; bits 2-1 the exponent; bit 0 the mantissa.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    codes: jax.Array  # uint8 [..., N, K // 2]
    scales: jax.Array  # float8_e4m3fn [..., N, K // 16]
    global_scale: jax.Array  # float32 [...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape of the weight."""
        *lead, n, half = self.codes.shape
        return (*lead, n, 2 * half)

    @property
    def nbytes(self) -> int:
        return int(self.codes.size + self.scales.size + 4 * self.global_scale.size)


def check_shape(shape: tuple[int, ...], what: str = "weight") -> None:
    if len(shape) < 2 or shape[-1] % GGUF_BLOCK:
        raise ValueError(f"{what}: NVFP4 needs a row length that is a multiple of {GGUF_BLOCK}, got shape {shape}")


def pack_codes(codes: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """4-bit codes [..., N, K] (one per uint8) -> planar-halves bytes [..., N, K // 2]."""
    half = codes.shape[-1] // 2
    lo, hi = codes[..., :half], codes[..., half:]
    return (lo & 0xF) | ((hi & 0xF) << 4)


def unpack_codes(packed: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """Planar-halves bytes [..., N, K // 2] -> 4-bit codes [..., N, K] (one per uint8)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    return xp.concatenate([packed & 0xF, packed >> 4], axis=-1)


def dequantize(w: NVFP4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Values E2M1 x E4M3 as `dtype` [..., N, K], without the global scale (exact in BF16)."""
    codes = unpack_codes(w.codes)
    vals = jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32)]
    scales = jnp.repeat(w.scales.astype(jnp.float32), BLOCK, axis=-1)
    return (vals * scales).astype(dtype)


def dequantize_f32(w: NVFP4Weight) -> jax.Array:
    """Values including the global scale, in FP32: what an NVFP4 tensor means as a real matrix."""
    gs = jnp.asarray(w.global_scale, jnp.float32)[..., None, None]
    return dequantize(w, jnp.float32) * gs


def random(key: jax.Array, shape: tuple[int, ...], std: float = 0.02) -> NVFP4Weight:
    """Random NVFP4 weight whose values have roughly standard deviation `std` (synthetic checkpoints)."""
    check_shape(shape)
    *lead, n, k = shape
    kc, ks = jax.random.split(key)
    codes = jax.random.randint(kc, (*lead, n, k // 2), 0, 256, dtype=jnp.int32).astype(jnp.uint8)
    # E2M1 codes drawn uniformly have std ~3.2; jitter the block scale by up to 2x so scales differ.
    jitter = jax.random.uniform(ks, (*lead, n, k // BLOCK), minval=0.7, maxval=1.4)
    scales = (jitter * (std / 3.2)).astype(jnp.float8_e4m3fn)
    return NVFP4Weight(codes, scales, jnp.ones(tuple(lead), jnp.float32))


def abstract(shape: tuple[int, ...]) -> NVFP4Weight:
    check_shape(shape)
    *lead, n, k = shape
    return NVFP4Weight(jax.ShapeDtypeStruct((*lead, n, k // 2), jnp.uint8),
                       jax.ShapeDtypeStruct((*lead, n, k // BLOCK), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct(tuple(lead), jnp.float32))
