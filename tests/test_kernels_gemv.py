"""Small-batch GEMV kernels (pallas_kernels/gemv.py) against their references, in interpret mode on the CPU.

Set FLINT_PALLAS_COMPILED=1 to run the same cases compiled on a GPU (scripts/gpu_kernels_weights.sh does).

Tolerance, and why: every product x * w is exact in FP32 (BF16 x BF16, and an NVFP4 value has at most 5
significant bits), so kernel and reference differ only in the order of the FP32 sum over K (the kernel also applies
each 16-value block scale after summing the block). That moves the FP32 accumulator by a few FP32 ulps of the
partial sums; after the BF16 rounding of a linear output it can flip the rounding of an output that lies within
that distance of a BF16 rounding boundary: at most 1 BF16 ulp, on a small fraction of outputs (0 in most interpret
runs, where both sides run on the CPU). The FP32 logits are compared with a relative bound of 1e-5 of max |ref|.
"""


import flint_jax  # noqa: F401  (XLA_FLAGS first)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layers, nvfp4
from flint_jax.pallas_kernels import gemv as G
from flint_jax.pallas_kernels import weight_tiles as wt
from numerics import assert_bf16_close, assert_residual_close
from kernel_mode import INTERPRET

BF16, F32 = jnp.bfloat16, jnp.float32


def make_weight(key, n, k, kind, gs=1.7):
    if kind == "nvfp4":
        w = nvfp4.random(key, (n, k), 0.05)
        return nvfp4.NVFP4Weight(w.codes, w.scales, jnp.float32(gs))
    return (0.05 * jax.random.normal(key, (n, k), F32)).astype(BF16)


