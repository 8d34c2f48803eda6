"""GGUF files written by the gguf package alone (not by flint_jax's writer), so the reader is tested against an
independent producer."""
import gguf

from flint_jax.convert import names


def raw_gguf(path, cfg, tensors, arch="flint", meta=None, token_ids=False):
    """Flint metadata for `cfg` (entries of `meta` override values), tensors {name: (array, ggml type)}; with
    token_ids, also the eos/pad token ids. Returns `path`."""
    w = gguf.GGUFWriter(path, arch)
    for key, (v, kind) in names.gguf_metadata(cfg).items():
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
