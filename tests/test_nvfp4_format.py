"""NVFP4 format functions: GGUF block <-> kernel layout repack (lossless against gguf's decoder) and the quantizer
(against a line-by-line port of ggml's quantize_row_nvfp4_ref)."""

import struct

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import nvfp4

NVFP4_T = gguf.GGMLQuantizationType.NVFP4


# ---- an independent scalar port of ggml's C (ggml-impl.h, ggml-quants.c), FP32 arithmetic throughout ----------
def _f32_bits(x: np.float32) -> int:
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def ref_fp32_to_ue4m3(x: np.float32) -> int:
    x = np.float32(x)
    if not x > 0:
        return 0
    if x > 448:
        x = np.float32(448)
    bits = _f32_bits(x)
    e = ((bits >> 23) & 0xFF) - 127 + 7
    if e <= 0:
        man = int(x * np.float32(512.0) + np.float32(0.5))
        return 0 if man < 1 else min(man, 7)
    if e >= 15:
        return 0x7E
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    if man > 7:
        man, e = 0, e + 1
        if e >= 15:
            return 0x7E
    return (e << 3) | man


def ref_ue4m3_to_fp32(b: int) -> np.float32:  # ggml's: the E4M3 value times 0.5
    if b in (0, 0x7F):
        return np.float32(0)
    e, m = (b >> 3) & 0xF, b & 7
    raw = np.float32(np.ldexp(m, -9)) if e == 0 else np.float32(np.ldexp(1 + m / 8, e - 7))
    return np.float32(raw * np.float32(0.5))


KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def ref_best_index(x: np.float32, d: np.float32) -> int:
    best, best_err = 0, np.float32(abs(np.float32(KVALUES[0]) * d - x))
    for i in range(1, 16):
        err = np.float32(abs(np.float32(KVALUES[i]) * d - x))
        if err < best_err:
            best, best_err = i, err
    return best


def ref_quantize_row(x: np.ndarray) -> bytes:
    out = bytearray()
    for blk in x.reshape(-1, 64).astype(np.float32):
        d_bytes, qs = [], []
        for s in range(4):
            xb = blk[16 * s:16 * s + 16]
            amax = np.float32(0)
            for v in xb:
                if amax < abs(v):
                    amax = np.float32(abs(v))
            ue = ref_fp32_to_ue4m3(np.float32(amax / np.float32(6.0)))
            d_bytes.append(ue)
            d = ref_ue4m3_to_fp32(ue)
            qs += [ref_best_index(xb[j], d) | (ref_best_index(xb[8 + j], d) << 4) for j in range(8)]
        out += bytes(d_bytes) + bytes(qs)
    return bytes(out)


def gguf_dequant(blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, NVFP4_T)


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def tricky_rows(rng, rows=24):
    """Rows spanning UE4M3's range (subnormal, normal, saturated), exact ties, zeros and negative small values."""
    out = []
    for r in range(rows):
        mag = 2.0 ** rng.uniform(-14, 12)
        x = (rng.standard_normal(64) * mag).astype(np.float32)
        if r % 4 == 1:  # exact midpoints between E2M1 magnitudes for the scale fixed by amax = 6 s
            s = np.float32(2.0 ** rng.integers(-6, 8))
            x[:16] = s * np.array([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, 0])
        if r % 4 == 2:
            x[16:32] = 0.0
            x[32:48] = -np.abs(x[32:48]) * 1e-3  # negative values that round to zero
            x[40] = -0.0
        out.append(x)
    return np.stack(out)


# ---- scale encoding -------------------------------------------------------------------------------------------
def test_ue4m3_encode_matches_ggml_and_gguf():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.exp2(rng.uniform(-16, 10, 20000)), np.arange(0, 460, 1 / 64), np.arange(2000) / 2 ** 16,
                        [0.0, -1.0, 448.0, 1e9, 2 ** -7 * 1.99, 2 ** -6 * 0.999]]).astype(np.float32)
    ours = nvfp4.ue4m3_encode(x)
    assert np.array_equal(ours, gguf.quants.NVFP4.fp32_to_ue4m3(x))
    sample = x[:: 37]
    assert ours[:: 37].tolist() == [ref_fp32_to_ue4m3(v) for v in sample]


