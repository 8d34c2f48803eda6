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
