"""Chunked prefill through flint_jax.prefill (the grouped-GEMM MoE and the flash prefill attention, Pallas in
interpret mode on the CPU) equals the one-shot reference forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layers as L
from flint_jax import model as M
from flint_jax import prefill as P
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels import grouped_matmul as gm
from flint_jax.pallas_kernels import prefill_attention as pa
from flint_jax.params import init_params
from flint_jax.state import RingCache, init_state


def _blocks(impl, T):
    return P.blocks() if impl == "prefill" else M.Blocks(M.attention_block, L.mlp_block)


@pytest.fixture
def prefill_step(monkeypatch):
    monkeypatch.setattr(M, "_blocks", _blocks)
    # Compiled on a GPU, prefill attention multiplies BF16-rounded probabilities by V by default (flash-attention
    # precision, bounded in test_kernels_prefill_attention). Through this random tiny model that moves logits by up
    # to 15% of their maximum (H200, 2026-11-29, scripts/diag_prefill_gpu.py), so this end-to-end comparison pins
    # the FP32 product, which equals the reference forward there as it does on the CPU.
    monkeypatch.setattr(pa, "GPU_PV", "f32")
    return jax.jit(M.model_step, static_argnames=("cfg", "impl"))


def run_chunks(step, params, cfg, tokens, chunks, n_valid=None, max_len=48):
    """Feed tokens [B, N] in chunks (row b real for its first n_valid[b] tokens); FP32 logits [B, N, V]."""
    B, N = tokens.shape
    n_valid = np.full((B,), N) if n_valid is None else np.asarray(n_valid)
    state = init_state(cfg, B, max_len)
    outs, pos = [], 0
    for T in chunks:
        n_new = jnp.asarray(np.clip(n_valid - pos, 0, T), jnp.int32)
        h, state = step(params, state, tokens[:, pos:pos + T], n_new, cfg, impl="prefill")
        outs.append(M.lm_logits(params, h, cfg))
        pos += T
    assert pos == N
    return jnp.concatenate(outs, axis=1), state


# Compiled on a GPU, the kernels sum in FP32 in another order than XLA's reference (key blocks, K tiles), which can
# flip the last bit of a BF16 intermediate. Through this random tiny model that is harmless except where a token's
# routing is a near tie: there a flipped bit can swap an expert and move the token's logits far beyond any rounding
# tolerance (H200, runs AF and AH of docs/BENCHMARKS.md: token 10 of the window-16 NVFP4 case, whose second MoE
# layer ranks its 2nd and 3rd experts 5.4e-3 apart). Random tiny models have such ties everywhere (the smallest
# margin over this test's tokens is 1e-4 to 2e-3 for 12 parameter seeds), so compiled runs may excuse a token that
# differs if the reference routes it with a margin below NEAR_TIE. Interpret mode (CI) excuses nothing.
NEAR_TIE = 1e-2
COMPILED = jax.default_backend() != "cpu"


def near_tie_tokens(params, tokens, cfg, n_valid):
    """[B, N] bool: tokens whose routing in the reference forward has a near tie (the k-th and (k+1)-th selection
    scores, sigmoid + bias, less than NEAR_TIE apart) in some MoE layer."""
    out = np.zeros(tokens.shape, bool)
    real_route = L.route
    for b, n in enumerate(n_valid):
        gaps = []

        def spy(x, router, bias, cfg_):
            s = jax.nn.sigmoid(L.router_logits(x, router)) + bias.astype(jnp.float32)
            top = -jnp.sort(-s, axis=-1)
            k = cfg_.num_experts_per_tok
            gaps.append(np.asarray(top[..., k - 1] - top[..., k]).reshape(-1))
            return real_route(x, router, bias, cfg_)

        L.route = spy
        try:
            with jax.disable_jit():
                M.forward(params, tokens[b:b + 1, :n], cfg)
        finally:
            L.route = real_route
        out[b, :n] = np.min(np.stack(gaps), axis=0) < NEAR_TIE
    return out


def assert_logits_close(got, ref):
    # The kernels round at the reference's BF16 points; FP32 sums run in another order (K tiles, key blocks, the
    # split P @ V), which can flip a last BF16 bit of an intermediate and show in later layers.
    # The argmax must agree wherever the reference's top two logits are further apart than twice the token's
    # largest logit difference (elsewhere the logits tie within the rounding that this tolerance allows: the
    # compiled NVFP4 case of run AJ had one such token of 22).
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(got, ref, atol=2e-2 * float(np.abs(ref).max()), rtol=0)
    top2 = -np.sort(-ref, axis=-1)[..., :2]
    clear = (top2[..., 0] - top2[..., 1]) > 2 * np.abs(got - ref).max(axis=-1)
    assert clear.mean() > 0.8, f"only {clear.mean():.0%} of the tokens have a clear argmax"
    flipped = clear & (got.argmax(-1) != ref.argmax(-1))
    assert not flipped.any(), f"argmax differs at tokens {np.argwhere(flipped).tolist()} with a clear margin"


# Window 5: smaller than the chunks (the ring wraps inside a chunk); window 16: larger than a 7-token chunk.
# Row 1 of the first case has only 9 real tokens (rows of different lengths share the chunks).
CASES = [(5, "bf16", [16, 7], [23, 9]), (16, "nvfp4", [7, 16], [23, 23])]


@pytest.mark.parametrize("window,weights,chunks,n_valid", CASES)
def test_chunked_prefill_equals_reference_forward(prefill_step, window, weights, chunks, n_valid):
    cfg = FlintConfig.tiny(sliding_window=window)
    params = init_params(cfg, jax.random.key(0), weights)
    tokens = jax.random.randint(jax.random.key(1), (2, 23), 0, cfg.vocab_size)
    got, state = run_chunks(prefill_step, params, cfg, tokens, chunks, n_valid)
    np.testing.assert_array_equal(np.asarray(state.lengths), n_valid)
    excused = near_tie_tokens(params, tokens, cfg, n_valid) if COMPILED else np.zeros(tokens.shape, bool)
    for b, n in enumerate(n_valid):
        g, r = np.asarray(got[b, :n]), np.asarray(M.forward(params, tokens[b:b + 1, :n], cfg)[0])
        off = np.any(np.abs(g - r) > 2e-2 * np.abs(r).max(), axis=-1)  # tokens beyond the tolerance
        assert not np.any(off & ~excused[b, :n]), f"row {b}: tokens {np.flatnonzero(off & ~excused[b, :n])} differ"
        assert off.sum() <= 2, f"row {b}: {off.sum()} near-tie tokens differ"
        assert_logits_close(g[None, ~off], r[None, ~off])
    # The K/V written are the reference's (same projections, same write functions), except at excused tokens.
    ref_step = jax.jit(M.model_step, static_argnames=("cfg", "impl"))
    ref_state, pos = init_state(cfg, 2, 48), 0
    for T in chunks:
        n_new = jnp.asarray(np.clip(np.asarray(n_valid) - pos, 0, T), jnp.int32)
        _, ref_state = ref_step(params, ref_state, tokens[:, pos:pos + T], n_new, cfg, impl="xla")
        pos += T
    for got_c, ref_c in zip(state.layers, ref_state.layers):
        if isinstance(ref_c, RingCache):
            np.testing.assert_array_equal(np.asarray(got_c.pos), np.asarray(ref_c.pos))
            slot_pos = np.asarray(ref_c.pos)  # [B, W]
        else:
            slot_pos = np.broadcast_to(np.arange(ref_c.k.shape[2]), (ref_c.k.shape[0], ref_c.k.shape[2]))
        skip = np.zeros(slot_pos.shape, bool)
        for b in range(slot_pos.shape[0]):
            tie_pos = np.flatnonzero(excused[b])
            skip[b] = np.isin(slot_pos[b], tie_pos)
        for a, c in ((got_c.k, ref_c.k), (got_c.v, ref_c.v)):
            a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
            keep = ~skip[:, None, :, None]
            assert np.abs(np.where(keep, a - c, 0)).max() <= 2e-2 * max(1.0, float(np.abs(c).max()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_blocks_lower_for_the_gpu_at_flint_shape(lower_for_h200):
    """Both blocks, both weight formats, at the full Flint shape (an 8K chunk), lower for CUDA with the kernels
    compiled (not interpreted): the Triton kernels and the XLA parts around them (an H200 described abstractly)."""
    from flint_jax.params import abstract_params
    from flint_jax.state import FullCache, RingCache
    cfg = FlintConfig.flint()
    S = jax.ShapeDtypeStruct
    T, W, KV, D = 8192, cfg.sliding_window, cfg.num_key_value_heads, cfg.head_dim
    h, pos, valid, la = S((1, T, cfg.hidden_size), jnp.bfloat16), S((1, T), jnp.int32), S((1, T), bool), \
        S((1,), jnp.int32)
    ring = RingCache(S((1, KV, W, D), jnp.bfloat16), S((1, KV, W, D), jnp.bfloat16), S((1, W), jnp.int32))
    full = FullCache(S((1, KV, 16384, D), jnp.bfloat16), S((1, KV, 16384, D), jnp.bfloat16))
    for weights in ("bf16", "nvfp4"):
        layers = abstract_params(cfg, weights).layers
        cases = [
            (lambda h, l, c, p, v, n: P.attention_block(h, l, c, p, v, n, cfg, True, interpret=False),
             (h, layers[2], ring, pos, valid, la), 1),
            (lambda h, l, c, p, v, n: P.attention_block(h, l, c, p, v, n, cfg, False, interpret=False),
             (h, layers[3], full, pos, valid, la), 1),
            # top-k, gate/up (one launch per tile size: the table's tails), down
            (lambda h, l: P.mlp_block(h, l, cfg, interpret=False), (h, layers[2]),
             3 + len(gm.default_tails(weights, "swiglu", T * cfg.num_experts_per_tok / cfg.n_routed_experts))),
        ]
        for fn, args, n_kernels in cases:
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == n_kernels


def test_router_weights_split_exactly_into_three_bf16_parts():
    w = jax.random.normal(jax.random.key(5), (64, 256), jnp.float32) * jnp.logspace(-6, 1, 256)[None, :]
    parts = P.split_bf16x3(w)
    assert parts.shape == (3, 64, 256) and parts.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w), np.asarray((parts[0].astype(jnp.float32)
                                                              + parts[1].astype(jnp.float32))
                                                             + parts[2].astype(jnp.float32)))
    # the parts are not redundant: the low part carries bits the first two do not
    assert bool(jnp.any(parts[2] != 0))


def test_router_logits_agree_with_the_fp32_einsum_to_fp32_rounding():
    """prefill.router_logits_bf16x3 (three exact BF16 parts on the tensor cores) against layers.router_logits: the
    same FP32 logits up to summation rounding, and the same top-k on random inputs."""
    cfg = FlintConfig.tiny()
    b = jax.random.normal(jax.random.key(6), (97, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    router = jax.random.normal(jax.random.key(7), (cfg.n_routed_experts, cfg.hidden_size), jnp.float32) * 0.05
    got = P.router_logits_bf16x3(b, router)
    want = L.router_logits(b, router)
    scale = L.router_logits(jnp.abs(b), jnp.abs(router))
    assert got.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(got - want) / scale)) < 2 ** -20  # FP32 summation error over H terms
    bias = jnp.zeros((cfg.n_routed_experts,), jnp.float32)
    ids_got, w_got = L.route_from_logits(got, bias, cfg)
    ids_want, w_want = L.route(b, router, bias, cfg)
    np.testing.assert_array_equal(np.asarray(ids_got), np.asarray(ids_want))
    np.testing.assert_allclose(np.asarray(w_got), np.asarray(w_want), rtol=1e-5)
