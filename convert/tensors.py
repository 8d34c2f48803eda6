"""Host-side values of one weight: casting to the Params dtype, changing format, checking, reading bytes.

A value is a numpy array (in the entry's Params dtype: bf16, or f32 for router, sinks and bias) or an
`NVFP4Weight` of numpy arrays (linear weights only). Everything here works on one tensor at a time.
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

import ml_dtypes
import numpy as np

from flint_jax import nvfp4
from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.names import Entry
from flint_jax.nvfp4 import NVFP4Weight

BF16 = np.dtype(ml_dtypes.bfloat16)
F8 = np.dtype(ml_dtypes.float8_e4m3fn)

# Exponent-all-ones masks: a float whose bits & mask == mask is an inf or a NaN.
_NONFINITE = {np.dtype(np.float32): (np.uint32, 0x7F800000), np.dtype(np.float16): (np.uint16, 0x7C00),
              BF16: (np.uint16, 0x7F80)}


def check_finite(x: np.ndarray, file, tensor: str) -> None:
    """Refuse inf/NaN in a float tensor (a corrupted file, usually), naming the first bad element."""
    spec = _NONFINITE.get(x.dtype)
    if spec is None:
        return
    view, mask = spec
    flat = x.reshape(-1).view(view)
    step = 1 << 24  # chunks: the temporaries stay small next to a 600 MB embedding
    for c in range(0, flat.size, step):
        bad = (flat[c:c + step] & view(mask)) == view(mask)
        if bad.any():
            i = c + int(np.flatnonzero(bad)[0])
            idx = np.unravel_index(i, x.shape) if x.ndim else ()
            raise CheckpointError(file, f"non-finite value {x.reshape(-1)[i]} at index "
                                        f"{tuple(int(j) for j in idx)}", tensor)


def cast(entry: Entry, x: np.ndarray, global_scale: np.ndarray | None = None) -> np.ndarray:
    """An array in the entry's Params dtype. A global scale on a non-NVFP4 tensor multiplies in FP32 first (then
    rounds once to the Params dtype)."""
    if global_scale is not None and np.any(global_scale != 1.0):
        lead = global_scale.reshape(global_scale.shape + (1,) * (x.ndim - global_scale.ndim))
        x = x.astype(np.float32) * lead
    return x.astype(entry.dtype, copy=False)


def from_nvfp4(entry: Entry, w: NVFP4Weight) -> np.ndarray | NVFP4Weight:
    """An NVFP4 value for `entry`: kept for a linear weight, else dequantized (FP32, global scale applied) and cast."""
    if entry.linear:
        return w
    return cast(entry, nvfp4.dequantize_np(w))


def to_format(entry: Entry, value, weights: str | None):
    """Change a value's format: weights None keeps it; "bf16" dequantizes NVFP4 (values times global scale, rounded
    to BF16 once: exact when the global scale is a power of two); "nvfp4" quantizes a linear array (ggml rounding
    with a power-of-two global scale per tensor or per expert, see nvfp4.quantize)."""
    if weights is None:
        return value
    if weights == "bf16":
        return cast(entry, nvfp4.dequantize_np(value)) if isinstance(value, NVFP4Weight) else value
    if weights == "nvfp4":
        if entry.linear and not isinstance(value, NVFP4Weight):
            return nvfp4.quantize(value, global_scale="pow2")
        return value
    raise ValueError(f"weights must be None, 'bf16' or 'nvfp4', got {weights!r}")


def arrays(value) -> dict[str, np.ndarray]:
    """The arrays a value is stored as: {"": array} or {"codes", "scales", "global_scale"}."""
    if isinstance(value, NVFP4Weight):
        return {"codes": value.codes, "scales": value.scales, "global_scale": value.global_scale}
    return {"": value}


def nbytes(value) -> int:
    return sum(int(np.asarray(a).nbytes) for a in arrays(value).values())


def read_bytes(f: BinaryIO, offset: int, n: int, file, tensor: str, out: np.ndarray | None = None) -> np.ndarray:
    """n bytes at `offset` into a fresh uint8 array, or into `out` (any contiguous array of n bytes), returned as
    uint8. A private buffer, not a memory map: RSS then counts exactly the tensors in flight, and the file's pages
    stay in the page cache where the kernel can drop them."""
    buf = np.empty(n, np.uint8) if out is None else out.reshape(-1).view(np.uint8)
    if buf.size != n:
        raise ValueError(f"buffer of {buf.size} bytes for {n}")
    f.seek(offset)
    got = f.readinto(memoryview(buf))
    if got != n:
        raise CheckpointError(file, f"file is truncated: needs bytes {offset}..{offset + n} but has "
                                    f"{os.fstat(f.fileno()).st_size}", tensor)
    return buf


def sha256(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))).hexdigest()
