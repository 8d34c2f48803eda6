"""The Mosaic GPU NVFP4 LM head (pallas_kernels/mosaic_nvfp4.py) and its tile layout (flint_jax/nvfp4_tiles.py).

In interpret mode (CI, CPU) the kernel runs in the Mosaic GPU interpreter with the array-op decode
(`decode_values`); `test_interpreter_decode_is_the_ptx_decode` ties that decode to the PTX arithmetic, value for
value. FLINT_PALLAS_COMPILED=1 runs the same kernel cases compiled on a GPU (the device script does).

Tolerance: every product x * w is exact (BF16 x, E2M1 x E4M3 weights, the 2^63 factors exact), so the logits differ
from the reference only in the order of the FP32 sums over K: a relative bound of 1e-5 of max |ref|.
"""
import types

import flint_jax  # noqa: F401  (XLA_FLAGS first)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layers as L
from flint_jax import model as M
from flint_jax import nvfp4, nvfp4_tiles, pallas_path
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels import mosaic_nvfp4 as MN
from kernel_mode import INTERPRET

BF16, F32 = jnp.bfloat16, jnp.float32


def head(n, k, seed=0, gs=0.75):
    """A weight with a global scale, a subnormal E4M3 scale block and a negative one."""
    w = nvfp4.random(jax.random.key(seed), (n, k), 0.05)
    sc = w.scales.astype(F32).at[0, :8].set(2.0 ** -8).at[1, 3].multiply(-1)
    return nvfp4.NVFP4Weight(w.codes, sc.astype(w.scales.dtype), jnp.float32(gs))


def same_bytes(a, b):
    as_u8 = (lambda v: jax.lax.bitcast_convert_type(v, jnp.uint8) if v.dtype != jnp.uint8 else v)
    np.testing.assert_array_equal(np.asarray(as_u8(a)), np.asarray(as_u8(b)))


@pytest.mark.parametrize("q,sub", [(1, 1), (1, 2), (4, 1), (8, 2), (16, 1)])
def test_pack_unpack_is_lossless(q, sub):
    w = head(256, 4096, seed=q + sub)
    t = nvfp4_tiles.pack(w, q=q, sub=sub)
    assert (t.n, t.k, t.q, t.sub) == (256, 4096, q, sub)
    back = nvfp4_tiles.unpack(t)
    same_bytes(back.codes, w.codes)
    same_bytes(back.scales, w.scales)
    assert float(back.global_scale) == 0.75
    assert t.nbytes == w.nbytes


def test_tile_order_is_the_documented_one():
    """Code byte (row n, byte b) and scale byte (row n, group g) land where the module docstring says (q = 1)."""
    N, K = 128, 512
    w = head(N, K, seed=3)
    t = nvfp4_tiles.pack(w, q=1, sub=1)
    codes, scales = np.asarray(t.codes), np.asarray(jax.lax.bitcast_convert_type(t.scales, jnp.uint8))
    wc, ws = np.asarray(w.codes), np.asarray(jax.lax.bitcast_convert_type(w.scales, jnp.uint8))
    steps = K // 128
    for n, b in [(0, 0), (5, 63), (64, 64), (127, 255), (70, 130)]:
        i, m, tt, byte = n // 64, n % 64, b // 64, b % 64
        assert codes[(i * steps + tt) * 64 + m, byte] == wc[n, b]
    for n, g in [(0, 0), (9, 1), (64, 17), (127, 31), (100, 20)]:
        e, rest = g // (K // 32), g % (K // 32)  # low / high half, then 4 t + j
        i, m, tt, j = n // 64, n % 64, rest // 4, rest % 4
        flat = m * 8 + 2 * j + e
        assert scales[(i * steps + tt) * 2 + flat // 256, flat % 256] == ws[n, g]


def test_shapes_that_do_not_tile_are_refused_by_name():
    assert not nvfp4_tiles.supports((100, 512))
    assert not nvfp4_tiles.supports((128, 64))
    assert nvfp4_tiles.supports((151552, 2048))
    with pytest.raises(ValueError, match=r"\[100, 512\]"):
        nvfp4_tiles.pack(nvfp4.random(jax.random.key(0), (100, 512)))
    stacked = nvfp4.random(jax.random.key(0), (2, 128, 512))
    with pytest.raises(ValueError, match="one \\[N, K\\] weight"):
        nvfp4_tiles.pack(stacked)


def test_interpreter_decode_is_the_ptx_decode():
    """decode_values (the interpreter's A) equals DECODE_PTX's bit pattern (decoded_byte) times SCALE_PTX's scale,
    for every code byte in every register position, with positive, negative and subnormal scales."""
    rng = np.random.default_rng(0)
    codes = np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) % 256
    codes = codes.astype(np.uint8)
    sb = rng.integers(0, 256, 512, dtype=np.uint8)
    sb[sb == 0x7F] = 0x7E  # E4M3's NaN patterns are not scales
    sb[sb == 0xFF] = 0xFE
    sb[:4] = [0x01, 0x81, 0x07, 0x38]  # subnormals, a negative one, 1.0
    got = np.asarray(MN.decode_values(jnp.asarray(codes), jnp.asarray(sb.reshape(2, 256))).astype(F32))
    e4m3 = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(sb), jnp.float8_e4m3fn).astype(F32), np.float64)
    for m in range(64):
        for j in range(4):
            for c in range(16):
                pair = MN.decoded_byte(int(codes[m, 16 * j + c]))
                for e in range(2):
                    want = pair[e] * e4m3[m * 8 + 2 * j + e] * 2.0 ** MN.X_SHIFT
                    assert got[m, 8 * c + 2 * j + e] == np.float32(want), (m, j, c, e)


