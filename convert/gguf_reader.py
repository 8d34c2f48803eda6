"""Reading a Flint GGUF file (FLINT_SPEC section 4): config from metadata, tokenizer keys, tensors one at a time.

The `gguf` package parses the header (metadata and tensor infos); tensor bytes are read one tensor at a time into
private buffers (see tensors.read_bytes) and NVFP4 blocks are repacked without dequantizing (nvfp4.from_gguf_blocks).
Every problem is a CheckpointError naming the file and, where one is at fault, the tensor.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from flint_jax import nvfp4
from flint_jax.config import ConfigError, FlintConfig
from flint_jax.convert import names, tensors
from flint_jax.convert.errors import CheckpointError
from flint_jax.convert.names import Entry

GGUF_MAGIC = b"GGUF"
NVFP4 = GGMLQuantizationType.NVFP4
FLOAT_TYPES = {GGMLQuantizationType.F32: np.dtype(np.float32), GGMLQuantizationType.F16: np.dtype(np.float16),
               GGMLQuantizationType.BF16: tensors.BF16}
SUPPORTED = (*FLOAT_TYPES, NVFP4)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF stores the dims reversed)
    offset: int  # absolute, in the file
    nbytes: int


class _Reader(GGUFReader):
    """GGUFReader that checks every tensor info (type known, NVFP4 rows of whole blocks, data inside the file)
    before the parent builds its views, so a bad file fails with the tensor's name."""

    def __init__(self, path: str):
        self._file = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise CheckpointError(self._file, f"unknown GGML type id {int(raw_type[0])}", name) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            if shape and shape[-1] % block:
                raise CheckpointError(self._file, f"{qtype.name} row length {shape[-1]} is not a multiple of its "
                                                  f"block of {block} values", name)
            nbytes = int(np.prod(shape, dtype=np.int64)) * type_size // block
            begin = start_offs + int(offset[0])
            if begin + nbytes > size:
                raise CheckpointError(self._file, f"file is truncated: the tensor's data needs bytes {begin}.."
                                                  f"{begin + nbytes} but the file has {size}", name)
        super()._build_tensors(start_offs, fields)


def is_gguf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return value


