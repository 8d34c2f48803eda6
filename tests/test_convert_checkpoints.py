"""Checkpoint formats end to end on the tiny model: HF BF16, GGUF (BF16 / NVFP4 / mixed), converted Orbax."""

import json
import os

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from flint_jax import nvfp4
from flint_jax.config import FlintConfig
from flint_jax.convert import convert, load, names, write_gguf, write_hf
from flint_jax.model import forward
from flint_jax.nvfp4 import NVFP4Weight
from gguf_files import gguf_tensors, raw_gguf

# NVFP4 vs BF16 logits of the tiny random model (every linear quantized, ggml rounding, power-of-two global scales).
# Each weight alone has ~9.5% relative RMS error (E2M1 with one E4M3 scale per 16 values); through 5 random layers
# that compounds to a measured 30-36% relative RMS logit error and max |diff| 1.4-1.9 (logit RMS ~1.0) over seeds
# 0-3. The bounds leave headroom for platform differences; docs/CHECKPOINTS.md states them too.
NVFP4_REL_RMS_BOUND = 0.45
NVFP4_MAX_ABS_BOUND = 2.5

TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "glm4", "tokenizer.ggml.tokens": ["a", "b", "<c>"],
             "tokenizer.ggml.token_type": [1, 1, 3], "tokenizer.ggml.merges": ["a b"],
             "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False}


def leaves_bits(params):
    out = {}
    for path, v in names.flatten(params).items():
        for k, a in (vars(v).items() if isinstance(v, NVFP4Weight) else [("", v)]):
            a = np.asarray(a)
            out[f"{path}.{k}" if k else path] = (a.dtype, a.shape, a.reshape(-1).view(np.uint8).tobytes())
    return out


@pytest.fixture(scope="module")
def tokens(tiny_cfg):
    return jax.random.randint(jax.random.key(42), (2, 12), 0, tiny_cfg.vocab_size)


@pytest.fixture(scope="module")
def ref_logits(tiny_params, tokens, tiny_cfg):
    return np.asarray(forward(tiny_params, tokens, tiny_cfg))


@pytest.fixture(scope="module")
def bf16_files(tmp_path_factory, tiny_cfg, tiny_params):
    d = tmp_path_factory.mktemp("bf16")
    write_hf(d / "hf", tiny_cfg, tiny_params, max_shard_bytes=60_000, tokenizer_json='{"model": {}}')
    write_gguf(d / "m.gguf", tiny_cfg, tiny_params, tokenizer_metadata=TOKENIZER, chat_template="{{ messages }}")
    return d


def test_same_weights_as_hf_gguf_and_orbax_give_identical_logits(bf16_files, tiny_cfg, tiny_params, tokens,
                                                                  ref_logits):
    d = bf16_files
    assert len([f for f in os.listdir(d / "hf") if f.endswith(".safetensors")]) > 1  # sharded, with an index
    convert(d / "hf", d / "from_hf", progress=False)
    convert(d / "m.gguf", d / "from_gguf", progress=False)
    want = leaves_bits(tiny_params)
    for src, fmt in [(d / "hf", "hf"), (d / "m.gguf", "gguf"), (d / "from_hf", "orbax"), (d / "from_gguf", "orbax")]:
        m = load(src)
        assert m.format == fmt and m.cfg == tiny_cfg and m.source == str(src)
        assert leaves_bits(m.params) == want, src
        np.testing.assert_array_equal(np.asarray(forward(m.params, tokens, m.cfg)), ref_logits)


def test_tokenizer_metadata_is_returned_and_kept(bf16_files):
    d = bf16_files
    m = load(d / "m.gguf")
    assert m.tokenizer_metadata == {**TOKENIZER, "tokenizer.chat_template": "{{ messages }}",
                                    "tokenizer.ggml.padding_token_id": 0}
    assert load(d / "hf").tokenizer_metadata == {"tokenizer_json": str(d / "hf" / "tokenizer.json")}
    if not (d / "from_gguf").exists():
        convert(d / "m.gguf", d / "from_gguf", progress=False)
    assert load(d / "from_gguf").tokenizer_metadata == m.tokenizer_metadata
    convert(d / "hf", d / "tok_hf", progress=False)
    tj = load(d / "tok_hf").tokenizer_metadata["tokenizer_json"]
    assert tj == str(d / "tok_hf" / "tokenizer.json") and open(tj).read() == '{"model": {}}'


