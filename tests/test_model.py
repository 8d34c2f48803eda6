"""The cached steps against the one-shot reference forward, and the attention/routing semantics of FLINT_SPEC."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layers as L
from flint_jax import model as M
from flint_jax.config import SLIDING, FlintConfig
from flint_jax.params import init_params
from flint_jax.state import init_state, reset_slots

step = jax.jit(M.model_step, static_argnames=("cfg", "impl"))


def run_chunks(params, cfg, tokens, chunks, max_len=64):
    """Feed tokens [B, N] through the state in chunks; return FP32 logits [B, N, V]."""
    state = init_state(cfg, tokens.shape[0], max_len)
    outs, pos = [], 0
    for T in chunks:
        h, state = step(params, state, tokens[:, pos:pos + T], jnp.full((tokens.shape[0],), T, jnp.int32), cfg)
        outs.append(M.lm_logits(params, h, cfg))
        pos += T
    assert pos == tokens.shape[1]
    return jnp.concatenate(outs, axis=1), state


def assert_logits_close(got, ref):
    # Both paths round at the same BF16 points; only FP32 summation order may differ (different key-set sizes,
    # gathered vs grouped experts), which can flip a last BF16 bit. In practice the results are identical.
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-2 * float(jnp.abs(ref).max()), rtol=0)
    assert (jnp.argmax(got, -1) == jnp.argmax(ref, -1)).mean() > 0.97


@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
@pytest.mark.parametrize("chunks", [[23], [7, 3, 1, 1, 4, 7], [2] * 8 + [1] * 7, [12, 11]])
def test_prefill_then_decode_equals_reference_forward(tiny_cfg, weights, chunks, tiny_params, tiny_params_nvfp4):
    params = tiny_params if weights == "bf16" else tiny_params_nvfp4
    tokens = jax.random.randint(jax.random.key(1), (2, 23), 0, tiny_cfg.vocab_size)
    ref = M.forward(params, tokens, tiny_cfg)
    got, state = run_chunks(params, tiny_cfg, tokens, chunks)
    assert 23 > 4 * tiny_cfg.sliding_window  # the ring wrapped several times
    assert_logits_close(got, ref)
    np.testing.assert_array_equal(np.asarray(state.lengths), [23, 23])


def test_batch_of_different_lengths_equals_each_alone(tiny_cfg, tiny_params):
    lens = [9, 3, 14]
    toks = [jax.random.randint(jax.random.key(10 + i), (n + 4,), 0, tiny_cfg.vocab_size) for i, n in enumerate(lens)]
    B, C = len(lens), 8
    padded = np.zeros((B, 16), np.int32)
    for b, n in enumerate(lens):
        padded[b, :n] = np.asarray(toks[b][:n])
    state = init_state(tiny_cfg, B, 64)
    prefilled = np.zeros(B, np.int32)
    last = [None] * B
    for c0 in range(0, 16, C):  # chunked prefill, each row with its own count of real tokens
        n_new = np.clip(np.array(lens) - c0, 0, C).astype(np.int32)
        h, state = step(tiny_params, state, jnp.asarray(padded[:, c0:c0 + C]), jnp.asarray(n_new), tiny_cfg)
        lg = M.lm_logits(tiny_params, M.last_hidden(h, jnp.asarray(n_new)), tiny_cfg)
        for b in range(B):
            if n_new[b] > 0:
                last[b] = lg[b]
        prefilled += n_new
    for t in range(4):  # decode 4 tokens for everyone, each at its own position
        cur = jnp.asarray([int(toks[b][lens[b] + t]) for b in range(B)], jnp.int32)
        h, state = step(tiny_params, state, cur[:, None], jnp.ones((B,), jnp.int32), tiny_cfg)
        last = list(M.lm_logits(tiny_params, h[:, 0], tiny_cfg))
    for b, n in enumerate(lens):
        alone = M.forward(tiny_params, toks[b][None, : n + 4], tiny_cfg)[0, -1]
        assert_logits_close(last[b], alone)


def test_reset_slot_lets_a_new_sequence_start_clean(tiny_cfg, tiny_params):
    a = jax.random.randint(jax.random.key(2), (1, 11), 0, tiny_cfg.vocab_size)
    b = jax.random.randint(jax.random.key(3), (1, 6), 0, tiny_cfg.vocab_size)
    state = init_state(tiny_cfg, 1, 32)
    _, state = step(tiny_params, state, a, jnp.array([11]), tiny_cfg)
    state = reset_slots(state, jnp.array([True]))
    h, state = step(tiny_params, state, b, jnp.array([6]), tiny_cfg)
    assert_logits_close(M.lm_logits(tiny_params, h, tiny_cfg), M.forward(tiny_params, b, tiny_cfg))


def test_inactive_rows_are_untouched(tiny_cfg, tiny_params):
    state = init_state(tiny_cfg, 2, 32)
    toks = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
    _, state = step(tiny_params, state, toks, jnp.array([3, 0]), tiny_cfg)
    np.testing.assert_array_equal(np.asarray(state.lengths), [3, 0])
    ring = state.layers[0]
    assert (np.asarray(ring.pos[1]) == -1).all() and (np.asarray(ring.pos[0]) >= 0).sum() == 3


def test_sliding_layers_ignore_keys_beyond_the_window():
    # With only sliding layers, position p sees tokens >= p - L*(W-1): a change far before that cannot matter.
    cfg = FlintConfig.tiny(layer_types=(SLIDING,) * 5)
    params = init_params(cfg, jax.random.key(4))
    toks = jax.random.randint(jax.random.key(5), (1, 30), 0, cfg.vocab_size)
    changed = toks.at[0, :8].set((toks[0, :8] + 1) % cfg.vocab_size)
    a, b = M.forward(params, toks, cfg), M.forward(params, changed, cfg)
    reach = 5 * (cfg.sliding_window - 1)
    np.testing.assert_array_equal(np.asarray(a[0, 8 + reach:]), np.asarray(b[0, 8 + reach:]))
    assert not np.array_equal(np.asarray(a[0, 8]), np.asarray(b[0, 8]))  # ...and inside the reach it does


def test_window_mask_counts_the_query_itself():
    mask = L.attention_mask(jnp.array([[10]]), jnp.arange(12)[None], window=3)
    np.testing.assert_array_equal(np.asarray(mask[0, 0]), [False] * 8 + [True, True, True, False])


def _attention_inputs(seed=0, T=3, S=7):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (1, T, 4, 16)).astype(jnp.bfloat16)
    k = jax.random.normal(k2, (1, 2, S, 16)).astype(jnp.bfloat16)
    v = jax.random.normal(k3, (1, 2, S, 16)).astype(jnp.bfloat16)
    mask = L.attention_mask(jnp.arange(S - T, S)[None], jnp.arange(S)[None], None)
    return q, k, v, mask


def test_sink_of_minus_infinity_is_plain_softmax():
    q, k, v, mask = _attention_inputs()
    got = L.attend(q, k, v, mask, jnp.full((4,), -jnp.inf))
    kk, vv = jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1)  # query head j reads KV head j // 2
    s = jnp.einsum("bthd,bhsd->bhts", q.astype(jnp.float32), kk.astype(jnp.float32)) / math.sqrt(16)
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    want = jnp.einsum("bhts,bhsd->bthd", p, vv.astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_large_sink_damps_attention_by_the_formula():
    q, k, v, mask = _attention_inputs(1)
    sinks = jnp.array([0.0, 2.0, 5.0, 30.0])
    got = L.attend(q, k, v, mask, sinks).astype(jnp.float32)
    plain = L.attend(q, k, v, mask, jnp.full((4,), -jnp.inf)).astype(jnp.float32)
    kk = jnp.repeat(k, 2, axis=1).astype(jnp.float32)
    s = jnp.einsum("bthd,bhsd->bhts", q.astype(jnp.float32), kk) / math.sqrt(16)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    mass = jnp.sum(jnp.exp(s), -1)  # [1, H, T]
    damp = mass / (mass + jnp.exp(sinks)[None, :, None])
    want = plain * jnp.moveaxis(damp, 1, 2)[..., None]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)
    assert float(jnp.abs(got[:, :, 3]).max()) < 1e-6  # a sink of 30 swallows the head


def test_routing_picks_experts_and_weights_as_specified():
    cfg = FlintConfig.tiny(num_experts_per_tok=3)
    H, E = cfg.hidden_size, cfg.n_routed_experts
    b = jnp.zeros((1, H), jnp.bfloat16).at[0, 0].set(1.0)
    logits = jnp.array([0.5, 2.0, 1.0, 1.0, -1.0, 1.0, 0.0, 3.0])
    router = jnp.zeros((E, H), jnp.float32).at[:, 0].set(logits)
    ids, w = L.route(b, router, jnp.zeros(E), cfg)
    # 7 and 1 lead; 2, 3 and 5 tie at 1.0: the lowest index, 2, wins.
    np.testing.assert_array_equal(np.asarray(ids[0]), [7, 1, 2])
    sig = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(np.asarray(w[0]), np.asarray(sig[jnp.array([7, 1, 2])] / sig[jnp.array([7, 1, 2])].sum()),
                               rtol=1e-6)
    # The correction bias changes the choice, not the weights: expert 4 gets in, weighted by its own score.
    bias = jnp.zeros(E).at[4].set(5.0)
    ids, w = L.route(b, router, bias, cfg)
    np.testing.assert_array_equal(np.asarray(ids[0]), [4, 7, 1])
    sel = sig[jnp.array([4, 7, 1])]
    np.testing.assert_allclose(np.asarray(w[0]), np.asarray(sel / sel.sum()), rtol=1e-6)
    scaled = cfg.replace(norm_topk_prob=False, routed_scaling_factor=2.5)
    _, w = L.route(b, router, bias, scaled)
    np.testing.assert_allclose(np.asarray(w[0]), np.asarray(2.5 * sel), rtol=1e-6)


def test_gathered_and_grouped_experts_agree(tiny_cfg, tiny_params_nvfp4):
    moe = tiny_params_nvfp4.layers[2].mlp
    b = jax.random.normal(jax.random.key(7), (12, tiny_cfg.hidden_size)).astype(jnp.bfloat16)
    ids, _ = L.route(b, moe.router, moe.router_bias, tiny_cfg)
    g = L.routed_experts_gathered(b, moe, ids).astype(jnp.float32)
    r = L.routed_experts_grouped(b, moe, ids, tiny_cfg.n_routed_experts).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-2 * float(jnp.abs(g).max()))


@pytest.mark.parametrize("pairs,experts", [(49, 8), (1, 4), (3000, 256), (3000, 300)])
def test_sort_pairs_by_expert_is_the_stable_argsort(pairs, experts):
    """The order is a stable argsort (repeated ids keep their pair order) and the counts equal bincount, with the
    keys narrowed to uint8 (256 experts: ids up to 255) or uint16 (300)."""
    flat = jax.random.randint(jax.random.key(pairs), (pairs,), 0, min(experts, 7 if pairs < 100 else experts))
    order, sizes = L.sort_pairs_by_expert(flat.astype(jnp.int32), experts)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(np.asarray(flat), kind="stable"))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(np.asarray(flat), minlength=experts))
    assert order.dtype == jnp.int32 and sizes.dtype == jnp.int32


def test_out_of_vocabulary_tokens_are_refused(tiny_cfg):
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        M.check_tokens([[1, 256]], tiny_cfg)
    with pytest.raises(ValueError, match="token id -1"):
        M.check_tokens([-1], tiny_cfg)


def test_state_refuses_bad_sizes(tiny_cfg):
    with pytest.raises(ValueError, match="batch must be in"):
        init_state(tiny_cfg, 9, 16)
    with pytest.raises(ValueError, match="max_len"):
        init_state(tiny_cfg, 1, tiny_cfg.max_position_embeddings + 1)


def test_forward_is_differentiable(tiny_cfg, tiny_params):
    toks = jnp.asarray([[1, 2, 3, 4]], jnp.int32)

    def loss(p):
        return -jax.nn.log_softmax(M.forward(p, toks, tiny_cfg)[0, :-1])[jnp.arange(3), toks[0, 1:]].mean()
    g = jax.grad(loss)(tiny_params)
    assert float(jnp.abs(g.layers[0].attn.q.astype(jnp.float32)).max()) > 0