@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_lm_head_logits(m):
    """Rows 1..8 in one launch (8 rows of B), 11 in two; two row blocks, sub = 2 (two steps per TMA copy)."""
    N, K = 128, 512
    t = nvfp4_tiles.pack(head(N, K, seed=m))
    assert t.sub == 2
    x = (2.0 * jax.random.normal(jax.random.key(10 + m), (m, K), F32)).astype(BF16)
    got = MN.lm_head_logits(x, t, interpret=INTERPRET)
    want = MN.ref_lm_head_logits(x, t)
    assert got.shape == (m, N) and got.dtype == F32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def test_lm_head_logits_one_step_per_copy():
    N, K = 64, 384  # three 128-value steps: sub = 1
    t = nvfp4_tiles.pack(head(N, K, seed=4))
    assert t.sub == 1
    x = jax.random.normal(jax.random.key(5), (2, K), F32).astype(BF16)
    got = MN.lm_head_logits(x, t, interpret=INTERPRET)
    want = MN.ref_lm_head_logits(x, t)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def test_lm_head_refuses_other_tiles():
    t = nvfp4_tiles.pack(head(64, 512), q=4)
    with pytest.raises(ValueError, match="q=1"):
        MN.lm_head_logits(jnp.zeros((1, 512), BF16), t, interpret=INTERPRET)


def test_pallas_path_lm_logits_on_tiles_is_the_reference():
    """model.lm_logits(impl="pallas") on a tiled head: final norm + kernel, against the reference on the untiled
    head; impl="xla" reads the tiles back and gives the reference exactly."""
    cfg = types.SimpleNamespace(rms_norm_eps=1e-5)
    w = head(192, 256, seed=7)
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(8), (256,), F32)).astype(BF16)
    h = (3.0 * jax.random.normal(jax.random.key(9), (2, 1, 256), F32)).astype(BF16)
    plain = types.SimpleNamespace(final_norm=norm, lm_head=w)
    tiled = types.SimpleNamespace(final_norm=norm, lm_head=nvfp4_tiles.pack(w))
    want = L.logits_from_hidden(h, norm, w, 1e-5)
    got = M.lm_logits(tiled, h, cfg, impl="pallas")  # interpreted on the CPU, compiled on a GPU
    assert got.shape == (2, 1, 192)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(M.lm_logits(tiled, h, cfg, impl="xla")),
                                  np.asarray(M.lm_logits(plain, h, cfg, impl="xla")))


def test_engine_layout_tiles_the_nvfp4_head():
    cfg = FlintConfig.tiny(hidden_size=256, vocab_size=320)
    from flint_jax.params import init_params
    params = init_params(cfg, jax.random.key(0), "nvfp4")
    head_before = params.lm_head
    sp = pallas_path.engine_layout(params, tile_lm_head=True)
    assert isinstance(sp.lm_head, nvfp4_tiles.NVFP4Tiles)
    same_bytes(nvfp4_tiles.unpack(sp.lm_head).codes, head_before.codes)
    assert not isinstance(pallas_path.engine_layout(params, tile_lm_head=False).lm_head, nvfp4_tiles.NVFP4Tiles)
    bf16 = init_params(FlintConfig.tiny(), jax.random.key(0))
    assert pallas_path.engine_layout(bf16, tile_lm_head=True).lm_head is bf16.lm_head  # BF16 heads stay


@pytest.mark.parametrize("m", [1, 9])
def test_lm_head_lowers_for_cuda(m):
    """The compiled kernel (hand-written decode and register stores, which the interpreter does not run) lowers for
    CUDA on a CPU host: one Mosaic GPU kernel per 8 rows."""
    t = jax.eval_shape(lambda: nvfp4_tiles.pack(nvfp4.random(jax.random.key(0), (256, 512))))
    with pallas_path.lowering_for_gpu():
        text = jax.jit(MN.lm_head_logits).trace(jax.ShapeDtypeStruct((m, 512), BF16), t).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == (m + 7) // 8
