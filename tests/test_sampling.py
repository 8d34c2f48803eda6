import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.sampling import SamplingParams, filter_logits, sample


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


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(max_tokens=0), "max_tokens"),
])
def test_invalid_sampling_values_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
