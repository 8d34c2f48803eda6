"""flint-jax: Flint (a 40B mixture-of-experts LLM) inference in JAX with Pallas GPU kernels."""

import os as _os

# FLINT_SPEC section 2 defines BF16 rounding points. XLA may otherwise keep fused intermediates in FP32
# ("excess precision"), which makes results depend on fusion decisions: a chunked prefill would then differ from a
# one-shot forward. This must be set before JAX creates its backends; set XLA_FLAGS yourself to override.
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

from flint_jax.config import FlintConfig  # noqa: E402

__all__ = ["FlintConfig"]
__version__ = "0.1.0"
