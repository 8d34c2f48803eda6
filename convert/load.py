"""`load(path)`: the one entry point from a checkpoint on disk to a config and parameters on the devices.

Accepts a Flint GGUF file (any mix of NVFP4/BF16/F16/F32 tensors), a Hugging Face BF16 directory, or a checkpoint
converted by `flint-convert` (Orbax). GGUF and HF checkpoints stream: one tensor (one expert stack) is read,
repacked and placed at a time, so host memory stays bounded by the largest tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import numpy as np

from flint_jax.config import ConfigError, FlintConfig
from flint_jax.convert import names, orbax_io, tensors
from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.gguf_reader import GGUFCheckpoint
from flint_jax.convert.hf import HFCheckpoint
from flint_jax.convert.names import Entry
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.params import Params


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A loaded checkpoint. `tokenizer_metadata`: for a GGUF, its `tokenizer.*` keys as plain Python values (what
    `FlintTokenizer.from_gguf_metadata` takes, chat template included); for an HF directory,
    {"tokenizer_json": path} when it has one (and "tokenizer.chat_template" from tokenizer_config.json); for a
    converted checkpoint, what its source had."""
    cfg: FlintConfig
    params: Params
    source: str  # absolute path of what was loaded
    tokenizer_metadata: dict[str, Any]
    format: str  # "gguf", "hf" or "orbax"


def resolve_config(config: FlintConfig | dict | str | os.PathLike | None) -> FlintConfig | None:
    """A FlintConfig from a config, a config.json dict, or a path to config.json (or its folder)."""
    if config is None or isinstance(config, FlintConfig):
        return config
    try:
        return FlintConfig.from_hf(config)
    except ConfigError as e:
        raise CheckpointError(None, str(e)) from None


def open_checkpoint(path: str | os.PathLike, config=None) -> GGUFCheckpoint | HFCheckpoint:
    """Open a GGUF file or an HF directory for streaming reads (validated against the config)."""
    p = os.fspath(path)
    cfg = resolve_config(config)
    if os.path.isdir(p):
        if orbax_io.is_orbax_dir(p):
            raise CheckpointError(p, "is already a converted checkpoint (load it with flint_jax.load)")
        if not os.path.isfile(os.path.join(p, "config.json")) and cfg is None:
            raise CheckpointError(p, "not a Flint checkpoint: a directory needs config.json and *.safetensors "
                                     "(Hugging Face) or manifest.json and params/ (converted)")
        return HFCheckpoint(p, cfg)
    if not os.path.exists(p):
        raise CheckpointError(p, "no such file or directory")
    return GGUFCheckpoint(p, cfg)


def fill_absent(ck, entry: Entry):
    """The value of an optional weight the checkpoint lacks: zero router bias, or the tied embedding."""
    if entry.kind == "bias":
        return np.zeros(entry.shape, entry.dtype)
    if entry.path == "lm_head":
        embed = next(e for e in ck.entries if e.path == "embed")
        return tensors.cast(entry, ck.read(embed)[0])
    raise AssertionError(entry.path)


def _placer(device, sharding) -> Callable[[str, Any], Any]:
    """(name, host array) -> jax.Array on the device(s)."""
    import jax
    if device is not None and sharding is not None:
        raise ValueError("pass device or sharding, not both")
    if device is not None:
        sharding = jax.sharding.SingleDeviceSharding(device)

    def place(name: str, x: np.ndarray):
        if sharding is None:
            return jax.device_put(x)
        sh = sharding(name, jax.ShapeDtypeStruct(x.shape, x.dtype)) if callable(sharding) else sharding
        return jax.device_put(x, sh)
    return place


def _place_value(place, path: str, v):
    if isinstance(v, NVFP4Weight):
        return NVFP4Weight(place(f"{path}.codes", v.codes), place(f"{path}.scales", v.scales),
                           place(f"{path}.global_scale", np.asarray(v.global_scale, np.float32)))
    return place(path, v)


