"""The converted checkpoint: an Orbax tree in the kernel layout, plus config, manifest and tokenizer metadata.

    DST/config.json               the model config (HF keys, FLINT_SPEC section 3)
    DST/manifest.json             every weight: arrays (dtype, shape) and its source tensors (name, file, sha256)
    DST/tokenizer_metadata.json   GGUF tokenizer.* keys, or {"tokenizer_json": "tokenizer.json", ...} for HF
    DST/params/                   Orbax (v1) checkpoint of a nested dict mirroring the Params paths:
                                  {"layers": {"3": {"attn": {"q": {"codes", "scales", "global_scale"}}}}, ...}

Writing streams: values are buffered up to `buffer_bytes` and appended with Orbax's partial save, then finalized
once, so the whole model is never in memory. Reading restores the whole tree at once, straight to the devices
(each array placed by the given sharding), in the dtypes it was written with.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

import numpy as np

from flint_jax.convert import tensors
from flint_jax.nvfp4 import NVFP4Weight

PARAMS = "params"
MANIFEST = "manifest.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer_metadata.json"
FORMAT = "flint-jax-orbax"
VERSION = 1


def _nest(tree: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    if isinstance(value, NVFP4Weight):
        value = {"codes": value.codes, "scales": value.scales, "global_scale": value.global_scale}
    tree[last] = value


def _get(tree: dict, path: str):
    for p in path.split("."):
        tree = tree[p]
    return tree


def array_specs(value) -> dict[str, dict]:
    """{"": {dtype, shape}} or {"codes": ..., "scales": ..., "global_scale": ...} for the manifest."""
    return {k: {"dtype": np.dtype(np.asarray(a).dtype).name, "shape": list(np.shape(a))}
            for k, a in tensors.arrays(value).items()}


class _QuietOrbax:
    """Orbax logs a warning for every partial save (its temp directory already exists: expected here)."""

    def __enter__(self):
        self.logger = logging.getLogger("absl")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


class OrbaxWriter:
    """Appends weights to an Orbax checkpoint at `path` (which must not exist), a buffer at a time."""

    def __init__(self, path: str, buffer_bytes: int = 256 << 20):
        import orbax.checkpoint.experimental.v1 as ocp
        self._ocp = ocp
        self.path = path
        self.buffer_bytes = buffer_bytes
        self._tree: dict = {}
        self._size = 0
        self.written = 0

    def add(self, path: str, value) -> None:
        n = tensors.nbytes(value)
        if self._size and self._size + n > self.buffer_bytes:
            self.flush()  # a big tensor goes out alone: peak memory is one tensor, not a buffer plus one tensor
        _nest(self._tree, path, value)
        self._size += n
        if self._size >= self.buffer_bytes:
            self.flush()

    def _context(self):
        # No compression: NVFP4 codes and BF16 weights barely compress, zstd would hold a second encoded copy of
        # each array while it writes, and loading would have to decode. (No chunk_byte_size either: Orbax splits
        # the largest dimension first, so a [E, N, K] expert stack would be cut along K into strided chunks and
        # gathered through an extra full copy.)
        o = self._ocp.options
        return self._ocp.Context(array_options=o.ArrayOptions(saving=o.ArrayOptions.Saving(use_compression=False)))

    def flush(self) -> None:
        if self._tree:
            with _QuietOrbax(), self._context():
                self._ocp.partial.save(self.path, self._tree)
            self.written += self._size
            self._tree, self._size = {}, 0

    def finalize(self) -> None:
        self.flush()
        with _QuietOrbax(), self._context():
            self._ocp.partial.finalize(self.path)


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    with open(mpath, encoding="utf-8") as f:
        m = json.load(f)
    if m.get("format") != FORMAT:
        raise ValueError(f"{mpath}: not a flint-jax converted checkpoint (format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise ValueError(f"{mpath}: manifest version {m.get('version')!r}, this flint-jax reads {VERSION}")
    return m


def is_orbax_dir(path: str | os.PathLike) -> bool:
    p = os.fspath(path)
    return os.path.isfile(os.path.join(p, MANIFEST)) and os.path.isdir(os.path.join(p, PARAMS))


def restore(path: str, manifest: dict, sharding_for: Callable[[str, Any], Any] | None) -> dict[str, Any]:
    """{param path: jax value} from DST/params, each array placed by `sharding_for(name, ShapeDtypeStruct)`
    (name like "layers.3.attn.q.codes"), or on the default device when None."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint.experimental.v1 as ocp

    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract: dict = {}
    for t in manifest["tensors"]:
        specs = {}
        for k, a in t["arrays"].items():
            sds = jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]))
            name = f"{t['path']}.{k}" if k else t["path"]
            sh = sharding_for(name, sds) if sharding_for is not None else default
            specs[k] = jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sh)
        _nest(abstract, t["path"], specs[""] if "" in specs else NVFP4Weight(**specs))
    with _QuietOrbax():
        tree = ocp.load(os.path.join(path, PARAMS), abstract)
    out = {}
    for t in manifest["tensors"]:
        v = _get(tree, t["path"])
        out[t["path"]] = NVFP4Weight(**v) if isinstance(v, dict) else v
    return out
