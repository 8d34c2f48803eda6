"""flint_jax.load -> Model (forward, tokenizer, engine) and `flint generate --model` on a written GGUF."""
import subprocess
import sys

import numpy as np
import pytest

import flint_jax
from flint_jax import model as M
from flint_jax.chat import FLINT_CHAT_TEMPLATE, train_bpe_tokenizer
from flint_jax.config import FlintConfig
from flint_jax.convert.gguf_writer import write_gguf
from flint_jax.params import init_params
from flint_jax.sampling import SamplingParams


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    import jax
    tok = train_bpe_tokenizer(["the cat sat on the mat. 12 + 30 = 42."] * 10, vocab_size=300)
    cfg = FlintConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=1024)
    params = init_params(cfg, jax.random.key(0))
    path = tmp_path_factory.mktemp("ck") / "tiny.gguf"
    write_gguf(path, cfg, params, weights="nvfp4", tokenizer_metadata=tok.to_gguf_metadata())
    return path, cfg, tok


def test_load_returns_a_model_with_forward_tokenizer_and_engine(gguf_path):
    path, cfg, tok = gguf_path
    model = flint_jax.load(path)
    # pad/eos ids come from the tokenizer metadata the file carries
    assert model.cfg.replace(pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id) == cfg
    assert model.chat_template == FLINT_CHAT_TEMPLATE
    ids = model.tokenizer.encode("the cat")
    assert ids == tok.encode("the cat")
    logits = model.forward([ids])
    assert logits.shape == (1, len(ids), cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(M.forward(model.params, np.asarray([ids]), cfg)))
    out = model.engine(max_batch=1, max_len=64).generate([ids], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].tokens) == 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward([[cfg.vocab_size]])


def test_generate_cli_runs_a_checkpoint(gguf_path):
    path, _, _ = gguf_path
    r = subprocess.run([sys.executable, "-m", "flint_jax.cli", "generate", "--model", str(path), "--prompt",
                        "the cat", "--max-tokens", "3", "--temperature", "0", "--max-len", "64"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the cat") and str(path) in r.stderr
    r = subprocess.run([sys.executable, "-m", "flint_jax.cli", "generate", "--model", "/nonexistent.gguf"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "nonexistent" in r.stderr
