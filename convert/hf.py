"""Hugging Face BF16 checkpoints (FLINT_SPEC section 3): config.json + safetensors, sharded or not.

The safetensors format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the tensors' bytes. We parse headers ourselves and read each tensor into a private buffer
(no whole-file memory map, see tensors.read_bytes), and we write it ourselves so that a writer can stream: the
header comes from the config, then tensors are produced one at a time.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any, Callable, Mapping

import numpy as np

from flint_jax.config import ConfigError, FlintConfig
from flint_jax.convert import names, tensors
from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.names import Entry
from flint_jax.params import Params

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"BF16": tensors.BF16, "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}
_NAME_OF = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """({name: {dtype, shape, data_offsets}}, data start) of a safetensors file, checked against its size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, "not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(path, f"not a safetensors file or truncated (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(path, f"corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        try:
            b, e = info["data_offsets"]
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(path, "corrupt safetensors header entry", name) from None
        if start + e > size:
            raise CheckpointError(path, f"file is truncated: the tensor's data needs bytes {start + b}..{start + e} "
                                        f"but the file has {size}", name)
        if dtype in DTYPES and e - b != int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize:
            raise CheckpointError(path, f"header says {dtype} {shape} but gives {e - b} bytes", name)
    return header, start


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = os.fspath(path)
    return os.path.isdir(p) and os.path.isfile(os.path.join(p, "config.json")) and bool(
        glob.glob(os.path.join(p, "*.safetensors")))


class HFCheckpoint:
    """An open HF checkpoint directory. `cfg` is config.json's, or the given `config`; tensors are validated
    against it (missing, extra, shape, dtype) when the checkpoint is opened."""

    format = "hf"

    def __init__(self, path: str | os.PathLike, config: FlintConfig | None = None):
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.path):
            raise CheckpointError(self.path, "not a directory")
        if config is None:
            try:
                config = FlintConfig.from_hf(self.path)
            except ConfigError as e:
                raise CheckpointError(None, str(e)) from None
        self.cfg = config
        self.tokenizer_metadata = self._tokenizer()
        self.where = self._locate()  # name -> (file, dtype, shape, offset, nbytes)
        self.entries = self._validate()
        self._files: dict[str, Any] = {}

    def _tokenizer(self) -> dict:
        out: dict[str, Any] = {}
        tj = os.path.join(self.path, "tokenizer.json")
        if os.path.isfile(tj):
            out["tokenizer_json"] = tj
        tc = os.path.join(self.path, "tokenizer_config.json")
        if os.path.isfile(tc):
            try:
                with open(tc, encoding="utf-8") as f:
                    template = json.load(f).get("chat_template")
            except (json.JSONDecodeError, OSError):
                template = None
            if isinstance(template, str):
                out["tokenizer.chat_template"] = template
        return out

    def _locate(self) -> dict[str, tuple[str, str, tuple[int, ...], int, int]]:
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(index, f"corrupt index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, "*.safetensors")))
            if not files:
                raise CheckpointError(self.path, "no *.safetensors files")
        where = {}
        for fname in files:
            fpath = os.path.join(self.path, fname)
            if not os.path.isfile(fpath):
                raise CheckpointError(index, f"names shard {fname}, which does not exist")
            header, start = read_header(fpath)
            for name, info in header.items():
                if name in where:
                    raise CheckpointError(fpath, f"also in {os.path.basename(where[name][0])}", name)
                b, e = info["data_offsets"]
                where[name] = (fpath, info["dtype"], tuple(int(d) for d in info["shape"]), start + b, e - b)
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in where:
                    raise CheckpointError(os.path.join(self.path, fname), "listed in the index but not in the shard",
                                          name)
        return where

    def _validate(self) -> list[Entry]:
        expected = names.entries(self.cfg)
        known = set()
        present = []
        for e in expected:
            shape = e.shape[1:] if e.experts else e.shape
            found = [n for n in e.hf if n in self.where]
            known.update(e.hf)
            if len(found) < len(e.hf):
                if e.optional and not found:
                    continue
                absent = [n for x in expected for n in x.hf if n not in self.where
                          and not (x.optional and not any(m in self.where for m in x.hf))]
                more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
                raise CheckpointError(self.path, f"missing from the checkpoint{more}", absent[0])
            for n in e.hf:
                fpath, dtype, got, _, _ = self.where[n]
                if dtype not in DTYPES:
                    raise CheckpointError(fpath, f"dtype {dtype} is not supported (BF16, F16 or F32)", n)
                if got != shape:
                    raise CheckpointError(fpath, f"shape {list(got)} disagrees with the config, which needs "
                                                 f"{list(shape)}", n)
            present.append(e)
        extra = sorted(n for n in self.where if n not in known)
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(self.where[extra[0]][0], f"not a tensor of Flint with this config{more}", extra[0])
        return present

    def source_nbytes(self, entry: Entry) -> int:
        return sum(self.where[n][4] for n in entry.hf)

    def _file(self, fpath: str):
        f = self._files.get(fpath)
        if f is None:
            f = self._files[fpath] = open(fpath, "rb")
        return f

    def read(self, entry: Entry, checksums: bool = False):
        """(value, sources) as GGUFCheckpoint.read; an expert stack is assembled from its E tensors."""
        sources = []
        out = np.empty(entry.shape, entry.dtype) if entry.experts else None
        for i, n in enumerate(entry.hf):
            fpath, dtype, shape, offset, nb = self.where[n]
            # An expert already in the stack's dtype is read straight into its slice: no per-expert buffers, which
            # would fragment the heap (256 x 2 MB per stack) and keep RSS from falling back after each stack.
            direct = out is not None and DTYPES[dtype] == out.dtype
            raw = tensors.read_bytes(self._file(fpath), offset, nb, fpath, n, out=out[i] if direct else None)
            src = {"name": n, "file": os.path.basename(fpath), "type": dtype, "shape": list(shape), "bytes": nb}
            if checksums:
                src["sha256"] = tensors.sha256(raw)
            sources.append(src)
            x = raw.view(DTYPES[dtype]).reshape(shape)
            tensors.check_finite(x, fpath, n)
            if out is None:
                return tensors.cast(entry, x), sources
            if not direct:
                out[i] = x.astype(entry.dtype, copy=False)
        return out, sources

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- writing ----------------------------------------------------------------------------------------------------
def _header_bytes(items: list[tuple[str, np.dtype, tuple[int, ...]]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dtype, shape in items:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _NAME_OF[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


def write_hf(path: str | os.PathLike, cfg: FlintConfig, params: Params | Mapping | Callable[[Entry], Any], *,
             max_shard_bytes: int | None = None, tokenizer_json: str | None = None, progress: bool = False) -> None:
    """Write `params` as an HF BF16 checkpoint directory: config.json and model.safetensors, or shards
    model-0000i-of-0000n.safetensors of at most `max_shard_bytes` each plus model.safetensors.index.json.
    NVFP4 values are dequantized (values x global scale, rounded once to BF16). Tensors are produced and written
    one entry (one expert stack) at a time. `tokenizer_json`: a tokenizer.json text to write beside them."""
    from flint_jax.convert.gguf_writer import values_getter
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    get = values_getter(params)
    todo = [e for e in names.entries(cfg) if not (e.path == "lm_head" and cfg.tie_word_embeddings)]
    items = []  # (name, dtype, shape) in file order
    for e in todo:
        shape = e.shape[1:] if e.experts else e.shape
        items += [(n, np.dtype(e.dtype), shape) for n in e.hf]
    shards: list[list] = [[]]
    size = 0
    for it in items:
        n = int(np.prod(it[2])) * it[1].itemsize
        if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    fnames = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    shard_of = {it[0]: i for i, shard in enumerate(shards) for it in shard}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), unit="tensor", desc=f"writing {os.path.basename(path)}")
    files: dict[int, Any] = {}
    try:
        for e in todo:
            v = tensors.to_format(e, get(e), "bf16")
            v = np.asarray(v).astype(e.dtype, copy=False)
            for i, n in enumerate(e.hf):
                s = shard_of[n]
                if s not in files:
                    for old in files.values():
                        old.close()
                    files = {s: open(os.path.join(path, fnames[s] + ".tmp"), "wb")}
                    files[s].write(_header_bytes(shards[s]))
                np.ascontiguousarray(v[i] if e.experts else v).tofile(files[s])
            if bar is not None:
                bar.update(1)
        for f in files.values():
            f.close()
        for fn in fnames:
            os.replace(os.path.join(path, fn + ".tmp"), os.path.join(path, fn))
    finally:
        for f in files.values():
            f.close()
        for fn in fnames:
            if os.path.exists(os.path.join(path, fn + ".tmp")):
                os.remove(os.path.join(path, fn + ".tmp"))
        if bar is not None:
            bar.close()
    if len(shards) > 1:
        total = sum(int(np.prod(it[2])) * it[1].itemsize for it in items)
        index = {"metadata": {"total_size": total}, "weight_map": {it[0]: fnames[shard_of[it[0]]] for it in items}}
        with open(os.path.join(path, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    if tokenizer_json is not None:
        with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_json)
