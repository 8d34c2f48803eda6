"""Writing a Flint GGUF file (FLINT_SPEC section 4) from any parameters, tensor by tensor.

Used by tests (tiny synthetic checkpoints) and benchmarks (full-shape synthetic weights): the header (metadata and
tensor infos) is written first from the config, then each tensor is produced, converted and written in turn, so
at most one tensor is in memory whatever the model size.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from flint_jax import nvfp4
from flint_jax.config import FlintConfig
from flint_jax.convert import names, tensors
from flint_jax.convert.names import Entry
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.params import Params

_KIND_TYPES = {"u32": GGUFValueType.UINT32, "f32": GGUFValueType.FLOAT32, "bool": GGUFValueType.BOOL}
_ARRAY_TYPES = {"u32[]": GGUFValueType.UINT32, "bool[]": GGUFValueType.BOOL}


def values_getter(params: Params | Mapping[str, Any] | Callable[[Entry], Any]) -> Callable[[Entry], Any]:
    """Entry -> host value (numpy arrays) for Params, a {path: value} dict, or a producer function."""
    if callable(params) and not isinstance(params, (Params, Mapping)):
        get = params
    else:
        flat = names.flatten(params) if isinstance(params, Params) else params
        get = lambda e: flat[e.path]  # noqa: E731

    def host(e: Entry):
        v = get(e)
        if isinstance(v, NVFP4Weight):
            return NVFP4Weight(np.asarray(v.codes), np.asarray(v.scales), np.asarray(v.global_scale, np.float32))
        return np.asarray(v)
    return host


def _add_metadata(w: GGUFWriter, key: str, value: Any) -> None:
    """A tokenizer (or other) key with a plain Python value: ints as u32 (token ids) or i32 if negative."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            return  # GGUF cannot type an empty array
        value = [v.item() if isinstance(v, np.generic) else v for v in value]
        w.add_key_value(key, list(value), GGUFValueType.ARRAY)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        (w.add_uint32 if value >= 0 else w.add_int32)(key, int(value))
    elif isinstance(value, (float, np.floating)):
        w.add_float32(key, float(value))
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        raise TypeError(f"metadata {key}: cannot write a {type(value).__name__}")


