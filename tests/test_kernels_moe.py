"""Router, routed/shared expert kernels and the MLP blocks (pallas_kernels/router.py, moe_experts.py) against
flint_jax.layers, in interpret mode on the CPU (FLINT_PALLAS_COMPILED=1: compiled, on a GPU).

Shapes are Flint's scaled down: H = 256, E = 16 experts, top-6, expert intermediate 128, shared expert, per-expert
NVFP4 global scales != 1, a correction bias. Tolerances: expert ids must be equal; routing weights and FP32 logits
agree to 1e-6 relative (the kernel's FP32 sums and its sigmoid 1 / (1 + exp(-x)) differ from XLA's in rounding
only); block outputs `h + mlp(h)` within 1 BF16 ulp on at most 2% of elements (see test_kernels_gemv.py: the FP32
accumulation order is the only difference, and every rounding point of FLINT_SPEC is reproduced).
"""


import flint_jax  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import FlintConfig, layers, nvfp4, params
from flint_jax.pallas_kernels import moe_experts as X
from flint_jax.pallas_kernels import grid_sync as GS
from flint_jax.pallas_kernels import moe_persistent as XP
from flint_jax.pallas_kernels import router as R
from numerics import assert_bf16_close, assert_residual_close
from kernel_mode import INTERPRET

BF16, F32 = jnp.bfloat16, jnp.float32
CFG = FlintConfig.tiny(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, n_routed_experts=16,
                       num_experts_per_tok=6, num_hidden_layers=3)


_rand_nvfp4 = jax.jit(nvfp4.random, static_argnums=(1, 2))


def _linear(key, shape, kind, gs_seed):
    """A random Linear; NVFP4 ones get global scales != 1 (one per expert for stacks)."""
    std = 1.0 / np.sqrt(shape[-1])
    if kind == "bf16":
        return (std * jax.random.normal(key, shape, F32)).astype(BF16)
    w = _rand_nvfp4(key, shape, float(std))
    gs = 0.6 + jax.random.uniform(jax.random.PRNGKey(gs_seed), shape[:-2], F32)
    return nvfp4.NVFP4Weight(w.codes, w.scales, gs)


_LAYERS = {}


def layer_of(kind, moe=True):
    """One MLP half of a layer (params.Layer with only mlp_norm and mlp filled), built once per kind."""
    if (kind, moe) not in _LAYERS:
        H, E, I = CFG.hidden_size, CFG.n_routed_experts, CFG.moe_intermediate_size
        ks = jax.random.split(jax.random.PRNGKey(42 + moe), 10)
        norm = (1 + 0.1 * jax.random.normal(ks[0], (H,), F32)).astype(BF16)
        if moe:
            mlp = params.MoE(router=jax.random.normal(ks[1], (E, H), F32) / np.sqrt(H),
                             router_bias=0.1 * jax.random.normal(ks[2], (E,), F32),
                             gate=_linear(ks[3], (E, I, H), kind, 1), up=_linear(ks[4], (E, I, H), kind, 2),
                             down=_linear(ks[5], (E, H, I), kind, 3), shared_gate=_linear(ks[6], (I, H), kind, 4),
                             shared_up=_linear(ks[7], (I, H), kind, 5), shared_down=_linear(ks[8], (H, I), kind, 6))
        else:
            Id = CFG.intermediate_size
            mlp = params.DenseMLP(gate=_linear(ks[3], (Id, H), kind, 7), up=_linear(ks[4], (Id, H), kind, 8),
                                  down=_linear(ks[5], (H, Id), kind, 9))
        _LAYERS[kind, moe] = params.Layer(attn_norm=None, attn=None, mlp_norm=norm, mlp=mlp)
    return _LAYERS[kind, moe]


def run_block(fn, h, layer, cfg):
    """Kernels and reference both jitted (an eager interpret-mode call re-lowers every time)."""
    return jax.jit(lambda h, layer: fn(h, layer, cfg))(h, layer)


def kernel_block(h, layer, cfg):
    return X.mlp_block(h, layer, cfg, interpret=INTERPRET)


