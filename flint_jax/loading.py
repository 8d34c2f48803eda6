"""`flint_jax.load`: a Flint checkpoint (GGUF file, Hugging Face directory, or converted Orbax directory) to a
config and parameters on the devices. The implementation lives with the formats in `flint_jax.convert`."""

from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.load import LoadedModel, load

__all__ = ["CheckpointError", "LoadedModel", "load"]
