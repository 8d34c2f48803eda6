"""NVFP4 weights tiled for the Mosaic GPU kernels (pallas_kernels/mosaic_nvfp4.py): a lossless repack of
`NVFP4Weight`'s bytes into the order in which a warpgroup decodes them into wgmma's register fragment.

The kernel's tensor-core operand A is a [64, 128] BF16 tile per K step of 128 values: 64 rows = R output rows x Q
K-segments (R = 64 / Q; the LM head uses Q = 1). Thread (row m, lane % 4 = j) holds, in register c = 0..15, the
columns 8c + 2j and 8c + 2j + 1, and decodes both from ONE code byte: byte 16j + c of the row's 64-byte step,
low nibble first. With NVFP4Weight's planar halves (byte i = values i and i + K/2), that byte's two values
belong to different 16-value scale groups, so each thread also reads a pair of scale bytes:

    codes   uint8 [N/R * steps/sub * 64, 64 sub]  per (row block i, step t): row m = n Q + s holds code bytes
                                                  s K/(2Q) + 64 t + [0, 64) of output row i R + n (`sub`
                                                  consecutive steps side by side: bigger TMA copies)
    scales  uint8 [N/R * steps * 2, 256]          per (i, t): 512 bytes ordered (n, s, j, e): the scale of group
                                                  e K/32 + s K/(32Q) + 4 t + j (e: the low or high nibbles)
    global_scale float32 []                       as in NVFP4Weight

steps = K / (128 Q). The activations then go in as wgmma's B columns in the matching order (the kernel module's
`x_columns`). `pack` and `unpack` are exact inverses; `unpack` is how the XLA reference reads a tiled weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from flint_jax.nvfp4 import NVFP4Weight

STEP_BYTES = 64  # code bytes per A row per K step: 128 K positions of wgmma's A
ROWS = 64  # wgmma's M: A rows per program


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tiles:
    """An NVFP4 weight [N, K] in the Mosaic kernels' tile order (module docstring)."""
    codes: jax.Array  # uint8 [N/R * steps/sub * 64, 64 sub]
    scales: jax.Array  # uint8 [N/R * steps * 2, 256]
    global_scale: jax.Array  # float32 []
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    q: int = dataclasses.field(metadata=dict(static=True))
    sub: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return int(self.codes.size + self.scales.size + 4)


def dims(N: int, K: int, q: int) -> tuple[int, int]:
    """(row blocks, K steps) of a weight [N, K] in q K-segments; ValueError naming the shape if it does not tile."""
    if q not in (1, 2, 4, 8, 16):
        raise ValueError(f"K segments q={q}: must be a power of two <= 16")
    r = ROWS // q
    if N % r or K % (2 * q * STEP_BYTES):
        raise ValueError(f"NVFP4 weight [{N}, {K}]: the Mosaic tiles need N % {r} == 0 and "
                         f"K % {2 * q * STEP_BYTES} == 0 (q={q})")
    return N // r, K // 2 // q // STEP_BYTES


def default_sub(K: int, q: int = 1) -> int:
    """Steps per TMA copy: 2 where K allows (run DA, docs/BENCHMARKS.md: the LM head 61.7 -> 59.6 us; 4 was slower)."""
    return 2 if (K // (2 * STEP_BYTES * q)) % 2 == 0 else 1


def supports(shape: tuple[int, ...], q: int = 1) -> bool:
    """Whether a 2-D weight of this [N, K] shape tiles (see dims)."""
    if len(shape) != 2:
        return False
    try:
        dims(*shape, q)
    except ValueError:
        return False
    return True


def tile_arrays(w: NVFP4Weight, q: int = 1, sub: int = 1) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of the tile layout (module docstring) from an NVFP4Weight [N, K]."""
    N, half = w.codes.shape
    progs, steps = dims(N, 2 * half, q)
    if steps % sub:
        raise ValueError(f"NVFP4 weight [{N}, {2 * half}]: {steps} K steps do not group by sub={sub}")
    r = ROWS // q
    codes = w.codes.reshape(progs, r, q, steps, STEP_BYTES).transpose(0, 3, 1, 2, 4)
    sb = lax.bitcast_convert_type(w.scales, jnp.uint8).reshape(progs, r, 2, q, steps, 4)  # [i, n, e, s, t, j]
    scales = sb.transpose(0, 4, 1, 3, 5, 2)  # [i, t, n, s, j, e]
    codes = codes.reshape(progs, steps // sub, sub, ROWS, STEP_BYTES).transpose(0, 1, 3, 2, 4)
    return codes.reshape(progs * steps // sub * ROWS, sub * STEP_BYTES), scales.reshape(progs * steps * 2, 256)


def pack(w: NVFP4Weight, q: int = 1, sub: int | None = None) -> NVFP4Tiles:
    """An NVFP4Weight [N, K] (scalar global scale) in the tile layout; lossless (`unpack` inverts it)."""
    if w.codes.ndim != 2 or jnp.ndim(w.global_scale) != 0:
        raise ValueError(f"NVFP4 tiles take one [N, K] weight with a scalar global scale, got codes "
                         f"{tuple(w.codes.shape)} and global scale {tuple(jnp.shape(w.global_scale))}")
    N, K = w.shape
    sub = default_sub(K, q) if sub is None else sub
    codes, scales = tile_arrays(w, q, sub)
    return NVFP4Tiles(codes, scales, jnp.asarray(w.global_scale, jnp.float32), N, K, q, sub)


def unpack(t: NVFP4Tiles) -> NVFP4Weight:
    """The NVFP4Weight that `pack` tiled (bit-identical)."""
    progs, steps = dims(t.n, t.k, t.q)
    r = ROWS // t.q
    codes = t.codes.reshape(progs, steps // t.sub, ROWS, t.sub, STEP_BYTES).transpose(0, 1, 3, 2, 4)
    codes = codes.reshape(progs, steps, r, t.q, STEP_BYTES).transpose(0, 2, 3, 1, 4).reshape(t.n, t.k // 2)
    sb = t.scales.reshape(progs, steps, r, t.q, 4, 2).transpose(0, 2, 5, 3, 1, 4)  # [i, n, e, s, t, j]
    scales = lax.bitcast_convert_type(sb.reshape(t.n, t.k // 16), jnp.float8_e4m3fn)
    return NVFP4Weight(codes, scales, t.global_scale)