def hidden(seed, m):
    return (2.0 * jax.random.normal(jax.random.PRNGKey(seed), (m, CFG.hidden_size), F32)).astype(BF16)


@pytest.mark.parametrize("m", [1, 8])
def test_router_logits_and_fused_norm(m):
    layer = layer_of("bf16")
    h = hidden(m, m)
    logits, b = R.router_logits(h, layer.mlp.router, norm_weight=layer.mlp_norm, interpret=INTERPRET)
    ref_logits, ref_b = R.ref_router_logits(h, layer.mlp.router, norm_weight=layer.mlp_norm)
    assert_bf16_close(b, ref_b)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=0,
                               atol=1e-6 * float(jnp.max(jnp.abs(ref_logits))))


@pytest.mark.parametrize("in_router", [False, True], ids=["top_k_kernel", "router_last_program"])
@pytest.mark.parametrize("case", ["bias", "tied_rows", "all_tied"])
def test_route_top_k_ties_and_bias(case, in_router):
    """ids equal layers.route's, including exact ties (equal score + bias), which go to the lower expert index."""
    layer = layer_of("bf16")
    router, bias = layer.mlp.router, layer.mlp.router_bias
    E = CFG.n_routed_experts
    if case == "tied_rows":  # experts 3, 9, 12 share router row and bias with expert 5: exact ties in any order
        for e in (3, 9, 12):
            router = router.at[e].set(router[5])
            bias = bias.at[e].set(bias[5])
        bias = bias.at[5].add(5.0).at[3].add(5.0).at[9].add(5.0).at[12].add(5.0)  # make sure they are selected
    elif case == "all_tied":  # every score 0.5; bias decides, with repeated values
        router = jnp.zeros_like(router)
        bias = jnp.array([0.1, 0.3, 0.3, 0.0, 0.3, 0.2, 0.2, 0.0, 0.1, 0.3, 0.0, 0.0, 0.2, 0.0, 0.1, 0.3][:E], F32)
    h = hidden(11, 4)
    k = CFG.num_experts_per_tok
    if in_router:  # the router kernel's last-arriving program selects for every row (the decode MoE block's path)
        logits, _, ids_p, w_p = jax.jit(lambda h, r, b: R.router_logits(
            h, r, norm_weight=layer.mlp_norm, interpret=INTERPRET, block=(2, 64, 4, 1), select=(b, CFG)))(
            h, router, bias)
        assert ids_p.shape == (4, 8) and not np.asarray(ids_p[:, k:]).any() and not np.asarray(w_p[:, k:]).any()
        ids, w = ids_p[:, :k], w_p[:, :k]
        # and exactly what select_experts (the per-program path) makes of the same logits
        top_ids, top_w = R.top_k_experts(logits, bias, CFG, interpret=INTERPRET)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(top_ids))
        np.testing.assert_array_equal(np.asarray(w), np.asarray(top_w))
    else:
        ids, w = R.route(h, router, bias, CFG, norm_weight=layer.mlp_norm, interpret=INTERPRET)
    ref_ids, ref_w = R.ref_route(h, router, bias, CFG, norm_weight=layer.mlp_norm)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-6, atol=1e-7)
    if case == "all_tied":
        np.testing.assert_array_equal(np.asarray(ids[0]), [1, 2, 4, 9, 15, 5])


