"""Bad checkpoints fail with one clear error naming the file and the tensor; conversion is atomic; CLI exit codes."""

import json
import os
import shutil
import subprocess
import sys

import gguf
import ml_dtypes
import numpy as np
import pytest

from flint_jax.convert import CheckpointError, convert, load, names, write_gguf, write_hf
from flint_jax.convert.cli import main
from gguf_files import gguf_tensors, raw_gguf

T = gguf.GGMLQuantizationType


def expect(match, fn, *args, **kw):
    with pytest.raises(CheckpointError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return e.value


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_cfg, tiny_params):
    d = tmp_path_factory.mktemp("good")
    write_gguf(d / "m.gguf", tiny_cfg, tiny_params)
    write_gguf(d / "q.gguf", tiny_cfg, tiny_params, weights="nvfp4")
    write_hf(d / "hf", tiny_cfg, tiny_params)
    return d


# ---- GGUF ---------------------------------------------------------------------------------------------------
def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 this is a zip, not a model")
    e = expect(r"x.gguf: not a GGUF file \(starts with b'PK", load, tmp_path / "x.gguf")
    assert e.file == str(tmp_path / "x.gguf")
    expect("no such file or directory", load, tmp_path / "missing.gguf")


def test_truncated_gguf_names_the_tensor(good, tmp_path):
    data = (good / "m.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:-1000])
    e = expect(r"t.gguf: tensor output.weight: file is truncated", load, tmp_path / "t.gguf")
    assert e.tensor == "output.weight"
    (tmp_path / "h.gguf").write_bytes(data[:300])  # inside the metadata
    expect(r"h.gguf: corrupt or truncated GGUF header", load, tmp_path / "h.gguf")


def test_unknown_architecture(tmp_path, tiny_cfg, tiny_params):
    p = raw_gguf(tmp_path / "a.gguf", tiny_cfg, gguf_tensors(tiny_cfg, tiny_params), arch="llama")
    expect(r"a.gguf: unknown architecture 'llama' \(general.architecture; expected 'flint'\)", load, p)


def test_missing_and_extra_tensors(tmp_path, tiny_cfg, tiny_params):
    t = gguf_tensors(tiny_cfg, tiny_params)
    del t["blk.1.attn_k.weight"]
    expect(r"m.gguf: tensor blk.1.attn_k.weight: missing from the file", load,
           raw_gguf(tmp_path / "m.gguf", tiny_cfg, t))
    t = gguf_tensors(tiny_cfg, tiny_params)
    t["blk.0.rope_freqs.weight"] = (np.ones(8, np.float32), T.F32)
    expect(r"x.gguf: tensor blk.0.rope_freqs.weight: not a tensor of Flint with this config", load,
           raw_gguf(tmp_path / "x.gguf", tiny_cfg, t))


def test_shape_and_dtype_disagreeing_with_config(tmp_path, tiny_cfg, tiny_params):
    t = gguf_tensors(tiny_cfg, tiny_params)
    a, q = t["blk.2.ffn_down_exps.weight"]
    t["blk.2.ffn_down_exps.weight"] = (a[:7], q)
    expect(r"s.gguf: tensor blk.2.ffn_down_exps.weight: shape \[7, 64, 64\] disagrees with the config, which needs "
           r"\[8, 64, 64\] for layers.2.mlp.down", load, raw_gguf(tmp_path / "s.gguf", tiny_cfg, t))
    t = gguf_tensors(tiny_cfg, tiny_params)
    v = t["blk.0.attn_v.weight"][0].view(ml_dtypes.bfloat16).astype(np.float32)
    t["blk.0.attn_v.weight"] = (gguf.quants.quantize(v, T.Q8_0), T.Q8_0)
    expect(r"d.gguf: tensor blk.0.attn_v.weight: type Q8_0 is not supported", load,
           raw_gguf(tmp_path / "d.gguf", tiny_cfg, t))
    t = gguf_tensors(tiny_cfg, tiny_params)
    t["blk.0.attn_q.weight.scale"] = (np.ones(3, np.float32), T.F32)
    expect(r"tensor blk.0.attn_q.weight.scale: global scale must be F32 of shape \[1\]", load,
           raw_gguf(tmp_path / "g.gguf", tiny_cfg, t))


def test_nvfp4_row_length_not_a_multiple_of_64(tmp_path, tiny_cfg, tiny_params):
    t = gguf_tensors(tiny_cfg, tiny_params)
    # 64 rows of 32 values as NVFP4: half a block per row (the writer takes the shape we give it)
    w = gguf.GGUFWriter(tmp_path / "r.gguf", "flint")
    w.add_tensor("blk.0.attn_q.weight", np.zeros(64 * 18, np.int8), raw_shape=(64, 32), raw_dtype=T.NVFP4)
    for name, (a, q) in t.items():
        if name != "blk.0.attn_q.weight":
            w.add_tensor(name, a, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect(r"r.gguf: tensor blk.0.attn_q.weight: NVFP4 row length 32 is not a multiple of its block of 64 values",
           load, tmp_path / "r.gguf")


def test_metadata_contradicting_config(good, tiny_cfg, tmp_path):
    expect(r"m.gguf: metadata flint.rope.freq_base = 10000.0 contradicts the given config "
           r"\(rope_theta = 500000.0\)", load, good / "m.gguf", config=tiny_cfg.replace(rope_theta=5e5))
    cfg_path = tmp_path / "config.json"
    json.dump(tiny_cfg.replace(sliding_window=7).to_hf(), open(cfg_path, "w"))
    expect(r"metadata flint.attention.sliding_window = 5 contradicts the given config \(sliding_window = 7\)",
           convert, good / "m.gguf", tmp_path / "out", config=str(cfg_path), progress=False)
    assert not (tmp_path / "out").exists()


def test_inconsistent_metadata(tmp_path, tiny_cfg, tiny_params):
    p = raw_gguf(tmp_path / "g.gguf", tiny_cfg, gguf_tensors(tiny_cfg, tiny_params),
                 meta={"flint.expert_gating_func": 1})
    expect(r"g.gguf: flint.expert_gating_func = 1: Flint routes with sigmoid", load, p)


# ---- corrupted bytes ----------------------------------------------------------------------------------------
def _corrupt(src, dst, tensor, byte_in_tensor, value):
    shutil.copyfile(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    t = next(t for t in r.tensors if t.name == tensor)
    t.data.reshape(-1)[byte_in_tensor] = value
    r.data.flush()
    return dst


def test_corrupted_nvfp4_scale_byte_ff(good, tmp_path):
    # block 3 of blk.3.ffn_up_exps (rows of 64 values: one block per row), its second scale byte
    p = _corrupt(good / "q.gguf", tmp_path / "c.gguf", "blk.3.ffn_up_exps.weight", 3 * 36 + 1, 0xFF)
    e = expect(r"c.gguf: tensor blk.3.ffn_up_exps.weight: corrupt NVFP4 data: scale byte 0xFF in block 3 "
               r"\(row 3, values 0..63\)", load, p)
    assert e.tensor == "blk.3.ffn_up_exps.weight"


def test_corrupted_bf16_bytes_nan(good, tmp_path, tiny_cfg):
    k = next(e.shape[1] for e in names.entries(tiny_cfg) if e.path == "layers.1.attn.o")
    i = k * 3 + 5  # row 3, column 5; bf16 NaN 0x7FC0, little-endian
    p = _corrupt(good / "m.gguf", tmp_path / "n.gguf", "blk.1.attn_output.weight", 2 * i, 0xC0)
    p = _corrupt(p, tmp_path / "n2.gguf", "blk.1.attn_output.weight", 2 * i + 1, 0x7F)
    expect(r"n2.gguf: tensor blk.1.attn_output.weight: non-finite value nan at index \(3, 5\)", load, p)


# ---- HF ----------------------------------------------------------------------------------------------------
def test_hf_missing_extra_wrong_shape_truncated(good, tiny_cfg, tmp_path):
    def variant(name, cfg):
        d = tmp_path / name
        shutil.copytree(good / "hf", d)
        json.dump(cfg.to_hf(), open(d / "config.json", "w"))
        return d
    six = tiny_cfg.replace(num_hidden_layers=6, layer_types=tiny_cfg.layer_types + ("full_attention",))
    expect(r"tensor model.layers.5.input_layernorm.weight: missing from the checkpoint \(and \d+ more\)", load,
           variant("missing", six))
    four = tiny_cfg.replace(num_hidden_layers=4, layer_types=tiny_cfg.layer_types[:4])
    expect(r"model.safetensors: tensor model.layers.4.\S+: not a tensor of Flint with this config", load,
           variant("extra", four))
    expect(r"model.safetensors: tensor model.embed_tokens.weight: shape \[256, 64\] disagrees with the config, "
           r"which needs \[320, 64\]", load, variant("shape", tiny_cfg.replace(vocab_size=320)))
    d = variant("trunc", tiny_cfg)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-10])
    expect(r"model.safetensors: tensor lm_head.weight: file is truncated", load, d)
    (d / "model.safetensors").write_bytes(data[:5])
    expect(r"model.safetensors: not a safetensors file", load, d)


def test_directory_that_is_no_checkpoint(tmp_path):
    expect(r"not a Flint checkpoint", load, tmp_path)


# ---- conversion safety ----------------------------------------------------------------------------------------
def test_failed_conversion_leaves_nothing(good, tmp_path):
    out = tmp_path / "out"
    expect(r"simulated failure", convert, good / "m.gguf", out, progress=False, _fail_after=40)
    p = _corrupt(good / "q.gguf", tmp_path / "late.gguf", "output.weight", 0, 0xFF)  # the last tensor
    expect(r"tensor output.weight: corrupt NVFP4 data", convert, p, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["late.gguf"]  # no DST, no temporary directory


def test_existing_destination_refused_unless_overwrite(good, tmp_path, tiny_cfg):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    expect(r"out: already exists \(pass --overwrite to replace it\)", convert, good / "m.gguf", out, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"
    convert(good / "m.gguf", out, overwrite=True, progress=False)
    assert load(out).cfg == tiny_cfg and not (out / "precious.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_cli_exit_codes(good, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(good / "m.gguf"), str(out), "--quiet"]) == 0
    assert "78 tensors" in capsys.readouterr().out
    assert main([str(good / "m.gguf"), str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"flint-convert: error: {out}: already exists (pass --overwrite to replace it)"]
    bad = _corrupt(good / "q.gguf", tmp_path / "bad.gguf", "blk.2.attn_k.weight", 0, 0xFF)
    assert main([str(bad), str(tmp_path / "o2"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "tensor blk.2.attn_k.weight" in err[0]
    with pytest.raises(SystemExit) as e:
        main([str(good / "m.gguf")])
    assert e.value.code == 2
    assert main([str(good / "m.gguf"), str(tmp_path / "o3"), "--quiet", "--quantize", "nvfp4",
                 "--config", str(good / "hf" / "config.json")]) == 0


def test_cli_entry_point():
    exe = os.path.join(os.path.dirname(sys.executable), "flint-convert")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--quantize" in r.stdout and "exit codes" in r.stdout
    r = subprocess.run([exe, "only-one-arg"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage: flint-convert" in r.stderr