def test_manifest_records_names_dtypes_shapes_and_source_checksums(bf16_files, tiny_cfg):
    d = bf16_files
    if not (d / "from_gguf").exists():
        convert(d / "m.gguf", d / "from_gguf", progress=False)
    m = json.load(open(d / "from_gguf" / "manifest.json"))
    assert [t["path"] for t in m["tensors"]] == [e.path for e in names.entries(tiny_cfg)]
    emb = m["tensors"][0]
    assert emb["arrays"] == {"": {"dtype": "bfloat16", "shape": [256, 64]}}
    src = emb["sources"][0]
    assert src["name"] == "token_embd.weight" and src["type"] == "BF16"
    r = gguf.GGUFReader(d / "m.gguf")
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    import hashlib
    assert src["sha256"] == hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest()
    assert json.load(open(d / "from_gguf" / "config.json")) == tiny_cfg.to_hf()


def test_hf_reader_reads_safetensors_own_writer(tmp_path, tiny_cfg, tiny_params):
    """An independent writer (the safetensors package) produces a directory our reader loads bit for bit."""
    from safetensors.flax import save_file
    flat = names.flatten(tiny_params)
    tensors = {}
    for e in names.entries(tiny_cfg):
        v = jnp.asarray(flat[e.path])
        for i, n in enumerate(e.hf):
            tensors[n] = v[i] if e.experts else v
    save_file(tensors, tmp_path / "model.safetensors")
    json.dump(tiny_cfg.to_hf(), open(tmp_path / "config.json", "w"))
    assert leaves_bits(load(tmp_path).params) == leaves_bits(tiny_params)


def test_our_safetensors_read_by_safetensors(bf16_files, tiny_params):
    from safetensors import safe_open
    d = bf16_files / "hf"
    index = json.load(open(d / "model.safetensors.index.json"))["weight_map"]
    name = "model.layers.3.mlp.experts.5.down_proj.weight"
    with safe_open(d / index[name], framework="flax") as f:
        got = np.asarray(f.get_tensor(name))
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(tiny_params.layers[3].mlp.down[5]).view(np.uint16))


def test_nvfp4_gguf_loads_and_runs_close_to_bf16(tmp_path, tiny_cfg, tiny_params, tokens, ref_logits):
    write_gguf(tmp_path / "q.gguf", tiny_cfg, tiny_params, weights="nvfp4")
    m = load(tmp_path / "q.gguf")
    flat, src = names.flatten(m.params), names.flatten(tiny_params)
    for e in names.entries(tiny_cfg):
        assert isinstance(flat[e.path], NVFP4Weight) == e.linear
        if e.linear:  # exactly what the quantizer gives
            want = nvfp4.quantize(np.asarray(src[e.path]), "pow2")
            assert np.array_equal(np.asarray(flat[e.path].codes), want.codes)
            assert np.array_equal(np.asarray(flat[e.path].global_scale), want.global_scale)
    got = np.asarray(forward(m.params, tokens, m.cfg))
    rel = np.sqrt(np.mean((got - ref_logits) ** 2) / np.mean(ref_logits ** 2))
    assert rel < NVFP4_REL_RMS_BOUND and np.abs(got - ref_logits).max() < NVFP4_MAX_ABS_BOUND, (rel,)


