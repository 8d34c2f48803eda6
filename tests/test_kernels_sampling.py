"""The top-k sampling kernels (pallas_kernels/top_k_sampling.py) against their reference and against `sampling.sample`
(interpret mode on the CPU; compiled on the GPU with FLINT_PALLAS_COMPILED=1)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.engine import decode_sampler
from flint_jax.pallas_kernels import top_k_sampling as T
from flint_jax.sampling import sample
from kernel_mode import INTERPRET

V = 5000  # not a multiple of the 1,024-logit chunk: the last chunk is masked


def _kernel(logits, keys, temperature, top_k, top_p):
    return np.asarray(T.sample_top_k(logits, keys, temperature, top_k, top_p, interpret=INTERPRET))


def _rows():
    """Eight rows covering the settings: Flint's defaults, greedy, top_k 1 and K_MAX, narrow and open nuclei,
    a low and a high temperature."""
    temperature = jnp.array([1.0, 0.0, 1.0, 1.0, 0.7, 1.3, 1.0, 0.0], jnp.float32)
    top_k = jnp.array([20, 20, 1, T.K_MAX, 5, 20, 8, 0], jnp.int32)
    top_p = jnp.array([0.95, 0.95, 0.95, 1.0, 0.5, 0.9, 0.3, 1.0], jnp.float32)
    return temperature, top_k, top_p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_equal_the_reference_and_the_sort(seed):
    """Continuous random logits (no ties): the kernels, their reference and the vocabulary sort draw the same token
    from the same key, over several keys per row."""
    settings = _rows()
    logits = jax.random.normal(jax.random.key(seed), (8, V)) * 4.0
    for draw in range(3):
        keys = jax.random.split(jax.random.key(100 * seed + draw), 8)
        got = _kernel(logits, keys, *settings)
        np.testing.assert_array_equal(got, np.asarray(T.ref_sample_top_k(logits, keys, *settings)))
        np.testing.assert_array_equal(got, np.asarray(sample(logits, keys, *settings)))
    np.testing.assert_array_equal(got[[1, 7]], np.asarray(logits).argmax(axis=-1)[[1, 7]])  # greedy rows


def test_ties_go_to_the_lower_id():
    """Logits with many exact ties (a few distinct values): the kernels keep the k lowest ids among tied values, as
    their reference does (`lax.top_k`'s order); a greedy row takes the lowest id holding the maximum."""
    logits = jnp.floor(jax.random.uniform(jax.random.key(7), (8, V)) * 6.0)  # six values, ~830 copies of each
    settings = _rows()
    for draw in range(3):
        keys = jax.random.split(jax.random.key(draw), 8)
        got = _kernel(logits, keys, *settings)
        np.testing.assert_array_equal(got, np.asarray(T.ref_sample_top_k(logits, keys, *settings)))
        top = np.asarray(logits).argmax(axis=-1)
        assert got[1] == top[1] and got[2] == top[2]  # greedy, and top_k 1
        for b, k in enumerate(np.asarray(settings[1])):  # every draw is one of the row's k lowest-id maxima
            if k:
                lowest = np.flatnonzero(np.asarray(logits[b]) == np.asarray(logits[b]).max())[:k]
                assert got[b] in lowest


def test_masked_vocabulary_and_a_short_row():
    """-inf logits (masked tokens) are never drawn, even when fewer than k tokens are finite."""
    logits = jax.random.normal(jax.random.key(3), (8, V))
    allowed = np.zeros((8, V), bool)
    allowed[:, 4000:4003] = True  # three finite tokens, in the masked last chunk's neighbourhood
    allowed[0, :2048] = True
    logits = jnp.where(jnp.asarray(allowed), logits, -jnp.inf)
    settings = _rows()
    for draw in range(4):
        keys = jax.random.split(jax.random.key(draw), 8)
        got = _kernel(logits, keys, *settings)
        assert allowed[np.arange(8), got].all(), got
        np.testing.assert_array_equal(got, np.asarray(T.ref_sample_top_k(logits, keys, *settings)))


def test_the_drawn_tokens_follow_the_filtered_distribution():
    """Many draws of one row (top_k 3, top_p 1): the frequencies are the renormalised top-3 probabilities."""
    n = 512
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.full((n, 2048), -jnp.inf).at[:, 1000:1004].set(jnp.log(jnp.asarray(probs)))
    keys = jax.random.split(jax.random.key(11), n)
    got = _kernel(logits, keys, jnp.ones(n), jnp.full(n, 3, jnp.int32), jnp.ones(n))
    assert set(got) <= {1000, 1001, 1002}
    freq = np.bincount(got - 1000, minlength=3)[:3] / n
    np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.07)


def test_decode_sampler_picks_the_kernels_only_where_every_row_allows_them():
    assert decode_sampler("pallas", [(1.0, 20), (0.0, 0), (0.7, T.K_MAX)]) == "top_k"
    assert decode_sampler("pallas", [(1.0, 20), (1.0, 0)]) == "sort"  # top_k off: the nucleus may be wide
    assert decode_sampler("pallas", [(1.0, T.K_MAX + 1)]) == "sort"
    assert decode_sampler("xla", [(1.0, 20)]) == "sort"  # the reference path stays plain XLA
    assert T.supports(20, 1.0) and T.supports(0, 0.0) and not T.supports(0, 1.0)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_two_triton_kernels(monkeypatch):
    """Flint's vocabulary, lowered for the GPU on this CPU (Pallas -> Triton IR): two kernels."""
    from test_kernels_gemv import TRITON_CALL, lower_for_gpu
    args = (jnp.zeros((2, 151552), jnp.float32), jax.random.split(jax.random.key(1), 2), jnp.ones(2),
            jnp.full(2, 20, jnp.int32), jnp.full(2, 0.95))
    module = lower_for_gpu(monkeypatch, lambda *a: T.sample_top_k(*a), *args)
    assert module.count(TRITON_CALL) == 2
