"""impl="pallas" decode (kernels in interpret mode on the CPU) against the reference forward on the tiny config."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import model as M
from flint_jax import pallas_path
from flint_jax.state import init_state, kv_dtype_of

step = jax.jit(M.model_step, static_argnames=("cfg", "impl"))


def test_decode_blocks_are_kernels():
    cov = pallas_path.coverage()
    assert cov["decode_attention"] == "pallas" and cov["decode_mlp"] == "pallas"


@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_pallas_decode_matches_the_reference(weights, tiny_cfg, tiny_params, tiny_params_nvfp4):
    params = tiny_params if weights == "bf16" else tiny_params_nvfp4
    cfg = tiny_cfg
    n_prompt, n_decode = 4, 4  # 8 positions: the window-5 ring wraps during decode
    toks = jax.random.randint(jax.random.key(1), (2, n_prompt + n_decode), 0, cfg.vocab_size)
    ref = M.forward(params, toks, cfg)[:, n_prompt:]
    state = init_state(cfg, 2, 16)
    _, state = step(params, state, toks[:, :n_prompt], jnp.array([n_prompt, n_prompt - 1]), cfg)
    # Row 1 is one token behind: it catches up with one single-row step (row 0 idle), so rows sit at different
    # positions and the batch mixes active and inactive rows.
    _, state = step(params, state, toks[:, n_prompt - 1:n_prompt], jnp.array([0, 1]), cfg, impl="pallas")
    outs = []
    for i in range(n_prompt, n_prompt + n_decode):
        h, state = step(params, state, toks[:, i:i + 1], jnp.array([1, 1]), cfg, impl="pallas")
        outs.append(M.lm_logits(params, h, cfg))
    got = jnp.concatenate(outs, axis=1)
    # BF16 weights in interpret mode (CPU): bit-identical in practice. NVFP4: the kernels apply block scales per
    # 16-value group inside the FP32 sum, a different summation order than the dequantize-then-dot reference, which
    # can flip a last BF16 bit that later layers carry; measured max |diff| 0.026 on logits of magnitude ~4.
    # Compiled on a GPU the reference's dots are XLA's (cuBLAS), whose FP32 summation order differs from the
    # kernels' for BF16 weights too: max |diff| 0.036 there (H200, 2026-11-30), so the NVFP4 tolerance applies.
    compiled = jax.default_backend() != "cpu"
    tol = 1e-3 if weights == "bf16" and not compiled else 0.05
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=tol * float(jnp.abs(ref).max()), rtol=0)


def test_fp8_kv_cache_decode_pallas_matches_xla(monkeypatch, tiny_cfg, tiny_params):
    """kv_dtype="fp8" (state.KV_DTYPES): prefill by the reference, then decode steps past the ring's wrap, on the
    Pallas kernels and on the XLA reference, both over FP8 full caches (BF16 weights, interpret mode on the CPU).
    - With the values' dot in FP32 (decode_attention.FP8_HALF_VALUES off; the scores still FP16 dots): the same
      logits within 0.1% of their range, test_pallas_decode_matches_the_reference's BF16 bound.
    - With the defaults, within 2%: the values' dot rounds p to FP16 (11 significant bits, as the GPU's TF32 does),
      which flips a layer output's BF16 rounding now and then (one ulp), and the tiny random MoE carries that past
      the 0.1% bound.
    On the GPU both within 5%. Against BF16 caches the logits move (the cache really holds FP8): measured RMS 4.8% of
    the logits' RMS on this random tiny model, with one of the 8 (row, step) off by 0.39 of a 3.4 range (a routing
    flip, which this tiny MoE makes from small noise: scripts/diag_routing_flips.py); the test allows 10%."""
    from flint_jax.pallas_kernels import decode_attention as DA
    cfg, params = tiny_cfg, tiny_params
    n_prompt, n_decode = 4, 4
    toks = jax.random.randint(jax.random.key(2), (2, n_prompt + n_decode), 0, cfg.vocab_size)

    def decode_logits(step_fn, kv_dtype, impl):
        state = init_state(cfg, 2, 16, kv_dtype=kv_dtype)
        _, state = step_fn(params, state, toks[:, :n_prompt], jnp.array([n_prompt, n_prompt]), cfg)
        outs = []
        for i in range(n_prompt, n_prompt + n_decode):
            h, state = step_fn(params, state, toks[:, i:i + 1], jnp.array([1, 1]), cfg, impl=impl)
            outs.append(M.lm_logits(params, h, cfg))
        full = [c for c in state.layers if not hasattr(c, "pos")]
        assert full and all(c.k.dtype == c.v.dtype == jnp.dtype(kv_dtype_of(kv_dtype)) for c in full)
        return np.asarray(jnp.concatenate(outs, axis=1))

    ref = decode_logits(step, "fp8", "xla")
    scale = float(np.abs(ref).max())
    cpu = jax.default_backend() == "cpu"
    np.testing.assert_allclose(decode_logits(step, "fp8", "pallas"), ref, atol=(0.02 if cpu else 0.05) * scale,
                               rtol=0)
    monkeypatch.setattr(DA, "FP8_HALF_VALUES", False)
    # a fresh trace sees the knob (a new jax.jit of the same function would reuse the cached trace)
    fresh_step = jax.jit(functools.partial(M.model_step), static_argnames=("cfg", "impl"))
    np.testing.assert_allclose(decode_logits(fresh_step, "fp8", "pallas"), ref, atol=(1e-3 if cpu else 0.05) * scale,
                               rtol=0)
    diff = decode_logits(step, "bf16", "xla") - ref
    rel = float(np.sqrt(np.mean(diff ** 2) / np.mean(ref ** 2)))
    assert 0 < rel < 0.1, rel


def _decode(params, cfg, toks, n_prompt):
    """Hidden states [B, T, H] of toks[:, n_prompt:] decoded one token per step by impl="pallas" after a reference
    prefill; odd rows start one token behind and catch up in a step where the even rows idle, so rows sit at
    different positions. (scripts/diag_routing_flips.py runs the same decode.)"""
    batch = toks.shape[0]
    behind = jnp.arange(batch) % 2
    state = init_state(cfg, batch, 16)
    _, state = step(params, state, toks[:, :n_prompt], n_prompt - behind, cfg)
    _, state = step(params, state, toks[:, n_prompt - 1:n_prompt], behind, cfg, impl="pallas")
    hs = []
    for i in range(n_prompt, toks.shape[1]):
        h, state = step(params, state, toks[:, i:i + 1], jnp.ones((batch,), jnp.int32), cfg, impl="pallas")
        assert h.shape == (batch, 1, cfg.hidden_size)
        hs.append(h)
    return jnp.concatenate(hs, axis=1)


@pytest.mark.parametrize("batch", [3, 5])
def test_odd_batch_carries_padding_rows_through_the_step(batch, tiny_cfg, tiny_params):
    """Three or five sequences: the decode kernels take 1, 2, 4 or 8 rows, so the step pads h to 4 or 8 rows once and
    slices it once (model.Blocks.rows) instead of every kernel padding its input and slicing its output.
    - The rows' hidden states are bit-identical to the same sequences' rows in a batch of the padded size (extra
      sequences in the other rows): the padding rows change nothing. (Hidden states, not logits: the LM head here
      is an XLA dot, which on a GPU may sum differently for 3 and 4 rows.)
    - They match the reference forward: to 1e-3 of the largest logit at 4 rows; at 8 rows the projections run on the
      tensor cores, whose FP32 sums group by K tile, which flipped one BF16 rounding in this case (0.019 on logits
      up to 4.3, the same in a batch of 8), so 8-row batches take the compiled tolerance. Compiled at 8 rows (H200,
      2026-12-03, runs EG-EI) two (row, step) of the 15 missed, by 0.68 and 0.51, the others within 0.062: routing
      flips, which this tiny MoE makes from rounding noise alone (the reference itself, with one BF16 ulp added to
      an eighth of the embedding entries, moved the second of them by 0.53 and the others by up to 0.057:
      `python scripts/diag_routing_flips.py`, which also gives the CPU's 0.019). So there
      two may miss (a row gone wrong misses at its three steps).
    - The lowered step has no more pad or slice ops than the padded batch plus that one pad and slice."""
    cfg = tiny_cfg
    n_prompt, n_decode = 4, 3  # positions up to 7: the window-5 ring wraps
    padded = 1 << (batch - 1).bit_length()
    toks = jax.random.randint(jax.random.key(2), (padded, n_prompt + n_decode), 0, cfg.vocab_size)
    hs = _decode(tiny_params, cfg, toks[:batch], n_prompt)
    assert np.array_equal(np.asarray(hs), np.asarray(_decode(tiny_params, cfg, toks, n_prompt)[:batch]))
    got = M.lm_logits(tiny_params, hs, cfg)
    ref = M.forward(tiny_params, toks[:batch], cfg)[:, n_prompt:]
    compiled = jax.default_backend() != "cpu"
    tol = 1e-3 if not compiled and padded <= 4 else 0.05  # as test_pallas_decode_matches_the_reference
    err = np.abs(np.asarray(got) - np.asarray(ref)).max(axis=-1)  # [row, step]
    misses = int((err > tol * float(jnp.abs(ref).max())).sum())
    assert misses <= (2 if compiled and padded == 8 else 0), (misses, np.round(err, 4))
    odd, even = (pallas_path.kernel_census(cfg, "bf16", batch=b, max_len=64)["other_by_op"] for b in (batch, padded))
    for op in ("pad", "slice"):
        assert odd.get(op, 0) <= even.get(op, 0) + 1, (op, odd, even)


def test_decode_step_lowers_for_the_gpu_with_the_planned_kernels(tiny_cfg):
    """The whole decode step lowers to Triton kernels for CUDA (no GPU needed), one launch per fused block:
    per layer QKV + attention + output projection, + a combine kernel on full layers split more ways than the
    attention kernel folds itself (DA.COMBINE_IN_KERNEL, DA.MAX_SPLITS_IN_KERNEL; the default: every split
    layer, the sliding layers' rings included), + 3 (MoE) or 2 (dense) MLP kernels."""
    from flint_jax.pallas_kernels import decode_attention as DA
    census = pallas_path.kernel_census(tiny_cfg, "nvfp4", batch=1, max_len=512)  # full layers: 2 splits of 256
    cfg = tiny_cfg
    n_full = len(cfg.full_layers)
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    splits = DA.default_splits(1, cfg.num_key_value_heads, sliding=False, max_len=512)
    assert splits > 1
    in_kernel = DA.COMBINE_IN_KERNEL and splits <= DA.MAX_SPLITS_IN_KERNEL and not splits & (splits - 1)
    ring_splits = DA.default_splits(1, cfg.num_key_value_heads, sliding=True)
    ring_in_kernel = DA.COMBINE_IN_KERNEL and ring_splits <= DA.MAX_SPLITS_IN_KERNEL
    n_combine = (0 if in_kernel else n_full) + (0 if ring_in_kernel or ring_splits == 1 else
                                               cfg.num_hidden_layers - n_full)
    assert n_combine >= cfg.num_hidden_layers - n_full  # the sliding layers' combines are planned
    planned = 3 * cfg.num_hidden_layers + n_combine + 3 * n_moe + 2 * (cfg.num_hidden_layers - n_moe)
    assert census["pallas_kernels"] == planned
    assert census["by_kernel"].get("decode_attention_combine", 0) == n_combine
    assert census["by_kernel"]["moe_gate_up_nvfp4"] == n_moe


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_lm_logits_pallas(rows, weights, tiny_cfg, tiny_params, tiny_params_nvfp4, monkeypatch):
    """impl="pallas" LM head: the kernel (NVFP4, <= 2 rows on the FMA path, 5-8 on the tensor cores) or the
    reference (3 rows, BF16); FP32 logits equal up to summation order either way, and the kernel really runs where
    the rule says."""
    params = tiny_params if weights == "bf16" else tiny_params_nvfp4
    h = (2 * jax.random.normal(jax.random.key(3), (rows, 1, tiny_cfg.hidden_size))).astype(jnp.bfloat16)
    from flint_jax.pallas_kernels import gemv
    calls = []
    real = gemv.gemv_logits
    monkeypatch.setattr(gemv, "gemv_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = M.lm_logits(params, h, tiny_cfg, impl="pallas")
    ref = M.lm_logits(params, h, tiny_cfg)
    assert got.shape == ref.shape == (rows, 1, tiny_cfg.vocab_size) and got.dtype == jnp.float32
    assert bool(calls) == (weights == "nvfp4" and rows in (1, 2, 5, 8))
    assert pallas_path.lm_head_kernel_rows(rows) == (rows in (1, 2, 5, 8))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-5 * float(jnp.abs(ref).max()))