def _patch_degenerate_bytes(path, rng):
    """Rewrite some NVFP4 scale bytes of a GGUF in place to 0x00, 0x7F and sign-bit-set values, and some code
    bytes to 0x88 (E2M1 "-0" in both nibbles)."""
    r = gguf.GGUFReader(path, "r+")
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.NVFP4:
            continue
        b = t.data.reshape(-1, 36)
        idx = rng.choice(b.shape[0], size=max(2, b.shape[0] // 8), replace=False)
        for j, i in enumerate(idx):
            s = j % 4
            b[i, s] = [0x00, 0x7F, b[i, s] | 0x80, 0xFE][j % 4]
            b[i, 4 + 8 * s: 8 + 8 * s] = 0x88
    r.data.flush()


@pytest.fixture(scope="module")
def nvfp4_gguf(tmp_path_factory, tiny_cfg, tiny_params_nvfp4):
    """Random NVFP4 weights (every code) with power-of-two global scales, per expert for stacks, and degenerate
    scale bytes patched into the file."""
    params = tiny_params_nvfp4
    flat = names.flatten(params)
    rng = np.random.default_rng(0)
    for e in names.entries(tiny_cfg):
        if e.linear and e.path.startswith("layers."):
            w = flat[e.path]
            gs = np.exp2(rng.integers(-2, 3, np.shape(w.global_scale))).astype(np.float32)
            flat[e.path] = NVFP4Weight(w.codes, w.scales, jnp.asarray(gs))
    path = tmp_path_factory.mktemp("nvfp4") / "q.gguf"
    write_gguf(path, tiny_cfg, flat)
    _patch_degenerate_bytes(path, rng)
    return path


def gguf_oracle(path, cfg):
    """{param path: FP32 values} straight from gguf's own reader and dequantizer, global scales applied."""
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    out = {}
    for e in names.entries(cfg):
        t = by_name[e.gguf]
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            x = np.asarray(t.data).view(ml_dtypes.bfloat16).reshape(e.shape).astype(np.float32)
        else:
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(e.shape).astype(np.float32)
        s = by_name.get(e.gguf_scale_names[0])
        if s is not None:
            gs = np.asarray(s.data, np.float32)
            x = x * (gs.reshape(-1, 1, 1) if len(e.shape) == 3 else gs.reshape(()))
        out[e.path] = x
    return out


def test_nvfp4_repack_is_lossless_on_every_tensor(nvfp4_gguf, tiny_cfg):
    m = load(nvfp4_gguf)
    oracle = gguf_oracle(nvfp4_gguf, tiny_cfg)
    flat = names.flatten(m.params)
    n_nvfp4 = 0
    dequantize_f32 = jax.jit(nvfp4.dequantize_f32)
    for e in names.entries(tiny_cfg):
        v = flat[e.path]
        if isinstance(v, NVFP4Weight):
            n_nvfp4 += 1
            ours = np.asarray(dequantize_f32(v))
            assert np.array_equal(ours.view(np.uint32), oracle[e.path].view(np.uint32)), e.path
            assert not np.isnan(np.asarray(v.scales, np.float32)).any()
    assert n_nvfp4 == sum(e.linear for e in names.entries(tiny_cfg))


def test_reference_forward_on_gguf_dequantized_weights_matches_exactly(nvfp4_gguf, tiny_cfg, tokens):
    """forward() on our NVFP4 params == forward() on BF16 params made from gguf's dequantizer (global scales are
    powers of two, so folding them into the BF16 weights is exact)."""
    m = load(nvfp4_gguf)
    oracle = gguf_oracle(nvfp4_gguf, tiny_cfg)
    deq = names.assemble(tiny_cfg, lambda p: jnp.asarray(oracle[p]).astype(
        jnp.float32 if p.endswith(("router", "router_bias", "sinks")) else jnp.bfloat16))
    a = np.asarray(forward(m.params, tokens, m.cfg))
    b = np.asarray(forward(deq, tokens, tiny_cfg))
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_orbax_round_trip_keeps_every_dtype_bit_exact(nvfp4_gguf, tmp_path):
    direct = load(nvfp4_gguf)
    convert(nvfp4_gguf, tmp_path / "ck", progress=False)
    back = load(tmp_path / "ck")
    a, b = leaves_bits(direct.params), leaves_bits(back.params)
    assert a == b
    dtypes = {str(dt) for dt, _, _ in b.values()}
    assert dtypes == {"uint8", "float8_e4m3fn", "bfloat16", "float32"}
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(back.params))


def test_gguf_any_mix_of_types(tmp_path, tiny_cfg, tiny_params):
    """F16 and F32 linears, BF16 others, NVFP4 experts with `.weight.scale` [E] and a 2-D NVFP4 with `.scale` [1],
    no router bias (zeros), tied embeddings (no output.weight): written by the gguf package itself."""
    cfg = tiny_cfg.replace(tie_word_embeddings=True)
    flat = names.flatten(tiny_params)
    T = gguf.GGMLQuantizationType
    tensors = {}
    for e in names.entries(cfg):
        x = np.asarray(flat[e.path])
        if e.path == "lm_head" or e.kind == "bias":
            continue
        if e.path.endswith("attn.q"):
            tensors[e.gguf] = (x.astype(np.float16), T.F16)
        elif e.path.endswith("attn.k") or e.kind in ("norm", "router", "sink"):
            tensors[e.gguf] = (x.astype(np.float32), T.F32)
        elif e.path.endswith("mlp.gate") and e.experts:
            q = nvfp4.quantize(x, "pow2")
            tensors[e.gguf] = (nvfp4.to_gguf_blocks(q), T.NVFP4)
            tensors[e.gguf + ".scale"] = (np.asarray(q.global_scale), T.F32)  # the `.weight.scale` spelling
        elif e.path.endswith("attn.o"):
            q = nvfp4.quantize(x, 0.5)
            tensors[e.gguf] = (nvfp4.to_gguf_blocks(q), T.NVFP4)
            tensors[e.gguf_scale_names[0]] = (np.array([0.5], np.float32), T.F32)
        else:
            tensors[e.gguf] = (x.view(np.uint16), T.BF16)
    raw_gguf(tmp_path / "mix.gguf", cfg, tensors, token_ids=True)
    m = load(tmp_path / "mix.gguf")
    assert m.cfg == cfg
    p = m.params
    assert p.layers[2].mlp.router_bias.dtype == jnp.float32 and not np.asarray(p.layers[2].mlp.router_bias).any()
    assert np.array_equal(np.asarray(p.lm_head).view(np.uint16), np.asarray(tiny_params.embed).view(np.uint16))
    assert p.layers[0].attn.q.dtype == jnp.bfloat16  # F16 -> BF16 (the reference computes in BF16)
    np.testing.assert_array_equal(np.asarray(p.layers[0].attn.q, np.float32),
                                  np.asarray(tiny_params.layers[0].attn.q, np.float16).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32))
    assert np.array_equal(np.asarray(p.layers[1].attn.k).view(np.uint16),
                          np.asarray(tiny_params.layers[1].attn.k).view(np.uint16))  # F32 of BF16 values: exact
    gate = p.layers[3].mlp.gate
    assert isinstance(gate, NVFP4Weight) and gate.global_scale.shape == (cfg.n_routed_experts,)
    assert isinstance(p.layers[0].attn.o, NVFP4Weight) and float(p.layers[0].attn.o.global_scale) == 0.5
    # weights="bf16" dequantizes NVFP4 (power-of-two scales: exact), weights="nvfp4" quantizes the rest
    b = load(tmp_path / "mix.gguf", weights="bf16").params
    np.testing.assert_array_equal(np.asarray(b.layers[3].mlp.gate, np.float32),
                                  np.asarray(nvfp4.dequantize_f32(gate)))
    q = load(tmp_path / "mix.gguf", weights="nvfp4").params
    assert all(isinstance(getattr(q.layers[0].attn, n), NVFP4Weight) for n in "qkvo")
    assert isinstance(q.lm_head, NVFP4Weight) and q.embed.dtype == jnp.bfloat16


