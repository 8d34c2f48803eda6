"""Several decode steps per dispatch (`Engine(steps_per_dispatch=n)`, `engine.decode_steps`), and each burst
dispatched before the previous one is read (`overlap_dispatch`): a request's tokens, finish reason and streamed
events are the same for every n and either way; only how they are grouped into device calls changes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.engine import Engine, burst_buffer, decode_burst, decode_steps
from flint_jax.sampling import SamplingParams
from flint_jax.state import init_state

MAX_LEN = 24


@pytest.fixture(scope="module")
def engines(tiny_cfg, tiny_params):
    """(steps_per_dispatch, overlap_dispatch) -> Engine; (1, False) is one burst of one step per host read."""
    return {(n, o): Engine(tiny_cfg, tiny_params, max_batch=2, max_len=MAX_LEN, chunk_size=4, steps_per_dispatch=n,
                           overlap_dispatch=o)
            for n, o in ((1, False), (1, True), (3, False), (3, True), (4, True))}


def _run(engine, prompts, sampling):
    """(tokens, finish_reason) per request, from the stream, checked against `generate`."""
    events: dict[int, list] = {i: [] for i in range(len(prompts))}
    for e in engine.stream(prompts, sampling):
        events[e.request].append((e.token, e.finish_reason))
    done = engine.generate(prompts, sampling)
    for i, r in enumerate(done):
        assert [t for t, _ in events[i]] == r.tokens
        assert [f for _, f in events[i]] == [None] * (len(r.tokens) - 1) + [r.finish_reason]
    return [(r.tokens, r.finish_reason) for r in done]


def _first_new(tokens, start):
    """An index >= start whose token does not occur before it (a stop token that first fires there)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_every_steps_per_dispatch_gives_the_same_completions(engines, temperature):
    def params(max_tokens, seed, stop=()):
        return SamplingParams(temperature=temperature, top_k=0 if temperature else 20, top_p=1.0,
                              max_tokens=max_tokens, seed=seed, stop_token_ids=stop)

    # The token at index 2 comes from the first burst's second step for n = 3 and 4: a stop token there is
    # mid-burst. max_tokens 6 ends inside the second burst for both.
    probe = engines[1, False].generate([[4, 1, 4]], params(8, seed=5))[0].tokens
    stop_at = _first_new(probe, 2)
    prompts = [[4, 1, 4], [1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 10, [3, 3], [2] * 14]
    sampling = [params(8, seed=5, stop=(probe[stop_at],)),  # stops mid-burst
                params(6, seed=1),  # max_tokens mid-burst
                params(2, seed=2),  # one decode step, in the burst of its batch-mate
                params(9, seed=3),  # takes over a freed slot
                params(1, seed=4),  # prefill only
                params(MAX_LEN - 14, seed=6)]  # prompt + max_tokens == max_len
    reference = _run(engines[1, False], prompts, sampling)
    assert reference[0] == (probe[:stop_at + 1], "stop") and stop_at + 1 < 8
    assert [len(t) for t, _ in reference[1:]] == [6, 2, 9, 1, MAX_LEN - 14]
    assert all(reason == "length" for _, reason in reference[1:])
    for key, engine in engines.items():
        assert _run(engine, prompts, sampling) == reference, f"(steps_per_dispatch, overlap_dispatch) = {key}"
        # No row ever held more than max_len - 1 tokens (the last sampled token is never written).
        assert int(jnp.max(engine.state.lengths)) <= MAX_LEN - 1


def test_decode_steps_equals_single_steps_and_respects_limits(tiny_cfg, tiny_params):
    """One 4-step call against four 1-step calls on the same state: row 0 runs all 4 steps, row 1 reaches its
    limit after 2, row 2 is inactive; the final states are identical and inactive/finished rows stay put."""
    B = 3
    state = init_state(tiny_cfg, B, MAX_LEN)
    state = type(state)(layers=state.layers, lengths=jnp.array([5, 7, 3], jnp.int32))
    tokens = np.array([11, 22, 33], np.int32)
    active = np.array([True, True, False])
    limits = np.array([MAX_LEN, 9, MAX_LEN], np.int32)
    keys = jax.random.split(jax.random.key(1), B)
    generated = np.array([1, 3, 2], np.int32)
    settings = (np.array([1.0, 0.0, 1.0], np.float32), np.zeros(B, np.int32), np.ones(B, np.float32))
    copy = lambda s: jax.tree.map(jnp.copy, s)  # noqa: E731 (decode_steps donates its state)

    burst, burst_state = decode_steps(tiny_params, copy(state), tokens, active, limits, keys, generated, *settings,
                                      cfg=tiny_cfg, num_steps=4)
    steps, s, t = [], copy(state), tokens
    for i in range(4):
        out, s = decode_steps(tiny_params, s, t, active, limits, keys, generated + i, *settings, cfg=tiny_cfg,
                              num_steps=1)
        steps.append(out[0])
        t = np.where(np.asarray(out[0]) >= 0, np.asarray(out[0]), t)
    burst = np.asarray(burst)
    assert burst.shape == (4, B)
    np.testing.assert_array_equal(burst, np.stack(steps))
    assert (burst[:, 0] >= 0).all() and list(burst[2:, 1]) == [-1, -1] and (burst[:, 2] == -1).all()
    assert list(np.asarray(burst_state.lengths)) == [9, 9, 3]
    for a, b in zip(jax.tree.leaves(burst_state), jax.tree.leaves(s)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(burst_state.layers), jax.tree.leaves(state.layers)):
        np.testing.assert_array_equal(np.asarray(a)[2], np.asarray(b)[2])  # the inactive row


def test_pallas_bursts_match_single_steps(tiny_cfg, tiny_params):
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    sampling = [SamplingParams(temperature=0.0, max_tokens=5), SamplingParams(temperature=1.0, max_tokens=4, seed=9)]
    results = [Engine(tiny_cfg, tiny_params, max_batch=2, max_len=16, chunk_size=8, impl="pallas",
                      steps_per_dispatch=n).generate(prompts, sampling) for n in (1, 3)]
    assert [(r.tokens, r.finish_reason) for r in results[0]] == [(r.tokens, r.finish_reason) for r in results[1]]


def test_decode_burst_chains_bursts_through_its_buffers_and_donates_out(tiny_cfg, tiny_params):
    """decode_burst reads its tokens and generated counts from the previous buffer and equals decode_steps; its
    `out` argument is donated and aliased to the result (jit prunes an unused argument, and the donation with it,
    unless kept), so the engine's two buffers keep their device addresses (runs CB-CC)."""
    B, n = 2, 3
    state = init_state(tiny_cfg, B, MAX_LEN)
    state = type(state)(layers=state.layers, lengths=jnp.array([4, 6], jnp.int32))
    tokens, generated = np.array([7, 9], np.int32), np.array([1, 2], np.int32)
    active, limits = np.array([True, True]), np.array([MAX_LEN, 8], np.int32)
    keys = jax.random.split(jax.random.key(3), B)
    settings = (np.array([1.0, 0.0], np.float32), np.full(B, 20, np.int32), np.full(B, 0.95, np.float32))
    copy = lambda s: jax.tree.map(jnp.copy, s)  # noqa: E731
    args = (active, limits, keys, *settings)

    ref1, s1 = decode_steps(tiny_params, copy(state), tokens, *args[:3], generated, *settings, cfg=tiny_cfg,
                            num_steps=n)
    ref2, _ = decode_steps(tiny_params, s1, np.maximum(np.asarray(ref1)[-1], 0), *args[:3], generated + n,
                           *settings, cfg=tiny_cfg, num_steps=n)
    first = jnp.asarray(burst_buffer(tokens, generated, n))
    buf1, s = decode_burst(tiny_params, copy(state), jnp.zeros((n + 1, B), jnp.int32), first, *args, cfg=tiny_cfg,
                           num_steps=n)
    buf2, _ = decode_burst(tiny_params, s, first, buf1, *args, cfg=tiny_cfg, num_steps=n)
    np.testing.assert_array_equal(np.asarray(buf1), np.concatenate([np.asarray(ref1), [generated + n]]))
    np.testing.assert_array_equal(np.asarray(buf2), np.concatenate([np.asarray(ref2), [generated + 2 * n]]))
    assert list(np.asarray(buf1)[:, 1]) == [int(t) for t in np.asarray(ref1)[:, 1]] + [2 + n]

    hlo = decode_burst.lower(tiny_params, copy(state), buf1, buf2, *args, cfg=tiny_cfg, num_steps=n).as_text()
    main = next(line for line in hlo.splitlines() if "func.func public @main" in line)
    buffers = [a for a in main.split("%arg")[1:] if a.split(":", 1)[1].strip().startswith(f"tensor<{n + 1}x{B}xi32>")]
    assert len(buffers) == 2, buffers  # out, then last
    assert "tf.aliasing_output = 0" in buffers[0] and "aliasing_output" not in buffers[1]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "sequential"])
def test_bursts_still_admit_a_queued_request_early(engines, overlap):
    """A request that ends at its prefill frees its slot while another row decodes: the queued request starts after
    one burst of that row, not when it finishes (the decode loop runs bursts back to back only while no slot
    waits)."""
    sampling = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=1),
                SamplingParams(temperature=0.0, max_tokens=3)]
    order = [e.request for e in engines[3, overlap].stream([[4, 1, 4], [2, 2], [5, 6]], sampling)]
    assert order.count(0) == 12 and order.count(2) == 3
    first_of_2 = order.index(2)
    assert order[:first_of_2].count(0) <= 1 + 3  # request 0's first token, then at most one burst of 3


def test_overlap_dispatch_is_on_by_default(tiny_cfg, tiny_params):
    """overlap_dispatch: on by default for any burst length (run CD: one step per dispatch 3.63 -> 2.71 ms/token)."""
    def make(n, **kw):
        return Engine(tiny_cfg, tiny_params, max_len=16, steps_per_dispatch=n, **kw)

    assert make(1).overlap_dispatch and make(4).overlap_dispatch
    assert not make(1, overlap_dispatch=False).overlap_dispatch
