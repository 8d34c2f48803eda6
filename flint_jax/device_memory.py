"""Whether what a run is about to allocate fits the device, said before anything is allocated.

XLA reports an allocation it cannot satisfy inside the first program that needs it (RESOURCE_EXHAUSTED, after a
long buffer-assignment dump), by which time a benchmark may have spent minutes building other weights. The scripts
know the sizes beforehand: Flint's weights (`params.weight_bytes_total`: 22.9 GB NVFP4, 79.4 GB BF16), the
stacking headroom (`layer_stack.MAX_CHUNK_BYTES`) and the KV state (`state.state_bytes`). So they ask first:

    why = model_shortfall(cfg, "bf16", stacking=True)
    if why: skip, and say why     # BF16 Flint on an H100: 81.6 GB against XLA's ~78 GB

The limit is the allocator's (`Device.memory_stats()["bytes_limit"]`: the GPU's memory times
XLA_PYTHON_CLIENT_MEM_FRACTION), lowered to $FLINT_MEMORY_LIMIT_GB where that is set (a GPU shared with other
processes). Where neither says (the CPU), everything is taken to fit.
"""

from __future__ import annotations

import os

import jax

LIMIT_ENV = "FLINT_MEMORY_LIMIT_GB"


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def memory_limit(device=None) -> int | None:
    """Bytes the device's allocator may hand out (at most $FLINT_MEMORY_LIMIT_GB), or None where nothing says."""
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats()
    limits = [stats["bytes_limit"]] if stats and "bytes_limit" in stats else []
    if os.environ.get(LIMIT_ENV):
        try:
            limits.append(int(float(os.environ[LIMIT_ENV]) * 1e9))
        except ValueError:
            raise ValueError(f"${LIMIT_ENV} must be a number of GB, not {os.environ[LIMIT_ENV]!r}") from None
    return min(limits) if limits else None


def shortfall(need_bytes: int, what: str, device=None, limit: int | None = None) -> str | None:
    """None when `need_bytes` fit under the device's limit (or `limit`, if given); otherwise a message that names
    what does not fit, both sizes and the device."""
    device = device if device is not None else jax.devices()[0]
    limit = memory_limit(device) if limit is None else limit
    if limit is None or need_bytes <= limit:
        return None
    return (f"{what} need {_size(need_bytes)}, more than the {_size(limit)} that may be allocated on this "
            f"{device.device_kind} (its memory times XLA_PYTHON_CLIENT_MEM_FRACTION, or ${LIMIT_ENV})")


def model_shortfall(cfg, weights: str, *, batch: int = 0, max_len: int = 0, kv_dtype: str = "bf16",
                    stacking: bool = False, device=None, limit: int | None = None) -> str | None:
    """shortfall() for a model of `cfg` in `weights` ('nvfp4' or 'bf16'), with `batch` sequences' KV state of
    `max_len` tokens, and, with `stacking`, the one chunk of headroom that `layer_stack.stack_layers` needs."""
    from flint_jax.layer_stack import MAX_CHUNK_BYTES
    from flint_jax.params import weight_bytes_total
    from flint_jax.state import state_bytes
    weight_bytes = weight_bytes_total(cfg, weights)
    parts = [(f"{weights} weights", weight_bytes)]
    if stacking:
        parts.append(("one stacking chunk", min(MAX_CHUNK_BYTES, weight_bytes)))
    if batch:
        parts.append((f"the KV state of {batch} x {max_len} tokens", state_bytes(cfg, batch, max_len, kv_dtype)))
    what = parts[0][0] if len(parts) == 1 else " + ".join(f"{name} ({_size(n)})" for name, n in parts)
    return shortfall(sum(n for _, n in parts), what, device, limit)