def load(path: str | os.PathLike, config: FlintConfig | dict | str | os.PathLike | None = None,
         weights: str | None = None, device=None, sharding=None) -> LoadedModel:
    """Load a Flint checkpoint: a GGUF file, an HF BF16 directory, or a converted (Orbax) directory.

    config: overrides the checkpoint's own (FlintConfig, config.json dict or path). For a GGUF, metadata that
        contradicts it is an error and keys the file lacks come from it; an HF directory's tensors are checked
        against it; a converted checkpoint must have been made with the same config.
    weights: None keeps each linear weight as stored (NVFP4 stays NVFP4 in the kernel layout); "bf16"
        dequantizes NVFP4; "nvfp4" quantizes BF16 linears (ggml's rounding, power-of-two global scales).
    device / sharding: where arrays go (default device if neither). `sharding` is a jax Sharding for every array
        or a function (name, ShapeDtypeStruct) -> Sharding, names like "layers.3.attn.q.codes" or "embed"."""
    if weights not in (None, "bf16", "nvfp4"):
        raise ValueError(f"weights must be None, 'bf16' or 'nvfp4', got {weights!r}")
    p = os.path.abspath(os.fspath(path))
    cfg = resolve_config(config)
    place = _placer(device, sharding)
    if os.path.isdir(p) and orbax_io.is_orbax_dir(p):
        return _load_orbax(p, cfg, weights, place, device, sharding)
    with open_checkpoint(p, cfg) as ck:
        values = {}
        present = {e.path for e in ck.entries}
        for e in names.entries(ck.cfg):
            v = ck.read(e)[0] if e.path in present else fill_absent(ck, e)
            values[e.path] = _place_value(place, e.path, tensors.to_format(e, v, weights))
        params = names.assemble(ck.cfg, values)
        return LoadedModel(ck.cfg, params, p, dict(ck.tokenizer_metadata), ck.format)


def _load_orbax(p: str, cfg: FlintConfig | None, weights, place, device, sharding) -> LoadedModel:
    import jax
    try:
        manifest = orbax_io.read_manifest(p)
        stored = FlintConfig.from_hf(os.path.join(p, orbax_io.CONFIG))
    except (ValueError, OSError) as e:
        raise CheckpointError(p, f"unreadable converted checkpoint ({e})") from None
    if cfg is not None and cfg != stored:
        diff = [f.name for f in dataclasses.fields(FlintConfig) if getattr(cfg, f.name) != getattr(stored, f.name)]
        raise CheckpointError(p, f"was converted with a different config ({', '.join(diff)} differ)")
    want = {e.path for e in names.entries(stored)}
    have = {t["path"] for t in manifest["tensors"]}
    if want != have:
        bad = sorted(want ^ have)[0]
        raise CheckpointError(p, "missing from the manifest" if bad in want else "in the manifest but not in Flint",
                              bad)
    if device is not None:
        sharding = jax.sharding.SingleDeviceSharding(device)
    sharding_for = None if sharding is None else (sharding if callable(sharding) else (lambda n, s: sharding))
    try:
        values = orbax_io.restore(p, manifest, sharding_for)
    except Exception as e:
        raise CheckpointError(os.path.join(p, orbax_io.PARAMS), f"Orbax restore failed ({type(e).__name__}: {e})") \
            from None
    if weights is not None:
        for e in names.entries(stored):
            v = values[e.path]
            host = NVFP4Weight(*(np.asarray(a) for a in (v.codes, v.scales, v.global_scale))) \
                if isinstance(v, NVFP4Weight) else None
            if (weights == "bf16" and host is not None) or (weights == "nvfp4" and e.linear and host is None):
                values[e.path] = _place_value(place, e.path, tensors.to_format(e, host or np.asarray(v), weights))
    tok = {}
    tpath = os.path.join(p, orbax_io.TOKENIZER)
    if os.path.isfile(tpath):
        with open(tpath, encoding="utf-8") as f:
            tok = json.load(f)
        if "tokenizer_json" in tok:
            tok["tokenizer_json"] = os.path.join(p, tok["tokenizer_json"])
    return LoadedModel(stored, names.assemble(stored, values), p, tok, "orbax")