def test_ue4m3_decode_is_ggml_times_two():
    b = np.array([v for v in range(0x7F)], np.uint8)
    assert np.array_equal(nvfp4.ue4m3_decode(b) * np.float32(0.5), [ref_ue4m3_to_fp32(int(v)) for v in b])


# ---- quantizer ------------------------------------------------------------------------------------------------
def test_quantizer_matches_ggml_reference_port():
    rng = np.random.default_rng(1)
    x = tricky_rows(rng)
    ours = nvfp4.quantize_gguf_blocks(x)
    ref = np.frombuffer(b"".join(ref_quantize_row(r) for r in x), np.uint8).reshape(ours.shape)
    assert np.array_equal(ours, ref)


def test_quantizer_never_writes_code_8_and_zero_scale_gives_zero_codes():
    x = np.zeros((1, 64), np.float32)
    x[0, :16] = -1e-12  # amax / 6 rounds to scale byte 0
    b = nvfp4.quantize_gguf_blocks(x)
    assert b[0, :4].tolist() == [0, 0, 0, 0] and not b[0, 4:].any()
    codes = nvfp4.unpack_codes(np.asarray(nvfp4.quantize(tricky_rows(np.random.default_rng(2))[:, None, :].reshape(
        -1, 64)).codes))
    assert not (codes == 8).any()


def test_quantize_dequantize_round_trip_bytes():
    """For bytes ggml's quantizer writes, quantize(dequantize(bytes)) == bytes, across the whole scale range;
    the one exception (ggml's own rule, documented in NVFP4_LAYOUT.md) is a subnormal scale byte (0x01..0x07)
    whose largest code is below 6: re-deriving amax / 6 from the dequantized values picks a smaller scale."""
    rng = np.random.default_rng(3)
    x = tricky_rows(rng, 64)
    b = nvfp4.quantize_gguf_blocks(x)
    again = nvfp4.quantize_gguf_blocks(gguf_dequant(b))
    sub = b.reshape(-1, 36)[:, :4]  # [blocks, 4] scale bytes
    codes = b.reshape(-1, 36)[:, 4:].reshape(-1, 4, 8)
    top = np.maximum((codes & 7).max(-1), (codes >> 4 & 7).max(-1))  # largest magnitude code per sub-block
    exception = ((sub >= 1) & (sub <= 7) & (top < 7)).any(-1)
    ok = ~exception
    assert ok.sum() > 40
    assert np.array_equal(again.reshape(-1, 36)[ok], b.reshape(-1, 36)[ok])
    # The exception exists and is ggml's: 0.0179 -> scale byte 2 with top code 4.0, whose dequantized amax / 6 = 1.33
    # rounds to scale byte 1.
    y = np.zeros((1, 64), np.float32)
    y[0, 0] = 4.6 * 2 * 2.0 ** -9
    first = nvfp4.quantize_gguf_blocks(y)
    assert first[0, 0] == 2 and ref_quantize_row(y[0])[0] == 2
    assert nvfp4.quantize_gguf_blocks(gguf_dequant(first))[0, 0] == 1


def test_quantize_pow2_global_scale():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 32, 128)) * np.array([0.02, 1.0, 300.0])[:, None, None]).astype(np.float32)
    w = nvfp4.quantize(x, global_scale="pow2")
    gs = np.asarray(w.global_scale)
    assert gs.shape == (3,) and np.all(np.log2(gs) == np.round(np.log2(gs)))
    for e in range(3):  # bytes are ggml's rounding of x / gs (exact division by a power of two)
        blocks = nvfp4.to_gguf_blocks(nvfp4.NVFP4Weight(w.codes[e], w.scales[e], gs[e]))
        assert np.array_equal(blocks, nvfp4.quantize_gguf_blocks(x[e] / gs[e]))
        top = nvfp4.ue4m3_decode(blocks.reshape(-1, 36)[:, :4]).max()
        assert 128 <= top < 256  # the largest block scale lands in the top uncollapsed octave
    deq = nvfp4.dequantize_np(w)
    rel = np.sqrt(np.mean((deq - x) ** 2, axis=(1, 2)) / np.mean(x ** 2, axis=(1, 2)))
    assert np.all(rel < 0.12), rel  # E2M1 with per-16 scales: ~9% RMS error on Gaussian data