@pytest.mark.parametrize("argmax", [True, False], ids=["argmax_rounds", "max_then_index_rounds"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_top_k_experts_several_tokens_per_program(rows, argmax, monkeypatch):
    """The prefill form (`rows` tokens per program, 11 tokens: the last program padded) selects what
    layers.route_from_logits selects, ties included (repeated logits and biases), with its weights to FP32
    rounding; with either form of the top-k rounds (router.TOPK_ARGMAX)."""
    monkeypatch.setattr(R, "TOPK_ARGMAX", argmax)
    logits = jax.random.normal(jax.random.key(rows), (11, CFG.n_routed_experts), F32)
    logits = logits.at[3].set(0.25).at[7, :4].set(logits[7, 8])  # an all-tied row, and a tie at the top
    bias = jnp.zeros((CFG.n_routed_experts,), F32).at[1].set(0.5).at[2].set(0.5)
    ref_ids, ref_w = layers.route_from_logits(logits, bias, CFG)
    for ids, w in (R.top_k_experts(logits, bias, CFG, interpret=INTERPRET, rows=rows),
                   R.top_k_experts(jax.nn.sigmoid(logits), bias, CFG, interpret=INTERPRET, rows=rows,
                                   scores_given=True)):
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="power of two"):
        R.top_k_experts(logits, bias, CFG, interpret=INTERPRET, rows=3)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_moe_block_matches_mlp_block(kind, m):
    layer = layer_of(kind)
    h = hidden(100 + m, m)
    assert_residual_close(run_block(kernel_block, h, layer, CFG), run_block(layers.mlp_block, h, layer, CFG), h)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_moe_block_routing_paths_agree(m, monkeypatch):
    """Top-k in the router's last program (ROUTE_IN_ROUTER), in a kernel of its own (TOPK_KERNEL_MIN_ROWS, one
    program per token) or in every expert program: the same output bits."""
    layer = layer_of("nvfp4")
    h = hidden(200 + m, m)
    outs = []
    for in_router, min_rows in ((True, None), (False, 1), (False, None)):
        monkeypatch.setattr(X, "ROUTE_IN_ROUTER", in_router)
        monkeypatch.setattr(X, "TOPK_KERNEL_MIN_ROWS", min_rows)
        outs.append(np.asarray(run_block(kernel_block, h, layer, CFG)))
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[2])


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("rows", [None, 1], ids=["one_program", "one_per_token"])
def test_top_k_slots_match_the_expert_kernels_routing(m, rows, monkeypatch):
    """router.top_k_slots (what the expert kernels read under TOPK_KERNEL_MIN_ROWS) gives the ids and weights the
    gate/up kernel computes itself (ROUTING_TO_DOWN's output), in the same [rows, 8] layout, rows < M, with every
    token in one program (3 tokens padded to 4) or one program per token (TOPK_SLOTS_ROWS)."""
    monkeypatch.setattr(R, "TOPK_SLOTS_ROWS", rows)
    layer = layer_of("nvfp4")
    moe = layer.mlp
    h = hidden(600 + m, m)
    b = layers.rmsnorm(h, layer.mlp_norm, CFG.rms_norm_eps)
    logits = jnp.einsum("mh,eh->me", b.astype(F32), moe.router.astype(F32))
    ids, ws = jax.jit(lambda lg: R.top_k_slots(lg, moe.router_bias, CFG, interpret=INTERPRET))(logits)
    assert ids.shape == ws.shape == (4 if m == 3 and rows is None else m, 8)
    _, g_ids, g_ws = jax.jit(lambda b, lg: X.expert_gate_up(b, lg, moe, CFG, interpret=INTERPRET,
                                                             emit_routing=True))(b, logits)
    k = CFG.num_experts_per_tok
    np.testing.assert_array_equal(np.asarray(ids[:m, :k]), np.asarray(g_ids[:, :k]))
    np.testing.assert_array_equal(np.asarray(ws[:m, :k]), np.asarray(g_ws[:, :k]))
    ref_ids, _ = layers.route_from_logits(logits, moe.router_bias, CFG)
    np.testing.assert_array_equal(np.asarray(ids[:m, :k]), np.asarray(ref_ids))


