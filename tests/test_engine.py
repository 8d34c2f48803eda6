import jax.numpy as jnp
import pytest

from flint_jax import model as M
from flint_jax.engine import Engine
from flint_jax.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_cfg, tiny_params):
    return Engine(tiny_cfg, tiny_params, max_batch=2, max_len=48, chunk_size=4)


def test_queue_slots_and_greedy_match_the_reference(engine, tiny_cfg, tiny_params):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 10, [3, 3]]  # 4 requests over 2 slots
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    # Greedy: each generated token is the argmax of the reference logits at the position before it. Causal
    # attention lets every sequence be right-padded to one length, so one forward checks them all.
    seqs = [list(p) + r.tokens for p, r in zip(prompts, res)]
    width = max(map(len, seqs))
    logits = M.forward(tiny_params, jnp.asarray([s + [0] * (width - len(s)) for s in seqs]), tiny_cfg)
    for b, (prompt, r) in enumerate(zip(prompts, res)):
        assert r.finish_reason == "length" and len(r.tokens) == 6 and r.ttft_s > 0
        for i, tok in enumerate(r.tokens):
            assert int(jnp.argmax(logits[b, len(prompt) + i - 1])) == tok


def test_stop_tokens_per_request_settings_and_streaming(engine):
    greedy = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5))[0].tokens
    stop_at = greedy[2]
    events = list(engine.stream([[1, 2, 3], [4, 5]], [
        SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(stop_at,)),
        SamplingParams(temperature=1.0, max_tokens=3, seed=7)]))
    first = [e.token for e in events if e.request == 0]
    assert first == greedy[: greedy.index(stop_at) + 1]
    assert [e.finish_reason for e in events if e.request == 0][-1] == "stop"
    assert len([e for e in events if e.request == 1]) == 3


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(engine):
    s = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=5, seed=11)
    alone = engine.generate([[7, 7, 7]], s)[0].tokens
    together = engine.generate([[1, 2], [7, 7, 7]], [SamplingParams(seed=3, max_tokens=4), s])[1].tokens
    assert alone == together


def test_bad_requests_are_refused(engine, tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="prompt 0: token id 300"):
        engine.generate([[1, 300]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceed the engine's max_len 48"):
        engine.generate([[1] * 40], SamplingParams(max_tokens=9))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="at most 8 concurrent"):
        Engine(tiny_cfg, tiny_params, max_batch=9)


def test_fp8_kv_cache_engine(tiny_cfg, tiny_params):
    """Engine(kv_dtype="fp8"): the full layers' caches hold FP8 (the rings BF16), generation runs and is
    reproducible; an unknown kv_dtype is refused with the choices named."""
    eng = Engine(tiny_cfg, tiny_params, max_batch=1, max_len=32, chunk_size=4, kv_dtype="fp8")
    dtypes = {str(c.k.dtype) for c in eng.state.layers}
    assert dtypes == {"float8_e4m3fn", "bfloat16"}
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    first = eng.generate([[1, 2, 3, 4, 5, 6]], greedy)[0].tokens
    assert len(first) == 5 and eng.generate([[1, 2, 3, 4, 5, 6]], greedy)[0].tokens == first
    with pytest.raises(ValueError, match=r"kv_dtype must be one of \['bf16', 'fp8'\], got 'fp16'"):
        Engine(tiny_cfg, tiny_params, max_batch=1, max_len=32, kv_dtype="fp16")


def test_fp8_kv_cache_refuses_q_norm_past_fp16(monkeypatch, tiny_cfg, tiny_params):
    """The Pallas path computes an FP8 cache's scores in FP16 (decode_attention.FP8_HALF_SCORES): Engine refuses a
    model whose full layers' q_norm weights could push q past FP16's range, naming the layer and tensor; the same
    model is accepted with BF16 caches, and with the knob off."""
    import dataclasses
    from flint_jax.pallas_kernels import decode_attention as DA
    i = tiny_cfg.full_layers[-1]
    layer = tiny_params.layers[i]
    big = layer.attn.q_norm.at[3].set(-32768.0)  # sqrt(head_dim) * 2^15 > 65504 for head_dim >= 4
    layers = list(tiny_params.layers)
    layers[i] = dataclasses.replace(layer, attn=dataclasses.replace(layer.attn, q_norm=big))
    params = dataclasses.replace(tiny_params, layers=tuple(layers))
    Engine(tiny_cfg, tiny_params, max_batch=1, max_len=32, impl="pallas", kv_dtype="fp8")
    with pytest.raises(ValueError, match=rf"layer {i} self_attn.q_norm: max \|weight\| 32768 "):
        Engine(tiny_cfg, params, max_batch=1, max_len=32, impl="pallas", kv_dtype="fp8")
    Engine(tiny_cfg, params, max_batch=1, max_len=32, impl="pallas", kv_dtype="bf16")
    monkeypatch.setattr(DA, "FP8_HALF_SCORES", False)
    Engine(tiny_cfg, params, max_batch=1, max_len=32, impl="pallas", kv_dtype="fp8")


def test_pallas_prefill_program_compiles_once_across_requests():
    """In a fresh process, the engine's prefill programs (two segments on the tiny config) compile on the first
    request only. Pallas' interpret mode
    imports a module that registers a jax config option during the first trace; unless flint_jax.model imports it
    first, the second request's trace context differs and the whole program compiles again (found 2026-11-30)."""
    import os
    import subprocess
    import sys
    script = (
        "import jax; jax.config.update('jax_platforms', 'cpu')\n"
        "from flint_jax.config import FlintConfig\n"
        "from flint_jax.params import init_params\n"
        "from flint_jax import engine as E\n"
        "from flint_jax.sampling import SamplingParams\n"
        "cfg = FlintConfig.tiny()\n"
        "eng = E.Engine(cfg, init_params(cfg, jax.random.key(0)), max_batch=1, max_len=64, impl='pallas')\n"
        "for prompt in ([1, 2, 3], [4, 5, 6]):\n"
        "    eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))\n"
        "from flint_jax import prefill_pipeline as PP\n"
        "print('prefill compiles', PP._segment._cache_size())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=root,
                       env={**os.environ, "PYTHONPATH": root})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "prefill compiles 2" in p.stdout, p.stdout[-500:]
