"""flint-jax: Flint (a 40B mixture-of-experts LLM) inference in JAX with Pallas GPU kernels."""

import os as _os

# FLINT_SPEC section 2 defines BF16 rounding points. XLA may otherwise keep fused intermediates in FP32
# ("excess precision"), which makes results depend on fusion decisions: a chunked prefill would then differ from a
# one-shot forward. This must be set before JAX creates its backends; set XLA_FLAGS yourself to override.
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
    try:  # too late if JAX already started a backend in this process: say so instead of failing silently
        from jax._src import xla_bridge as _xb
        if _xb._backends:
            import warnings as _warnings
            _warnings.warn("flint_jax was imported after JAX started its backends, so XLA may skip BF16 rounding "
                           "points (results then depend on fusion). Import flint_jax first, or set "
                           "XLA_FLAGS=--xla_allow_excess_precision=false before starting Python.", stacklevel=2)
    except ImportError:  # a JAX without that private module: nothing to check
        pass

# In a plain source checkout on sys.path (no `pip install -e .`, e.g. the GPU machine), the folders pallas_kernels/
# and convert/ beside this package still import as flint_jax.pallas_kernels and flint_jax.convert. When the package
# is installed, its import mapping takes precedence and this entry is never consulted.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_checkout, "pallas_kernels")):
    __path__.append(_checkout)  # noqa: F821  (the package's own search path)

from flint_jax.config import FlintConfig  # noqa: E402



def load(path, config=None, weights=None, device=None, sharding=None):
    """Load a Flint checkpoint: a GGUF file (NVFP4/BF16/F16/F32 tensors), a Hugging Face BF16 directory, or a
    directory written by `flint-convert`. Returns a `flint_jax.model.Model` (cfg, params, tokenizer).

    config: a FlintConfig, config.json dict or path that overrides the checkpoint's own (contradictions are errors).
    weights: None keeps each weight as stored; "bf16" dequantizes NVFP4; "nvfp4" quantizes BF16 linear layers.
    device / sharding: where the arrays go (see flint_jax.convert.load.load)."""
    from flint_jax.loading import load as load_checkpoint
    from flint_jax.model import Model
    loaded = load_checkpoint(path, config=config, weights=weights, device=device, sharding=sharding)
    return Model(loaded.cfg, loaded.params, loaded.source, dict(loaded.tokenizer_metadata))


__all__ = ["FlintConfig", "load"]
__version__ = "0.1.0"