def test_convert_quantize_nvfp4_from_hf(bf16_files, tiny_cfg, tiny_params):
    d = bf16_files
    convert(d / "hf", d / "q_hf", quantize="nvfp4", progress=False)
    m = load(d / "q_hf")
    src = names.flatten(tiny_params)
    for e in names.entries(tiny_cfg):
        v = names.flatten(m.params)[e.path]
        if e.linear:
            assert np.array_equal(np.asarray(v.scales).view(np.uint8),
                                  nvfp4.quantize(np.asarray(src[e.path]), "pow2").scales.view(np.uint8))
    man = json.load(open(d / "q_hf" / "manifest.json"))
    assert man["quantize"] == "nvfp4"
    gate = next(t for t in man["tensors"] if t["path"] == "layers.2.mlp.gate")
    assert gate["arrays"]["codes"] == {"dtype": "uint8", "shape": [8, 64, 32]}
    assert len(gate["sources"]) == 8 and all(len(s["sha256"]) == 64 for s in gate["sources"])


def test_load_places_arrays_by_sharding(bf16_files, tiny_cfg):
    dev = jax.devices()[0]
    seen = []

    def sharding(name, sds):
        seen.append((name, sds.shape))
        return jax.sharding.SingleDeviceSharding(dev)
    d = bf16_files
    m = load(d / "m.gguf", sharding=sharding, weights="nvfp4")
    assert ("layers.2.mlp.gate.codes", (8, 64, 32)) in seen and ("embed", (256, 64)) in seen
    assert all(x.sharding == jax.sharding.SingleDeviceSharding(dev) for x in jax.tree.leaves(m.params))
    if not (d / "from_gguf").exists():
        convert(d / "m.gguf", d / "from_gguf", progress=False)
    seen.clear()
    load(d / "from_gguf", sharding=sharding)
    assert ("layers.3.attn.sinks", (4,)) in seen
    m2 = load(d / "from_gguf", device=dev)
    assert all(dev in x.devices() for x in jax.tree.leaves(m2.params))


def test_config_json_supplies_what_metadata_lacks(tmp_path, tiny_cfg, tiny_params):
    """A GGUF without some flint.* keys loads when a config supplies them; a matching config is accepted."""
    raw_gguf(tmp_path / "sparse.gguf", tiny_cfg, gguf_tensors(tiny_cfg, tiny_params), keys={"flint.block_count"})
    cfg_path = tmp_path / "config.json"
    json.dump(tiny_cfg.to_hf(), open(cfg_path, "w"))
    m = load(tmp_path / "sparse.gguf", config=cfg_path)
    assert m.cfg == tiny_cfg and leaves_bits(m.params) == leaves_bits(tiny_params)
    assert load(tmp_path / "sparse.gguf", config=tiny_cfg).cfg == tiny_cfg
    assert FlintConfig.from_hf(cfg_path) == tiny_cfg