def test_quantizer_refuses_non_finite():
    x = np.zeros((2, 64), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(nvfp4.NVFP4FormatError, match="non-finite value nan at row 1, column 5"):
        nvfp4.quantize_gguf_blocks(x)


# ---- repack ---------------------------------------------------------------------------------------------------
def degenerate_blocks(rng, shape):
    """Random GGUF NVFP4 blocks [*shape, 36]: every code (8 included), and scale bytes drawn from everything but
    0xFF with the degenerate ones (0x00, 0x7F, 0x80, 0x81, 0xFE, 0xF8) over-represented."""
    b = rng.integers(0, 256, (*shape, 36), dtype=np.uint8)
    sc = rng.integers(0, 255, (*shape, 4), dtype=np.uint8)  # 0..0xFE
    special = np.array([0x00, 0x7F, 0x80, 0x81, 0xFE, 0xF8], np.uint8)
    pick = rng.random((*shape, 4)) < 0.3
    sc[pick] = rng.choice(special, pick.sum())
    b[..., :4] = sc
    return b


def test_repack_lossless_against_gguf_dequantize_all_scale_bytes():
    # every allowed scale byte (0x00..0xFE) with every code, in one tensor
    sc = np.arange(255, dtype=np.uint8)
    blocks = np.zeros((255, 1, 36), np.uint8)
    blocks[:, 0, :4] = sc[:, None]
    blocks[:, 0, 4:] = np.tile(np.arange(256, dtype=np.uint8), 2)[:32][None] + np.arange(255, dtype=np.uint8)[:, None]
    blocks = blocks.reshape(255, 36)
    w = nvfp4.from_gguf_blocks(blocks)
    assert np.array_equal(bits(nvfp4.dequantize_f32(w)), bits(gguf_dequant(blocks)))


@pytest.mark.parametrize("shape", [(5, 2), (3, 5, 2), (2, 4, 3, 1)])  # [N, K/64], [E, N, K/64], two lead dims
def test_repack_lossless_random_with_degenerate_bytes(shape):
    rng = np.random.default_rng(sum(shape))
    blocks = degenerate_blocks(rng, shape).reshape(*shape[:-1], shape[-1] * 36)
    gs = rng.uniform(0.5, 2.0, shape[:-2]).astype(np.float32) if len(shape) > 2 else None
    w = nvfp4.from_gguf_blocks(blocks, gs)
    ref = gguf_dequant(blocks)
    if gs is not None:
        ref = ref * gs[..., None, None]
    assert w.codes.dtype == np.uint8 and w.scales.dtype == jnp.float8_e4m3fn
    assert np.array_equal(bits(nvfp4.dequantize_f32(w)), bits(ref))  # bit-exact FP32, signed zeros included
    assert np.array_equal(bits(nvfp4.dequantize_np(w)), bits(ref))
    assert not np.isnan(np.asarray(w.scales, np.float32)).any()


def test_repack_canonicalises_and_inverts():
    rng = np.random.default_rng(7)
    blocks = degenerate_blocks(rng, (6, 4)).reshape(6, 4 * 36)
    back = nvfp4.to_gguf_blocks(nvfp4.from_gguf_blocks(blocks)).reshape(6, 4, 36)
    want = blocks.reshape(6, 4, 36).copy()
    sc = want[..., :4] & 0x7F
    sc[sc == 0x7F] = 0
    want[..., :4] = sc
    lo, hi = want[..., 4:] & 0xF, want[..., 4:] >> 4
    lo[lo == 8], hi[hi == 8] = 0, 0
    want[..., 4:] = lo | (hi << 4)
    assert np.array_equal(back, want)
    canon = want.reshape(6, 4 * 36)  # canonical bytes are a fixed point
    assert np.array_equal(nvfp4.to_gguf_blocks(nvfp4.from_gguf_blocks(canon)), canon)


def test_repack_layout_is_planar_halves():
    """Value k of a row lands at byte k (low nibble) or byte k - K/2 (high nibble); scale k // 16."""
    rng = np.random.default_rng(8)
    blocks = degenerate_blocks(rng, (2, 2)).reshape(2, 72)
    blocks[:, [0, 36]] = 0x38  # scale 1.0 for the first sub-block of each block
    w = nvfp4.from_gguf_blocks(blocks)
    codes = np.asarray(nvfp4.unpack_codes(w.codes))
    gguf_vals = gguf_dequant(blocks)
    for k in list(range(16)) + list(range(64, 80)):
        assert np.array_equal(nvfp4.E2M1_VALUES[codes[:, k]] * np.float32(1.0) + 0.0, gguf_vals[:, k] + 0.0)
    assert w.codes.shape == (2, 64) and w.scales.shape == (2, 8)


def test_repack_refuses_ff_with_block_index():
    blocks = np.zeros((3, 2 * 36), np.uint8)
    blocks[2, 36 + 2] = 0xFF  # row 2, second block, third scale
    with pytest.raises(nvfp4.NVFP4FormatError, match=r"0xFF in block 5 \(row 2, values 64..127\)") as e:
        nvfp4.from_gguf_blocks(blocks)
    assert e.value.block == 5
    assert gguf_dequant(blocks)[2, 64 + 32:64 + 48].tolist() == [0.0] * 16  # (codes are 0 here)
    probe = blocks.copy()
    probe[2, 36 + 4 + 16] = 0x01  # one code under the 0xFF scale: gguf reads 480 x 0.5
    assert gguf_dequant(probe)[2, 64 + 32] == 240.0


def test_to_gguf_refuses_negative_or_nan_scales():
    w = nvfp4.NVFP4Weight(np.zeros((1, 32), np.uint8), np.array([[1.0, -2.0, 1.0, 1.0]], jnp.float8_e4m3fn),
                          np.float32(1))
    with pytest.raises(nvfp4.NVFP4FormatError, match="negative or NaN"):
        nvfp4.to_gguf_blocks(w)


def test_dequantize_bit_decode_equals_the_value_table_for_every_code_and_scale_byte():
    """nvfp4.dequantize decodes with integer ops (decode_codes / decode_scales); it must give exactly
    E2M1_VALUES[code] * E4M3(scale) for every code byte (both nibbles) and every finite E4M3 scale byte."""
    import ml_dtypes
    codes = np.tile(np.arange(256, dtype=np.uint8), (254, 4))  # [254, 1024]: K = 2048, every byte per row
    scale_bytes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)  # the 254 finite ones
    scales = np.broadcast_to(scale_bytes[:, None], (254, 2048 // nvfp4.BLOCK)).copy().view(ml_dtypes.float8_e4m3fn)
    w = nvfp4.NVFP4Weight(jnp.asarray(codes), jnp.asarray(scales), jnp.ones((), jnp.float32))
    got = np.asarray(nvfp4.dequantize(w, jnp.float32))
    want = (nvfp4.E2M1_VALUES[nvfp4.unpack_codes(codes)]
            * np.repeat(scales.astype(np.float32), nvfp4.BLOCK, axis=-1))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(w)).astype(np.float32), want)  # exact in BF16 too


def test_bit_decode_equals_the_value_tables_for_every_code_and_scale_byte():
    """The bit decode that the kernels and dequantize use (integer ops to f16 bits) equals the value tables bit for
    bit, for all 256 code bytes and every finite E4M3 scale byte, including subnormal codes and scales."""
    codes = jnp.arange(256, dtype=jnp.int32)
    lo, hi = nvfp4.decode_codes(codes)
    table = jnp.asarray(nvfp4.E2M1_VALUES)
    np.testing.assert_array_equal(np.asarray(lo * 2.0 ** 14), np.asarray(table[codes & 0xF]))
    np.testing.assert_array_equal(np.asarray(hi * 2.0 ** 14), np.asarray(table[codes >> 4]))
    sb = jnp.array([b for b in range(256) if b & 0x7F != 0x7F], jnp.uint8)
    ref = jax.lax.bitcast_convert_type(sb, jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(nvfp4.decode_scales(sb.astype(jnp.int32)) * 2.0 ** -14), np.asarray(ref))
