"""GGUF files written by the gguf package alone (not by flint_jax's writer), so the reader is tested against an
independent producer."""
import gguf
import ml_dtypes
import numpy as np

from flint_jax import nvfp4
from flint_jax.convert import names

T = gguf.GGMLQuantizationType


def gguf_tensors(cfg, params, nvfp4_linears=False):
    """{name: (array, ggml type)} of a checkpoint, as the gguf package's add_tensor takes them: BF16 and F32 as
    stored, linear weights quantized to NVFP4 blocks when asked."""
    flat = names.flatten(params)
    out = {}
    for e in names.entries(cfg):
        x = np.asarray(flat[e.path])
        if nvfp4_linears and e.linear:
            out[e.gguf] = (nvfp4.to_gguf_blocks(nvfp4.quantize(x)), T.NVFP4)
        elif x.dtype == ml_dtypes.bfloat16:
            out[e.gguf] = (x.view(np.uint16), T.BF16)
        else:
            out[e.gguf] = (x, T.F32)
    return out


def raw_gguf(path, cfg, tensors, arch="flint", meta=None, token_ids=False, keys=None):
    """Flint metadata for `cfg` (entries of `meta` override values; only `keys` when given), tensors
    {name: (array, ggml type)}; with token_ids, also the eos/pad token ids. Returns `path`."""
    w = gguf.GGUFWriter(path, arch)
    for key, (v, kind) in names.gguf_metadata(cfg).items():
        if keys is not None and key not in keys:
            continue
        if kind.endswith("[]"):
            sub = gguf.GGUFValueType.BOOL if kind == "bool[]" else gguf.GGUFValueType.UINT32
            w.add_key_value(key, list(v), gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            {"u32": w.add_uint32, "f32": w.add_float32, "bool": w.add_bool}[kind](key, (meta or {}).get(key, v))
    if token_ids:
        w.add_eos_token_id(cfg.eos_token_id[0])
        w.add_pad_token_id(cfg.pad_token_id)
    for name, (a, qtype) in tensors.items():
        w.add_tensor(name, a, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
