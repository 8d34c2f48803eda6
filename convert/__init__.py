"""Checkpoints in and out: GGUF (NVFP4/BF16/F16/F32), Hugging Face BF16 safetensors, and the converted Orbax form.

    load(path, config=None, weights=None, device=None, sharding=None) -> LoadedModel
    convert(src, dst, config=None, quantize=None, overwrite=False)  -> ConvertSummary   (`flint-convert`)
    write_gguf(path, cfg, params, weights=None, tokenizer_metadata=None, chat_template=None)
    write_hf(path, cfg, params, max_shard_bytes=None)

Names live in `names`, NVFP4 bytes in `flint_jax.nvfp4`; docs/CHECKPOINTS.md and docs/NVFP4_LAYOUT.md describe the
formats. Orbax is imported only when a converted checkpoint is written or read.
"""

from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.gguf_writer import write_gguf
from flint_jax.convert.hf import write_hf
from flint_jax.convert.load import LoadedModel, load
from flint_jax.convert.to_orbax import ConvertSummary, convert

__all__ = ["CheckpointError", "ConvertSummary", "LoadedModel", "convert", "load", "write_gguf", "write_hf"]