class GGUFCheckpoint:
    """An open Flint GGUF file. `cfg` comes from the `flint.*` metadata, or is the given `config` (metadata that
    contradicts it is an error; keys the file lacks come from the config). `entries` are the weights to read,
    validated against the file (names, shapes, types) when the checkpoint is opened."""

    format = "gguf"

    def __init__(self, path: str | os.PathLike, config: FlintConfig | None = None):
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(self.path):
            raise CheckpointError(self.path, "no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise CheckpointError(self.path, f"not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            reader = _Reader(self.path)
        except CheckpointError:
            raise
        except Exception as e:  # the gguf package raises assorted errors on a damaged header
            raise CheckpointError(self.path, f"corrupt or truncated GGUF header ({type(e).__name__}: {e})") from None
        self.metadata: dict[str, Any] = {}
        self.tokenizer_metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                value = field.contents()
            except Exception as e:
                raise CheckpointError(self.path, f"metadata {key}: unreadable value ({e})") from None
            value = [_plain(v) for v in value] if isinstance(value, list) else _plain(value)
            (self.tokenizer_metadata if key.startswith("tokenizer.") else self.metadata)[key] = value
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())),
                               int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
        del reader  # closes the memory map; tensor bytes are read on demand
        arch = self.metadata.get("general.architecture")
        if arch != names.ARCH:
            raise CheckpointError(self.path, f"unknown architecture {arch!r} (general.architecture; expected "
                                             f"{names.ARCH!r})")
        self.cfg = self._config(config)
        self.entries = self._validate()
        self._f = open(self.path, "rb")

    # ---- config ---------------------------------------------------------------------------------------------
    def _config(self, config: FlintConfig | None) -> FlintConfig:
        fields, problems = names.config_fields_from_gguf(self.metadata)
        if problems:
            raise CheckpointError(self.path, problems[0])
        if config is not None:
            for field, value in fields.items():
                mine = getattr(config, field)
                same = (np.float32(mine) == np.float32(value)) if isinstance(value, float) else mine == value
                if not same:
                    key = next(k for k, (f, _) in names.GGUF_KEYS.items() if f == field)
                    raise CheckpointError(self.path, f"metadata {names.ARCH}.{key} = {value!r} contradicts the given "
                                                     f"config ({field} = {mine!r})")
            if (config.moe_intermediate_size * config.n_shared_experts
                    != self.metadata.get(f"{names.ARCH}.expert_shared_feed_forward_length",
                                         config.moe_intermediate_size * config.n_shared_experts)):
                raise CheckpointError(self.path, f"metadata {names.ARCH}.expert_shared_feed_forward_length contradicts "
                                                 "the given config (moe_intermediate_size x n_shared_experts)")
            return config
        embd = self.tensors.get("token_embd.weight")
        if "vocab_size" not in fields and embd is not None:
            fields["vocab_size"] = embd.shape[0]
        if "eos_token_id" not in fields:
            fields["eos_token_id"] = tuple(dict.fromkeys(
                int(self.tokenizer_metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                          "tokenizer.ggml.eom_token_id")
                if k in self.tokenizer_metadata))
        if "tokenizer.ggml.padding_token_id" in self.tokenizer_metadata:
            fields["pad_token_id"] = int(self.tokenizer_metadata["tokenizer.ggml.padding_token_id"])
        fields["tie_word_embeddings"] = "output.weight" not in self.tensors
        required = {f.name for f in dataclasses.fields(FlintConfig)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - fields.keys())
        if missing:
            keys = [f"{names.ARCH}.{k}" for k, (f, _) in names.GGUF_KEYS.items() if f in missing]
            raise CheckpointError(self.path, f"metadata lacks {', '.join(keys or missing)} (pass a config.json to "
                                             "supply them)")
        try:
            return FlintConfig(**fields)
        except ConfigError as e:
            raise CheckpointError(self.path, f"metadata describes an invalid model: {e}") from None

    # ---- tensors --------------------------------------------------------------------------------------------
    def _scale_info(self, entry: Entry) -> TensorInfo | None:
        found = [self.tensors[n] for n in entry.gguf_scale_names if n in self.tensors]
        if len(found) > 1:
            raise CheckpointError(self.path, f"two global scales ({found[0].name}, {found[1].name})", entry.gguf)
        return found[0] if found else None

    def _validate(self) -> list[Entry]:
        expected = names.entries(self.cfg)
        known = set()
        present = []
        for e in expected:
            known.add(e.gguf)
            known.update(e.gguf_scale_names)
            t = self.tensors.get(e.gguf)
            if t is None:
                if not e.optional:
                    missing = [x.gguf for x in expected if not x.optional and x.gguf not in self.tensors]
                    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                    raise CheckpointError(self.path, f"missing from the file{more}", e.gguf)
                continue
            if t.type not in SUPPORTED:
                raise CheckpointError(self.path, f"type {t.type.name} is not supported (NVFP4, BF16, F16 or F32)",
                                      e.gguf)
            if t.shape != e.shape:
                raise CheckpointError(self.path, f"shape {list(t.shape)} disagrees with the config, which needs "
                                                 f"{list(e.shape)} for {e.path}", e.gguf)
            s = self._scale_info(e)
            if s is not None:
                lead = e.shape[:-2] if e.linear else ()
                if s.type not in FLOAT_TYPES or s.shape not in ((1,), lead, ()) or (not e.linear and s.shape != (1,)):
                    raise CheckpointError(self.path, f"global scale must be F32 of shape [1]"
                                                     f"{' or ' + str(list(lead)) if lead else ''}, got {s.type.name} "
                                                     f"{list(s.shape)}", s.name)
            present.append(e)
        extra = [n for n in self.tensors if n not in known]
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(self.path, f"not a tensor of Flint with this config{more}", extra[0])
        return present

    def source_nbytes(self, entry: Entry) -> int:
        t = self.tensors[entry.gguf]
        s = self._scale_info(entry)
        return t.nbytes + (s.nbytes if s else 0)

    def _read_float(self, t: TensorInfo, checksums: bool, sources: list) -> np.ndarray:
        raw = tensors.read_bytes(self._f, t.offset, t.nbytes, self.path, t.name)
        sources.append(self._source(t, raw, checksums))
        x = raw.view(FLOAT_TYPES[t.type]).reshape(t.shape)
        tensors.check_finite(x, self.path, t.name)
        return x

    def _source(self, t: TensorInfo, raw: np.ndarray, checksums: bool) -> dict:
        d = {"name": t.name, "file": os.path.basename(self.path), "type": t.type.name, "shape": list(t.shape),
             "bytes": t.nbytes}
        if checksums:
            d["sha256"] = tensors.sha256(raw)
        return d

    def read(self, entry: Entry, checksums: bool = False):
        """(value, sources): the entry's value (numpy array in its Params dtype, or NVFP4Weight for an NVFP4 linear)
        and a description of the source tensors read (with sha256 of their bytes when `checksums`)."""
        t = self.tensors[entry.gguf]
        sources: list[dict] = []
        gs = None
        s = self._scale_info(entry)
        if s is not None:
            gs = self._read_float(s, checksums, sources).astype(np.float32)
            lead = entry.shape[:-2] if entry.linear else ()
            gs = np.broadcast_to(gs.reshape(()) if gs.size == 1 else gs, lead).copy()
        if t.type == NVFP4:
            raw = tensors.read_bytes(self._f, t.offset, t.nbytes, self.path, t.name)
            sources.insert(0, self._source(t, raw, checksums))
            blocks = raw.reshape(*t.shape[:-1], t.shape[-1] // nvfp4.GGUF_BLOCK * nvfp4.GGUF_BLOCK_BYTES)
            try:
                w = nvfp4.from_gguf_blocks(blocks, gs)
            except nvfp4.NVFP4FormatError as e:
                raise CheckpointError(self.path, f"corrupt NVFP4 data: {e}", t.name) from None
            return tensors.from_nvfp4(entry, w), sources
        x = self._read_float(t, checksums, sources)
        sources.insert(0, sources.pop())
        return tensors.cast(entry, x, gs), sources

    def close(self) -> None:
        if getattr(self, "_f", None) is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