@pytest.mark.parametrize("m", [1, 3])
def test_moe_block_load_order_knobs_keep_the_output_bits(m, monkeypatch):
    """The router's norm after its first weight loads, the expert kernels' global scales and residual before their
    K loops, one argmax per top-k round (weight_tiles / router knobs): the same output bits as the old forms."""
    from flint_jax.pallas_kernels import weight_tiles as wt
    layer = layer_of("nvfp4")
    h = hidden(500 + m, m)
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(wt, "NORM_AFTER_LOADS", flag)
        monkeypatch.setattr(wt, "EARLY_EPILOGUE_LOADS", flag)
        monkeypatch.setattr(R, "TOPK_ARGMAX", flag)
        outs.append(np.asarray(run_block(kernel_block, h, layer, CFG)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("m", [1, 3, 8])
def test_gate_up_emits_the_routing_down_reads(m, monkeypatch):
    """ROUTING_TO_DOWN: the gate/up kernel's ids and weights are the router's top-k (ids equal, weights to 1e-6;
    slots past k zero), and the block's output bits do not depend on the flag."""
    layer = layer_of("nvfp4")
    moe = layer.mlp
    h = hidden(400 + m, m)
    b = layers.rmsnorm(h, layer.mlp_norm, CFG.rms_norm_eps)
    logits = jnp.einsum("mh,eh->me", b.astype(F32), moe.router.astype(F32))
    act, ids, ws = jax.jit(lambda b, lg: X.expert_gate_up(b, lg, moe, CFG, interpret=INTERPRET,
                                                           emit_routing=True))(b, logits)
    ref_ids, ref_ws = layers.route_from_logits(logits, moe.router_bias, CFG)
    k = CFG.num_experts_per_tok
    assert ids.shape == ws.shape == (m, 8)
    np.testing.assert_array_equal(np.asarray(ids[:, :k]), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(ws[:, :k]), np.asarray(ref_ws), rtol=1e-6, atol=1e-7)
    assert not np.asarray(ids[:, k:]).any() and not np.asarray(ws[:, k:]).any()
    plain = jax.jit(lambda b, lg: X.expert_gate_up(b, lg, moe, CFG, interpret=INTERPRET))(b, logits)
    np.testing.assert_array_equal(np.asarray(act), np.asarray(plain))
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(X, "ROUTING_TO_DOWN", flag)
        outs.append(np.asarray(run_block(kernel_block, h, layer, CFG)))
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="emit_routing"):
        X.expert_gate_up(b, logits, moe, CFG, interpret=INTERPRET, emit_routing=True, routing=(ids, ws))


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_moe_block_without_shared_expert_and_scaled_weights(kind):
    """No shared expert, routed_scaling_factor 2.5, no top-k normalisation; [B, T, H] input."""
    cfg = CFG.replace(n_shared_experts=0, routed_scaling_factor=2.5, norm_topk_prob=False)
    layer = layer_of(kind)
    moe = layer.mlp
    layer = params.Layer(None, None, layer.mlp_norm,
                         params.MoE(moe.router, moe.router_bias, moe.gate, moe.up, moe.down, None, None, None))
    h = hidden(5, 2).reshape(2, 1, -1)
    assert_residual_close(run_block(kernel_block, h, layer, cfg), run_block(layers.mlp_block, h, layer, cfg), h)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3])
