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
from flint_jax.pallas_kernels import prefill_attention as pa
from flint_jax.params import init_params
from flint_jax.state import init_state


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


def assert_logits_close(got, ref):
    # The kernels round at the reference's BF16 points; FP32 sums run in another order (K tiles, key blocks, the
    # split P @ V), which can flip a last BF16 bit of an intermediate and show in later layers.
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-2 * float(jnp.abs(ref).max()), rtol=0)
    assert (jnp.argmax(got, -1) == jnp.argmax(ref, -1)).mean() > 0.97


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
    for b, n in enumerate(n_valid):
        assert_logits_close(got[b:b + 1, :n], M.forward(params, tokens[b:b + 1, :n], cfg))
    # The K/V written are the reference's (same projections, same write functions).
    ref_step = jax.jit(M.model_step, static_argnames=("cfg", "impl"))
    ref_state, pos = init_state(cfg, 2, 48), 0
    for T in chunks:
        n_new = jnp.asarray(np.clip(np.asarray(n_valid) - pos, 0, T), jnp.int32)
        _, ref_state = ref_step(params, ref_state, tokens[:, pos:pos + T], n_new, cfg, impl="xla")
        pos += T
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * max(1.0, float(np.abs(b).max()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_blocks_lower_for_the_gpu_at_flint_shape(monkeypatch):
    """Both blocks, both weight formats, at the full Flint shape (an 8K chunk), lower for CUDA with the kernels
    compiled (not interpreted): the Triton kernels and the XLA parts around them (an H200 described abstractly)."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    from flint_jax.params import abstract_params
    from flint_jax.state import FullCache, RingCache
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200))
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
            (lambda h, l: P.mlp_block(h, l, cfg, interpret=False), (h, layers[2]), 3),  # top-k, gate/up, down
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
