import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import sampling
from flint_jax.sampling import SamplingParams, filter_logits, filter_logits_top, fits_top_k_path, sample


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def test_defaults_are_flints():
    s = SamplingParams()
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 0.95, 20)


def test_top_k_one_equals_greedy():
    logits = jax.random.normal(jax.random.key(1), (6, 50))
    one = jnp.ones(6)
    got = sample(logits, _keys(6), one, jnp.ones(6, jnp.int32), one)
    greedy = sample(logits, _keys(6), jnp.zeros(6), jnp.zeros(6, jnp.int32), one)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, -1)))
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(jnp.argmax(logits, -1)))


def test_top_k_and_top_p_filter_as_specified():
    probs = jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = jnp.log(probs)
    kept = lambda k, p: np.isfinite(np.asarray(filter_logits(logits, jnp.ones(1), jnp.array([k]), jnp.array([p]))))[0]
    np.testing.assert_array_equal(kept(2, 1.0), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(kept(0, 0.5), [1, 0, 0, 0, 0])  # 0.5 reached by the top token alone
    np.testing.assert_array_equal(kept(0, 0.7), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(kept(0, 0.71), [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(kept(3, 0.95), [1, 1, 1, 0, 0])  # top-k first, then the nucleus of the rest
    np.testing.assert_array_equal(kept(0, 1.0), [1, 1, 1, 1, 1])


def test_sampled_tokens_stay_inside_the_filter_and_follow_the_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    toks = np.asarray(sample(logits, _keys(4000, 3), jnp.ones(4000), jnp.full(4000, 3, jnp.int32),
                             jnp.ones(4000)))
    assert set(toks) == {0, 1, 2}
    freq = np.bincount(toks, minlength=4) / 4000
    np.testing.assert_allclose(freq[:3], np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


def test_fixed_seeds_reproduce_and_differ_across_seeds():
    logits = jax.random.normal(jax.random.key(2), (8, 100))
    args = (jnp.ones(8), jnp.zeros(8, jnp.int32), jnp.ones(8))
    a = sample(logits, _keys(8, 5), *args)
    b = sample(logits, _keys(8, 5), *args)
    c = sample(logits, _keys(8, 6), *args)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("vocab, segment", [(3000, 1024), (5000, 256), (300, 1024)],
                         ids=["padded_segments", "many_segments", "one_sort"])
def test_top_k_path_gives_the_sort_paths_filtered_logits(vocab, segment, monkeypatch):
    """filter_logits_top (segment sorts, no sort of the vocabulary) against filter_logits: bit-identical filtered
    logits for mixed per-row settings (top_k 1..TOP_K_CANDIDATES), including ties at the k-th value (both keep
    every tied token) and top_k = TOP_K_CANDIDATES; so the sampled tokens do not depend on the path."""
    monkeypatch.setattr(sampling, "TOP_K_SEGMENT", segment)
    rows = 64
    logits = 4.0 * jax.random.normal(jax.random.key(3), (rows, vocab))
    logits = logits.at[0, :5].set(40.0)  # five tied maxima: top_k 2 keeps all five
    logits = logits.at[2, 7:300:7].set(30.0)  # 42 tied maxima spread over segments
    rng = np.random.default_rng(0)
    w = sampling.TOP_K_CANDIDATES
    top_k = jnp.asarray(rng.integers(1, w + 1, rows), jnp.int32).at[0].set(2).at[1].set(w)
    top_p = jnp.asarray(rng.choice([0.3, 0.8, 0.95, 1.0], rows), jnp.float32).at[0].set(1.0).at[2].set(1.0)
    temp = jnp.asarray(rng.choice([0.5, 1.0, 1.7], rows), jnp.float32)
    want = np.asarray(jax.jit(filter_logits)(logits, temp, top_k, top_p))
    got = np.asarray(jax.jit(filter_logits_top)(logits, temp, top_k, top_p))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want[0]).sum() == 5 and np.isfinite(want[2]).sum() == 42
    assert len({int(np.isfinite(r).sum()) for r in want}) > 10  # the settings really differ per row
    np.testing.assert_array_equal(np.asarray(sampling.top_values(logits, w)),
                                  np.sort(np.asarray(logits), axis=-1)[:, ::-1][:, :w])
    keys = _keys(rows, 9)
    np.testing.assert_array_equal(np.asarray(sample(logits, keys, temp, top_k, top_p, top_k_path=True)),
                                  np.asarray(sample(logits, keys, temp, top_k, top_p)))


def test_a_rows_filter_does_not_depend_on_its_batch_mates():
    """A row with top_k 20 next to one without a top-k filter (the sort path) equals the same row alone on the
    top-k path."""
    logits = 3.0 * jax.random.normal(jax.random.key(4), (2, 2000))
    t, p = jnp.ones(2), jnp.full(2, 0.9)
    mixed = np.asarray(filter_logits(logits, t, jnp.array([20, 0], jnp.int32), p))
    alone = np.asarray(filter_logits_top(logits[:1], t[:1], jnp.array([20], jnp.int32), p[:1]))
    np.testing.assert_array_equal(mixed[:1], alone)
    assert np.isfinite(mixed[1]).sum() > 20


def test_fits_top_k_path():
    assert fits_top_k_path([20]) and fits_top_k_path([1, 64])
    assert not fits_top_k_path([20, 0])  # a row without a top-k filter needs the whole vocabulary
    assert not fits_top_k_path([65])


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(max_tokens=0), "max_tokens"),
])
def test_invalid_sampling_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