def test_dense_mlp_block_matches_mlp_block(kind, m):
    layer = layer_of(kind, moe=False)
    h = hidden(200 + m, m)
    assert_residual_close(run_block(kernel_block, h, layer, CFG), run_block(layers.mlp_block, h, layer, CFG), h)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_blocks_lower_to_three_and_two_triton_kernels(kind, monkeypatch):
    """Lowered for the GPU (Pallas -> Triton IR, no GPU needed; see test_kernels_gemv.lower_for_gpu): the MoE block is
    exactly 3 Triton kernels (1 with PERSISTENT at 1 and 2 tokens; 4 from TOPK_KERNEL_MIN_ROWS tokens on), the
    dense block 2, the standalone router 2. This is the stage where the BF16 expert kernels once failed on the GPU (a
    one-step K loop) while interpret mode passed."""
    from test_kernels_gemv import TRITON_CALL, lower_for_gpu
    for persistent, m, kernels in ((False, 1, 3), (False, 8, 3), (True, 1, 1), (True, 2, 1), (True, 8, 3),
                                   ("topk", 1, 3), ("topk", 4, 4), ("topk", 8, 4)):
        monkeypatch.setattr(X, "PERSISTENT", persistent is True)
        monkeypatch.setattr(X, "TOPK_KERNEL_MIN_ROWS", 4 if persistent == "topk" else None)
        h = hidden(m, m)
        moe = lower_for_gpu(monkeypatch, lambda h, l: X.moe_block(h, l, CFG), h, layer_of(kind))
        assert moe.count(TRITON_CALL) == kernels
        dense = lower_for_gpu(monkeypatch, lambda h, l: X.mlp_block(h, l, CFG), h, layer_of(kind, moe=False))
        assert dense.count(TRITON_CALL) == 2
    layer = layer_of(kind)
    routed = lower_for_gpu(monkeypatch, lambda h, l: R.route(h, l.mlp.router, l.mlp.router_bias, CFG,
                                                             norm_weight=l.mlp_norm), hidden(3, 3), layer)
    assert routed.count(TRITON_CALL) == 2


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("programs", [3, 64], ids=["tiles_in_series", "one_tile_each"])
def test_persistent_block_equals_three_kernels(kind, m, programs):
    """The persistent kernel (moe_persistent.py) gives the three-kernel block's bits, whatever the grid: 3 programs
    walk many tiles each, 64 take at most one tile of a phase. Compiled, no barrier gave up."""
    layer = layer_of(kind)
    h = hidden(300 + m, m)
    out, sync = jax.jit(lambda h, l: XP.moe_block_persistent(h, l, CFG, interpret=INTERPRET, programs=programs,
                                                              with_sync=True))(h, layer)
    three = run_block(kernel_block, h, layer, CFG)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(three))
    assert_residual_close(out, run_block(layers.mlp_block, h, layer, CFG), h)
    if not INTERPRET:
        assert int(sync[GS.TIMEOUT_SLOT]) == 0
        assert list(np.asarray(sync[:2])) == [programs, programs]  # every program passed both barriers


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_persistent_block_without_shared_expert(kind):
    cfg = CFG.replace(n_shared_experts=0, routed_scaling_factor=2.5, norm_topk_prob=False)
    moe = layer_of(kind).mlp
    layer = params.Layer(None, None, layer_of(kind).mlp_norm,
                         params.MoE(moe.router, moe.router_bias, moe.gate, moe.up, moe.down, None, None, None))
    h = hidden(7, 2).reshape(2, 1, -1)
    out = jax.jit(lambda h, l: XP.moe_block_persistent(h, l, cfg, interpret=INTERPRET, programs=5))(h, layer)
    assert out.shape == h.shape
    assert_residual_close(out, run_block(layers.mlp_block, h, layer, cfg), h)


def test_persistent_block_rejects_more_rows():
    with pytest.raises(ValueError, match="1..2 rows, got 3"):
        XP.moe_block_persistent(hidden(1, 3), layer_of("bf16"), CFG, interpret=True)


def test_moe_block_takes_the_persistent_path_when_set(monkeypatch):
    layer = layer_of("nvfp4")
    h = hidden(11, 1)
    calls = []
    real = XP.moe_block_persistent
    monkeypatch.setattr(XP, "moe_block_persistent", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(X, "PERSISTENT", True)
    out = run_block(kernel_block, h, layer, CFG)
    assert calls == [1]
    monkeypatch.setattr(X, "PERSISTENT", False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run_block(kernel_block, h, layer, CFG)))


def test_one_compiled_kernel_serves_every_routing():
    """Expert ids are data: two inputs that route differently run through one jitted executable."""
    layer = layer_of("nvfp4")
    f = jax.jit(lambda h: X.moe_block(h, layer, CFG, interpret=INTERPRET))
    h1, h2 = hidden(1, 1), hidden(2, 1)
    ids1 = R.ref_route(h1, layer.mlp.router, layer.mlp.router_bias, CFG, norm_weight=layer.mlp_norm)[0]
    ids2 = R.ref_route(h2, layer.mlp.router, layer.mlp.router_bias, CFG, norm_weight=layer.mlp_norm)[0]
    assert not np.array_equal(np.asarray(ids1), np.asarray(ids2))
    for h in (h1, h2):
        assert_residual_close(f(h), layers.mlp_block(h, layer, CFG), h)
    assert f._cache_size() == 1
