"""Synthetic weights of any shape, produced one tensor at a time (for full-shape benchmark checkpoints).

`synthetic_values(cfg, weights, seed)` is a producer `entry -> value` for `write_gguf` / `write_hf`: each tensor is
drawn from a generator seeded by (seed, path), so a tensor does not depend on the others and the whole model is
never in memory. Scales follow `params.init_params` (linear std 1/sqrt(fan_in), norms near 1, ...).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import numpy as np

from flint_jax.config import FlintConfig
from flint_jax.convert import tensors
from flint_jax.convert.names import Entry
from flint_jax.nvfp4 import BLOCK, NVFP4Weight

_ROWS_PER_DRAW = 1 << 22  # values per draw: bounds the FP32 temporaries


def _normal_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    out = np.empty(shape, tensors.BF16)
    flat = out.reshape(-1, shape[-1])
    step = max(1, _ROWS_PER_DRAW // shape[-1])
    for r in range(0, flat.shape[0], step):
        x = rng.standard_normal((min(step, flat.shape[0] - r), shape[-1]), dtype=np.float32)
        flat[r:r + step] = (x * np.float32(std) + np.float32(mean)).astype(tensors.BF16)
    return out


def synthetic_values(cfg: FlintConfig, weights: str = "bf16", seed: int = 0) -> Callable[[Entry], object]:
    """Producer of random weights: linear weights BF16 or NVFP4 (random codes, E4M3 block scales around
    std / 3.2, global scale 1.0), everything else in its Params dtype."""
    if weights not in ("bf16", "nvfp4"):
        raise ValueError(f"weights must be 'bf16' or 'nvfp4', got {weights!r}")

    def value(e: Entry):
        rng = np.random.default_rng([seed, zlib.crc32(e.path.encode())])
        if e.kind == "linear":
            std = 1.0 / math.sqrt(e.shape[-1])
            if weights == "bf16":
                return _normal_bf16(rng, e.shape, std)
            *lead, n, k = e.shape
            codes = rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)
            jitter = rng.uniform(0.7, 1.4, (*lead, n, k // BLOCK)).astype(np.float32)
            scales = (jitter * np.float32(std / 3.2)).astype(tensors.F8)
            return NVFP4Weight(codes, scales, np.ones(tuple(lead), np.float32))
        if e.kind == "embed":
            return _normal_bf16(rng, e.shape, 1.0)
        if e.kind == "norm":
            return _normal_bf16(rng, e.shape, 0.1, 1.0)
        x = rng.standard_normal(e.shape, dtype=np.float32)
        scale = {"sink": 1.0, "router": 1.0 / math.sqrt(e.shape[-1]), "bias": 0.1}[e.kind]
        return (x * np.float32(scale)).astype(e.dtype)
    return value