def inputs(seed, m, n, k):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (2.0 * jax.random.normal(k1, (m, k), F32)).astype(BF16)
    nw = (1 + 0.1 * jax.random.normal(k2, (k,), F32)).astype(BF16)
    res = jax.random.normal(k3, (m, n), F32).astype(BF16)
    return x, nw, res


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_norm_residual(kind, m):
    n, k = 640, 512
    x, nw, res = inputs(m, m, n, k)
    w = make_weight(jax.random.PRNGKey(10 + m), n, k, kind)
    out = G.gemv(x, w, norm_weight=nw, residual=res, interpret=INTERPRET)
    assert_residual_close(out, G.ref_gemv(x, w, norm_weight=nw, residual=res), res)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_gemv_plain_and_blocks(kind):
    """No norm, no residual; N = 192 (not a power of two) and an explicit block override."""
    n, k = 192, 256
    x, _, _ = inputs(7, 3, n, k)
    w = make_weight(jax.random.PRNGKey(3), n, k, kind, gs=0.37)
    ref = G.ref_gemv(x, w)
    assert_bf16_close(G.gemv(x, w, interpret=INTERPRET), ref)
    assert_bf16_close(G.gemv(x, w, interpret=INTERPRET, block=(64, 64, 4, 2)), ref)
    assert_bf16_close(G.gemv(x, w, interpret=INTERPRET, block=(16, 128, 4, 2, False, True)), ref)  # elementwise
    assert_bf16_close(G.gemv(x, w, interpret=INTERPRET, block=(16, 64, 4, 2, False, False, True)), ref)  # prefetch


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [3, 8])
def test_gemv_tensor_core_path(kind, m):
    """block=(..., dot=True): rows padded to 8, tiles decoded to BF16 (NVFP4: weight_tiles.decode_packed) and
    multiplied on the tensor cores with the weight tile as the left operand; all epilogues. 3 rows: the padding."""
    n, k = 256, 512
    x, nw, res = inputs(40, m, n, k)
    w = make_weight(jax.random.PRNGKey(41), n, k, kind)
    blk = (32, 256, 4, 2, True)
    f = jax.jit(lambda x, w, nw, res: (G.gemv(x, w, norm_weight=nw, residual=res, interpret=INTERPRET, block=blk),
                                       G.gemv_logits(x, w, norm_weight=nw, interpret=INTERPRET, block=blk),
                                       G.gemv_swiglu(x, w, w, interpret=INTERPRET, block=blk)))
    out, logits, act = f(x, w, nw, res)
    assert_residual_close(out, G.ref_gemv(x, w, norm_weight=nw, residual=res), res)
    ref = layers.logits_from_hidden(x, nw, w, 1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    assert_bf16_close(act, G.ref_gemv_swiglu(x, w, w))


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_logits_fp32(kind, m):
    """The LM-head variant: final norm fused, FP32 output never rounded to BF16 (layers.logits_from_hidden)."""
    n, k = 384, 256
    x, nw, _ = inputs(20 + m, m, n, k)
    w = make_weight(jax.random.PRNGKey(5), n, k, kind)
    out = G.gemv_logits(x, w, norm_weight=nw, interpret=INTERPRET)
    ref = layers.logits_from_hidden(x, nw, w, 1e-5)
    assert out.dtype == F32 and out.shape == (m, n)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_block_table_for_flint_shapes(monkeypatch):
    """The measured table (docs/BENCHMARKS.md, runs D/E/J/DP) at Flint's NVFP4 shapes, and the LM head's rows
    running correctly (LARGE_N and the SM count lowered so that a small weight takes them)."""
    spec = lambda n, k: wt.WeightSpec("nvfp4", 1, n, k)  # noqa: E731
    assert G.pick_blocks(spec(2048, 4096), 1)[:3] == (8, 4096, 8)  # O projection
    assert G.pick_blocks(spec(5120, 2048), 1)[:3] == (8, 1024, 4)  # QKV
    assert G.pick_blocks(spec(151552, 2048), 1)[:3] == (16, 2048, 4)  # LM head
    # 2 and 4 rows (runs DP, DQ): QKV in one 2048-value step of 8 warps, the O projection as at 1 row; the LM
    # head and two fused weights keep the 1-row blocks at 2 rows and the generic ones at 4
    for m in (2, 4):
        assert G.pick_blocks(spec(5120, 2048), m)[:3] == (8, 2048, 8)
        assert G.pick_blocks(spec(2048, 4096), m)[:3] == (8, 4096, 8)
    assert G.pick_blocks(spec(151552, 2048), 2)[:3] == (16, 2048, 4)
    assert G.pick_blocks(spec(10240, 2048), 2, n_weights=2)[:3] == (4, 1024, 4)
    assert G.pick_blocks(spec(151552, 2048), 4)[:3] == (16, 512, 4)  # generic
    assert G.pick_blocks(spec(10240, 2048), 4, n_weights=2)[:3] == (8, 512, 4)  # generic 16 rows, halved
    assert G.pick_blocks(spec(151552, 2048), 8) == G.Blocks(*G.DOT_BLOCK, dot=True)  # 8 rows: tensor cores
    monkeypatch.setattr(G, "LARGE_N", 256)
    monkeypatch.setattr(G, "NUM_SMS", 4)
    assert G.pick_blocks(spec(384, 256), 1)[:2] == (16, 256)
    x, nw, _ = inputs(31, 1, 384, 256)
    w = make_weight(jax.random.PRNGKey(6), 384, 256, "nvfp4")
    out = G.gemv_logits(x, w, norm_weight=nw, interpret=INTERPRET)
    ref = layers.logits_from_hidden(x, nw, w, 1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.parametrize("m,k", [(2, 2048), (3, 4096), (4, 2048)])
def test_nvfp4_table_rows_compute_the_reference(m, k):
    """The NVFP4 FMA blocks of 2 and 4 rows (NVFP4_FMA_TABLE, runs DP-DQ: whole-K or 2048-value steps, 8 warps; 3
    rows are padded to 4) give the reference's outputs, norm and residual fused."""
    spec = wt.WeightSpec("nvfp4", 1, 64, k)
    assert G.pick_blocks(spec, wt.pow2_rows(m))[:3] == G.NVFP4_FMA_TABLE[wt.pow2_rows(m)]["long_k" if k >= 4096
                                                                                            else "short_k"]
    x, nw, res = inputs(60 + m, m, 64, k)
    w = make_weight(jax.random.PRNGKey(61), 64, k, "nvfp4")
    out = jax.jit(lambda x, w, nw, res: G.gemv(x, w, norm_weight=nw, residual=res, interpret=INTERPRET))(
        x, w, nw, res)
    assert_residual_close(out, G.ref_gemv(x, w, norm_weight=nw, residual=res), res)


@pytest.mark.parametrize("k", [4096, 2048])
def test_bf16_table_rows(k):
    """BF16 at M <= 2 with one weight takes gemv.BF16_TABLE's rows (run BB): the whole K row per step, 4 rows per
    program; they compute the reference's outputs (norm and residual fused). More rows, or two weights, keep the
    generic table."""
    spec = wt.WeightSpec("bf16", 1, 2048, k)
    want = G.BF16_TABLE["long_k" if k >= 4096 else "short_k"]
    assert G.pick_blocks(spec, 1)[:3] == want[:3] and G.pick_blocks(spec, 2)[:3] == want[:3]
    assert G.pick_blocks(spec, 4)[:3] != want[:3] and G.pick_blocks(spec, 1, n_weights=2)[:3] != want[:3]
    x, nw, res = inputs(50, 1, 64, k)
    w = make_weight(jax.random.PRNGKey(51), 64, k, "bf16")
    out = jax.jit(lambda x, w, nw, res: G.gemv(x, w, norm_weight=nw, residual=res, interpret=INTERPRET))(
        x, w, nw, res)
    assert_residual_close(out, G.ref_gemv(x, w, norm_weight=nw, residual=res), res)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_table_dot_rows_switch_to_tensor_cores(kind):
    """From TABLE_DOT_MIN_ROWS (8) rows on, one-weight calls take the tensor-core path (DOT_BLOCK; run BI); fewer
    rows, two-weight calls and allow_dot=False keep the FMA path. 5 rows are padded to 8 (the MMA's N side).
    Results as the reference either way."""
    spec = wt.WeightSpec(kind, 1, 2048, 4096)
    assert G.pick_blocks(spec, 8) == G.Blocks(*G.DOT_BLOCK, dot=True)
    assert not G.pick_blocks(spec, 4).dot and not G.pick_blocks(spec, 8, n_weights=2).dot
    assert not G.pick_blocks(spec, 8, allow_dot=False).dot
    n, k = 256, 512
    for m in (5, 8):
        x, nw, res = inputs(41 + m, m, n, k)
        w = make_weight(jax.random.PRNGKey(8), n, k, kind)
        out = G.gemv(x, w, norm_weight=nw, residual=res, interpret=INTERPRET)
        assert_residual_close(out, G.ref_gemv(x, w, norm_weight=nw, residual=res), res)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_swiglu(kind, m):
    n, k = 256, 512
    x, nw, _ = inputs(30 + m, m, n, k)
    gate = make_weight(jax.random.PRNGKey(1), n, k, kind, gs=1.3)
    up = make_weight(jax.random.PRNGKey(2), n, k, kind, gs=0.8)
    out = G.gemv_swiglu(x, gate, up, norm_weight=nw, interpret=INTERPRET)
    assert_bf16_close(out, G.ref_gemv_swiglu(x, gate, up, norm_weight=nw))


def lower_for_gpu(monkeypatch, fn, *args) -> str:
    """StableHLO of jit(fn) lowered for CUDA on this CPU-only machine: runs the Pallas -> Triton IR lowering (the stage
    where a GPU run once failed while interpret mode passed), not the Triton compiler. The GPU is described as an
    H200 (compute capability 9.0). Returns the module text; each kernel is one `__gpu$xla.gpu.triton` custom call."""
    from jax import export
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exp.mlir_module()


TRITON_CALL = "__gpu$xla.gpu.triton"
QUIET_TRITON = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@QUIET_TRITON
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_every_variant_lowers_to_triton(kind, monkeypatch):
    """All block variants (FMA rows 1/4/8, full-tile accumulator, tensor cores, one-step K loop) and all three
    epilogues produce Triton kernels for the GPU; one kernel per call."""
    n, k = 256, 512
    w = make_weight(jax.random.PRNGKey(0), n, k, kind)
    nw = jnp.ones((k,), BF16)
    for m, blk in [(1, None), (3, None), (8, None), (1, (16, 512, 4, 3, False, True)), (8, (32, 256, 4, 3, True)),
                   (1, (16, 512, 4, 1)), (2, (8, 256, 4, 1, False, True, True))]:
        x, res = jnp.zeros((m, k), BF16), jnp.zeros((m, n), BF16)

        def all_modes(x, w, nw, res):
            return (G.gemv(x, w, norm_weight=nw, residual=res, block=blk),
                    G.gemv_logits(x, w, norm_weight=nw, block=blk), G.gemv_swiglu(x, w, w, norm_weight=nw, block=blk))
        assert lower_for_gpu(monkeypatch, all_modes, x, w, nw, res).count(TRITON_CALL) == 3


def test_gemv_rejects_bad_shapes():
    w = make_weight(jax.random.PRNGKey(0), 64, 128, "bf16")
    with pytest.raises(ValueError, match="M = 1..8"):
        G.gemv(jnp.zeros((9, 128), BF16), w, interpret=True)
    with pytest.raises(ValueError, match="K=64"):
        G.gemv(jnp.zeros((1, 64), BF16), w, interpret=True)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("bk,prefetch", [(512, False), (256, False), (256, True)],
                         ids=["2_steps", "4_steps", "4_steps_prefetch"])
def test_load_order_knobs_keep_the_output_bits(kind, bk, prefetch, monkeypatch):
    """NORM_AFTER_LOADS and EARLY_EPILOGUE_LOADS only move loads: the fused-norm, residual GEMV and the dense SwiGLU
    give the same bits with the norm prologue and the epilogue's loads in their old places (K in 2 steps: the
    peeled first step and one more; in 4: the peeled step and a loop, also with the register prefetch)."""
    n, k, m = 256, 1024, 1
    x, nw, res = inputs(7, m, n, k)
    w, u = make_weight(jax.random.PRNGKey(70), n, k, kind), make_weight(jax.random.PRNGKey(71), n, k, kind)
    block = (8, bk, 4, 1, False, False, prefetch)
    outs = []
    for flag in (True, False):
        monkeypatch.setattr(wt, "NORM_AFTER_LOADS", flag)
        monkeypatch.setattr(wt, "EARLY_EPILOGUE_LOADS", flag)
        outs.append([np.asarray(G.gemv(x, w, norm_weight=nw, residual=res, interpret=INTERPRET, block=block)),
                     np.asarray(G.gemv_swiglu(x, w, u, norm_weight=nw, interpret=INTERPRET, block=block))])
    for new, old in zip(*outs):
        np.testing.assert_array_equal(new, old)
    assert_residual_close(outs[0][0], G.ref_gemv(x, w, norm_weight=nw, residual=res), res)
