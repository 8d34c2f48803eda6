import json

import pytest

from flint_jax.config import FULL, SLIDING, ConfigError, FlintConfig
from flint_jax.params import abstract_params, param_count, weight_bytes_per_token
from flint_jax.state import kv_bytes_read, state_bytes


def test_flint_preset_matches_the_published_shape():
    cfg = FlintConfig.flint()
    assert cfg.num_hidden_layers == 49 and len(cfg.sliding_layers) == 35 and len(cfg.full_layers) == 14
    assert cfg.full_layers[:4] == (3, 6, 10, 13)
    counts = param_count(cfg)
    assert 39.5e9 < counts.total < 39.9e9  # ~39.7B
    assert 2.3e9 < counts.active - counts.embedding < 2.5e9  # ~2.4B active without the embedding


def test_state_bytes_are_28_kib_per_token_of_full_history():
    cfg = FlintConfig.flint()
    per_token = state_bytes(cfg, 1, 2) - state_bytes(cfg, 1, 1)
    assert per_token == 28 * 1024
    # At 100K context a decode step reads ~2.9 GB of KV; with NVFP4 weights ~4.3 GB in all (FLINT_SPEC, issue 6).
    kv = kv_bytes_read(cfg, 100_000)
    assert 2.85e9 < kv < 2.92e9
    assert 4.2e9 < kv + weight_bytes_per_token(cfg, "nvfp4") < 4.4e9
    assert 7.6e9 < kv + weight_bytes_per_token(cfg, "bf16") < 7.9e9
    # kv_dtype="fp8": the full layers' history costs half (14 KiB per token), the rings (BF16) the same.
    assert state_bytes(cfg, 1, 2, "fp8") - state_bytes(cfg, 1, 1, "fp8") == 14 * 1024
    assert kv - kv_bytes_read(cfg, 100_000, "fp8") == 14 * 100_000 * 1024  # 14 full layers, 1 KiB per token each


def test_tiny_exercises_every_feature():
    cfg = FlintConfig.tiny()
    assert set(cfg.layer_types) == {SLIDING, FULL}
    assert 0 < cfg.first_k_dense_replace < cfg.num_hidden_layers  # dense and MoE layers
    assert cfg.n_shared_experts == 1 and cfg.num_experts_per_tok < cfg.n_routed_experts
    assert cfg.sliding_window < 16  # the ring wraps within a short test


def test_hf_round_trip(tmp_path):
    cfg = FlintConfig.tiny()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert FlintConfig.from_hf(tmp_path) == cfg
    assert FlintConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("change, field", [
    (dict(num_attention_heads=5), "num_attention_heads"),
    (dict(layer_types=(SLIDING,) * 3), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(layer_types=("sliding_attention", "local", SLIDING, SLIDING, FULL)), "layer_types[1]"),
    (dict(hidden_size=100), "hidden_size"),
    (dict(eos_token_id=[999]), "eos_token_id"),
])
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        FlintConfig.tiny(**change)


def test_from_hf_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        FlintConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "flint", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="missing field"):
        FlintConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        FlintConfig.from_hf(tmp_path)


def test_abstract_params_allocate_nothing_and_match_kinds():
    tree = abstract_params(FlintConfig.flint(), "nvfp4")
    assert tree.layers[5].mlp.gate.codes.shape == (256, 512, 1024)
    assert tree.layers[5].mlp.gate.global_scale.shape == (256,)
    assert str(tree.layers[5].mlp.gate.scales.dtype) == "float8_e4m3fn"
    assert tree.layers[0].mlp.down.codes.shape == (2048, 5120)