def write_gguf(path: str | os.PathLike, cfg: FlintConfig, params: Params | Mapping | Callable[[Entry], Any], *,
               weights: str | None = None, tokenizer_metadata: Mapping[str, Any] | None = None,
               chat_template: str | None = None, global_scales: str = "auto", name: str | None = None,
               progress: bool = False) -> None:
    """Write `params` as a Flint GGUF at `path` (atomically: a temp file renamed at the end).

    params: `Params`, a `{path: value}` dict, or a producer `entry -> value` (called once per tensor, in order).
    weights: None keeps each value's format (Params/dict only); "bf16" or "nvfp4" converts linear weights
        (nvfp4: ggml's reference rounding with a power-of-two global scale, see nvfp4.quantize).
    Non-linear weights are written in their Params dtype, norms as F32 (exact; llama.cpp's convention).
    global_scales: "auto" writes `<name>.scale` for an NVFP4 tensor whose global scale is not all 1.0 (always
        when quantizing or producing); "always" / "never" force it ("never" refuses scales other than 1.0).
    tokenizer_metadata: `tokenizer.*` keys written as given; chat_template: `tokenizer.chat_template`."""
    if weights not in (None, "bf16", "nvfp4"):
        raise ValueError(f"weights must be None, 'bf16' or 'nvfp4', got {weights!r}")
    if global_scales not in ("auto", "always", "never"):
        raise ValueError(f"global_scales must be 'auto', 'always' or 'never', got {global_scales!r}")
    producer = callable(params) and not isinstance(params, (Params, Mapping))
    if producer and weights is None:
        raise ValueError("a producer function needs weights='bf16' or 'nvfp4' (the header is written first)")
    get = values_getter(params)
    todo = [e for e in names.entries(cfg) if not (e.path == "lm_head" and cfg.tie_word_embeddings)]

    # Plan every tensor (name, type, shape) before writing: the header precedes the data.
    plan: list[tuple[Entry, bool, bool]] = []  # (entry, as NVFP4, with a scale tensor)
    for e in todo:
        if producer:
            quant = weights == "nvfp4" and e.linear
            scale = quant and global_scales != "never"
        else:
            v = get(e)
            quant = e.linear and (weights == "nvfp4" or (isinstance(v, NVFP4Weight) and weights != "bf16"))
            converting = quant and not isinstance(v, NVFP4Weight)
            scale = quant and (global_scales == "always" or (global_scales == "auto" and (
                converting or bool(np.any(np.asarray(v.global_scale) != 1.0)))))
        plan.append((e, quant, scale))

    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    w = GGUFWriter(tmp, names.ARCH)
    try:
        if name:
            w.add_name(name)
        any_quant = any(q for _, q, _ in plan)
        w.add_file_type(LlamaFileType.MOSTLY_NVFP4 if any_quant else LlamaFileType.MOSTLY_BF16)
        if any_quant:
            w.add_quantization_version(2)
        for key, (value, kind) in names.gguf_metadata(cfg).items():
            if kind in _ARRAY_TYPES:
                w.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=_ARRAY_TYPES[kind])
            else:
                w.add_key_value(key, bool(value) if kind == "bool" else (float(value) if kind == "f32" else int(value)),
                                _KIND_TYPES[kind])
        tok = dict(tokenizer_metadata or {})
        # The config's stop and padding ids are tokenizer facts too; llama.cpp reads them from these keys.
        if cfg.eos_token_id:
            tok.setdefault("tokenizer.ggml.eos_token_id", cfg.eos_token_id[0])
        if cfg.pad_token_id is not None:
            tok.setdefault("tokenizer.ggml.padding_token_id", cfg.pad_token_id)
        for key, value in tok.items():
            _add_metadata(w, key, value)
        if chat_template is not None:
            w.add_chat_template(chat_template)

        dummy = np.dtype(np.float32)  # any non-uint8 dtype: the shape we pass is the logical one
        for e, quant, scale in plan:
            if quant:
                nbytes = int(np.prod(e.shape)) // nvfp4.GGUF_BLOCK * nvfp4.GGUF_BLOCK_BYTES
                w.add_tensor_info(e.gguf, e.shape, dummy, nbytes, raw_dtype=GGMLQuantizationType.NVFP4)
                if scale:
                    lead = e.shape[:-2] or (1,)
                    w.add_tensor_info(e.gguf_scale_names[0], lead, np.dtype(np.float32), 4 * int(np.prod(lead)))
            else:
                t = _array_type(e)
                w.add_tensor_info(e.gguf, e.shape, dummy, int(np.prod(e.shape)) * t.itemsize,
                                  raw_dtype=_GGML_OF[t])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(plan), unit="tensor", desc=f"writing {os.path.basename(path)}")
        for e, quant, scale in plan:
            v = tensors.to_format(e, get(e), "nvfp4" if quant else "bf16")
            if quant:
                if not scale and np.any(np.asarray(v.global_scale) != 1.0):
                    raise ValueError(f"{e.gguf}: global scale is not 1.0 but global_scales='never'")
                w.write_tensor_data(nvfp4.to_gguf_blocks(v))
                if scale:
                    w.write_tensor_data(np.asarray(v.global_scale, np.float32).reshape(e.shape[:-2] or (1,)))
            else:
                w.write_tensor_data(np.ascontiguousarray(np.asarray(v).astype(_array_type(e))))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _array_type(e: Entry) -> np.dtype:
    return np.dtype(np.float32) if e.kind == "norm" else np.dtype(e.dtype)


_GGML_OF = {np.dtype(np.float32): GGMLQuantizationType.F32, tensors.BF16: GGMLQuantizationType.BF16}
