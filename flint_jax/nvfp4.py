"""NVFP4 weights in the kernel layout: the one place that knows how the bits are arranged.

A linear weight `W [..., N, K]` (torch layout, `y = x @ W.T`) in NVFP4 is three arrays:

    codes        uint8          [..., N, K // 2]   two 4-bit E2M1 codes per byte, "planar halves":
                                                  byte i of a row holds value i (low nibble) and
                                                  value i + K/2 (high nibble)
    scales       float8_e4m3fn  [..., N, K // 16]  one positive E4M3 scale per 16 consecutive values
    global_scale float32        [...]              per tensor ([] or [E] for stacked experts)

    value(n, k) = E2M1(code(n, k)) * scales[n, k // 16]          (exact in BF16)
    y = bf16(f32acc(x @ value.T) * global_scale)                 (FLINT_SPEC section 2)

Why planar halves: a kernel that streams a K-tile of `BK/2` bytes from column `c` needs x at two contiguous
ranges, `x[c : c + BK/2]` and `x[K/2 + c : K/2 + c + BK/2]`, for any tile size, with no shuffle in registers.
docs/NVFP4_LAYOUT.md has the byte-level picture and the mapping from GGUF's block layout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16  # values per E4M3 scale
GGUF_BLOCK = 64  # values per GGUF NVFP4 block (36 bytes: 4 scale bytes + 32 code bytes)

# E2M1 code -> value. Bit 3 is the sign; bits 2-1 the exponent; bit 0 the mantissa.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    codes: jax.Array  # uint8 [..., N, K // 2]
    scales: jax.Array  # float8_e4m3fn [..., N, K // 16]
    global_scale: jax.Array  # float32 [...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape of the weight."""
        *lead, n, half = self.codes.shape
        return (*lead, n, 2 * half)

    @property
    def nbytes(self) -> int:
        return int(self.codes.size + self.scales.size + 4 * self.global_scale.size)


def check_shape(shape: tuple[int, ...], what: str = "weight") -> None:
    if len(shape) < 2 or shape[-1] % GGUF_BLOCK:
        raise ValueError(f"{what}: NVFP4 needs a row length that is a multiple of {GGUF_BLOCK}, got shape {shape}")


def pack_codes(codes: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """4-bit codes [..., N, K] (one per uint8) -> planar-halves bytes [..., N, K // 2]."""
    half = codes.shape[-1] // 2
    lo, hi = codes[..., :half], codes[..., half:]
    return (lo & 0xF) | ((hi & 0xF) << 4)


def unpack_codes(packed: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """Planar-halves bytes [..., N, K // 2] -> 4-bit codes [..., N, K] (one per uint8)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    return xp.concatenate([packed & 0xF, packed >> 4], axis=-1)


# ---- bit-level decode (XLA and Pallas kernels alike) ---------------------------------------------------------------
# Integer ops and exact f16 -> f32 conversions only, no table lookup and no fp4/fp8 casts (the Pallas Triton lowering
# has none we could rely on; in XLA a table gather and an fp8 convert fuse worse than plain bit arithmetic).
#   E2M1 code c (s e e m) -> f16 bits (c & 7) << 9 | (c & 8) << 12: exactly E2M1(c) * 2^-14 (the subnormal code 1
#   included: f16 represents it exactly, and the f16 -> f32 conversion is exact, so no flush-to-zero question).
#   E4M3 byte b (s eeee mmm) -> f16 bits (b & 0x7f) << 7 | (b & 0x80) << 8: exactly E4M3(b) * 2^-8 (subnormals
#   included; 0x7f, E4M3's NaN, decodes as a finite 480 * 2^-8: scales are never NaN).
# So value = f16(c) * (f16(b) * 2^22), exact in f32 (E2M1 x E4M3 has at most 6 significant bits) and in BF16.
_CODE_SCALE = 2.0 ** 22  # f16(code) * f16(scale) * 2^22 = E2M1 * E4M3


def _f16_bits_to_f32(bits: jax.Array) -> jax.Array:
    """Low 16 bits of an integer array, read as f16, exactly converted to f32."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def decode_codes(b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Code bytes (uint8 or int32) -> (low nibble values, high nibble values) as f32, each E2M1 * 2^-14.

    Both nibbles are built in one 32-bit word, an f16 pair: one multiply spreads the byte to the two exponent/
    mantissa positions (b << 9 | b << 21, no overlap) and one to the two sign positions (b << 12 | b << 24), two
    masks keep the right bits. ~2.5 integer ops per value instead of ~5 for two separate f16 patterns; the f16 -> f32
    conversion reads either half of the word."""
    b = b.astype(jnp.uint32)
    w = ((b * jnp.uint32(0x00200200)) & jnp.uint32(0x0E000E00)) | ((b * jnp.uint32(0x01001000))
                                                                  & jnp.uint32(0x80008000))
    return _f16_bits_to_f32(w & jnp.uint32(0xFFFF)), _f16_bits_to_f32(jax.lax.shift_right_logical(w, jnp.uint32(16)))


def decode_scales(b: jax.Array) -> jax.Array:
    """E4M3 scales (float8_e4m3fn, or their bytes as integers) -> f32 E4M3 * 2^14, which cancels decode_codes'
    2^-14: code * scale = value."""
    if b.dtype == jnp.float8_e4m3fn:
        b = jax.lax.bitcast_convert_type(b, jnp.uint8)
    b = b.astype(jnp.int32)
    return _f16_bits_to_f32(((b & 0x7F) << 7) | ((b & 0x80) << 8)) * _CODE_SCALE


def dequantize(w: NVFP4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """Values E2M1 x E4M3 as `dtype` [..., N, K], without the global scale (exact in BF16), by the bit decode above:
    one elementwise XLA fusion per weight (the prefill's dense NVFP4 projections are dequantized on every call)."""
    lo, hi = decode_codes(w.codes)
    vals = jnp.concatenate([lo, hi], axis=-1)
    scales = jnp.repeat(decode_scales(w.scales), BLOCK, axis=-1)
    return (vals * scales).astype(dtype)


def dequantize_f32(w: NVFP4Weight) -> jax.Array:
    """Values including the global scale, in FP32: what an NVFP4 tensor means as a real matrix."""
    gs = jnp.asarray(w.global_scale, jnp.float32)[..., None, None]
    return dequantize(w, jnp.float32) * gs


def random(key: jax.Array, shape: tuple[int, ...], std: float = 0.02) -> NVFP4Weight:
    """Random NVFP4 weight whose values have roughly standard deviation `std` (synthetic checkpoints)."""
    check_shape(shape)
    *lead, n, k = shape
    kc, ks = jax.random.split(key)
    codes = jax.random.randint(kc, (*lead, n, k // 2), 0, 256, dtype=jnp.int32).astype(jnp.uint8)
    # E2M1 codes drawn uniformly have std ~3.2; jitter the block scale by up to 2x so scales differ.
    jitter = jax.random.uniform(ks, (*lead, n, k // BLOCK), minval=0.7, maxval=1.4)
    scales = (jitter * (std / 3.2)).astype(jnp.float8_e4m3fn)
    return NVFP4Weight(codes, scales, jnp.ones(tuple(lead), jnp.float32))


def abstract(shape: tuple[int, ...]) -> NVFP4Weight:
    check_shape(shape)
    *lead, n, k = shape
    return NVFP4Weight(jax.ShapeDtypeStruct((*lead, n, k // 2), jnp.uint8),
                       jax.ShapeDtypeStruct((*lead, n, k // BLOCK), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct(tuple(lead), jnp.float32))


# ---- GGUF / ggml format: block repack and the reference quantizer -----------------------------------------------
# A GGUF NVFP4 row of K values is K/64 blocks of 36 bytes: 4 UE4M3 scale bytes (one per 16 values), then for each
# of the 4 sub-blocks 8 bytes whose byte j holds value j (low nibble) and value j + 8 (high nibble) of that
# sub-block. The functions below are host-side numpy (the converter streams tensors through them).
#
# Canonical form. ggml's decoder (and gguf.quants.dequantize) ignores bit 7 of a scale byte, reads 0x00 and 0x7F as
# 0 and reads E2M1 code 8 ("-0") as +0. Our layout keeps the scale as a float8_e4m3fn byte, where 0x7F is NaN and
# bit 7 is a sign, so a repack stores the canonical byte: bit 7 cleared, 0x7F -> 0x00, and code 8 -> code 0. Every
# value is unchanged, bit for bit in FP32 (docs/NVFP4_LAYOUT.md). 0xFF is refused: gguf 0.19 decodes it as 480
# (its `== 0x7F` test does not see it), ggml's C decoder as 0, and no quantizer writes it.

GGUF_BLOCK_BYTES = 36
_CHUNK_VALUES = 1 << 22  # values per numpy pass: bounds temporaries to tens of MB whatever the tensor size
_THREADS = min(8, os.cpu_count() or 1)

# Midpoints between consecutive E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, in units of the block scale.
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


class NVFP4FormatError(ValueError):
    """NVFP4 bytes or values our layout cannot hold exactly; `block` is the flat block index, when known."""

    def __init__(self, message: str, block: int | None = None):
        super().__init__(message)
        self.block = block


def _row_chunks(rows: int, row_values: int):
    step = max(1, _CHUNK_VALUES // max(row_values, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _for_row_chunks(rows: int, row_values: int, fn) -> None:
    """fn(r0, r1) over row chunks, on a few threads (numpy releases the GIL; chunks write disjoint rows). The first
    chunk's error, in row order, is the one raised."""
    chunks = list(_row_chunks(rows, row_values))
    workers = min(len(chunks), _THREADS)
    if workers <= 1:
        for c in chunks:
            fn(*c)
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        futures = [ex.submit(fn, *c) for c in chunks]
        for f in futures:
            f.result()


# A GGUF block viewed as a record: 4 scale bytes, then one little-endian 64-bit word per sub-block (its 8 code bytes).
# Working on words (SWAR) keeps numpy's inner loops long: 8 codes per element instead of 1.
_GGUF_RECORD = np.dtype([("d", np.uint8, (4,)), ("q", "<u8", (4,))])
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def _clear_code8(x: np.ndarray) -> np.ndarray:
    """Words of one 4-bit code per byte: code 8 (E2M1 -0) -> code 0 in every byte. Modifies and returns x."""
    z = x ^ np.uint64(0x0808080808080808)  # a byte is 0 where the code was 8
    z += np.uint64(0x7F7F7F7F7F7F7F7F)  # bytes <= 0x0F: no carry between bytes; bit 7 set unless the byte was 0
    np.bitwise_not(z, out=z)
    z &= np.uint64(0x8080808080808080)  # bit 7 set where the code was 8
    z >>= np.uint64(4)
    np.bitwise_not(z, out=z)
    x &= z
    return x


def from_gguf_blocks(blocks: np.ndarray, global_scale: np.ndarray | float | None = None) -> NVFP4Weight:
    """GGUF NVFP4 bytes `[..., N, K/64 * 36]` (uint8, as the gguf reader exposes them) -> an `NVFP4Weight` of numpy
    arrays in the kernel layout, canonicalised as described above. Lossless: `dequantize_f32` of the result equals
    `gguf.quants.dequantize` of `blocks` (times the global scale) bit for bit. `global_scale`: None (1.0), a scalar,
    or an array of the leading shape `[...]`. Raises NVFP4FormatError on scale byte 0xFF."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim < 2 or blocks.shape[-1] % GGUF_BLOCK_BYTES:
        raise NVFP4FormatError(f"expected uint8 GGUF NVFP4 blocks [..., N, K/64*36], got {blocks.dtype} {blocks.shape}")
    *lead, n, row_bytes = blocks.shape
    nb = row_bytes // GGUF_BLOCK_BYTES
    k = nb * GGUF_BLOCK
    rec = np.ascontiguousarray(blocks).reshape(-1, row_bytes).view(_GGUF_RECORD)  # [rows, nb]
    rows = rec.shape[0]
    codes = np.empty((rows, k // 16), "<u8")  # planar-halves bytes, as words
    scales = np.empty((rows, k // BLOCK), np.uint8)

    def chunk(r0: int, r1: int) -> None:
        sc = rec["d"][r0:r1].reshape(r1 - r0, k // BLOCK)
        bad = np.flatnonzero(sc == 0xFF)
        if bad.size:
            i = r0 * (k // BLOCK) + int(bad[0])
            blk = i // 4
            raise NVFP4FormatError(
                f"scale byte 0xFF in block {blk} (row {blk // nb}, values {(blk % nb) * GGUF_BLOCK}.."
                f"{(blk % nb) * GGUF_BLOCK + GGUF_BLOCK - 1}): ggml's decoders disagree on it (gguf 0.19 reads 480, "
                "ggml's C reads 0) and no quantizer writes it", block=blk)
        sc = sc & 0x7F
        sc[sc == 0x7F] = 0
        scales[r0:r1] = sc
        q = rec["q"][r0:r1]  # [r, nb, 4]: sub-block words, byte j = value j (low) | value j + 8 (high)
        vals = np.empty((r1 - r0, nb * 4, 2), "<u8")  # one code per byte, in value order
        vals[..., 0] = _clear_code8(q & _NIBBLES).reshape(r1 - r0, nb * 4)
        vals[..., 1] = _clear_code8((q >> np.uint64(4)) & _NIBBLES).reshape(r1 - r0, nb * 4)
        vals = vals.reshape(r1 - r0, k // 8)
        codes[r0:r1] = vals[:, : k // 16] | (vals[:, k // 16:] << np.uint64(4))  # byte i: value i | value i + K/2
    _for_row_chunks(rows, k, chunk)
    gs = np.ones(tuple(lead), np.float32) if global_scale is None else \
        np.broadcast_to(np.asarray(global_scale, np.float32), tuple(lead)).copy()
    return NVFP4Weight(codes.view(np.uint8).reshape(*lead, n, k // 2),
                       scales.view(jnp.float8_e4m3fn).reshape(*lead, n, k // BLOCK), gs)


def to_gguf_blocks(w: NVFP4Weight) -> np.ndarray:
    """The inverse of `from_gguf_blocks` (global scale aside): kernel layout -> GGUF NVFP4 bytes `[..., N, K/64*36]`.
    Codes are written as they are; scales must be UE4M3 values (no sign, no NaN), else NVFP4FormatError."""
    packed = np.asarray(w.codes)
    sc_all = np.asarray(w.scales).view(np.uint8)
    *lead, n, half = packed.shape
    k = 2 * half
    check_shape((*lead, n, k))
    nb = k // GGUF_BLOCK
    words = np.ascontiguousarray(packed).reshape(-1, half).view("<u8")  # [rows, K/16]
    sc_all = sc_all.reshape(-1, k // BLOCK)
    out = np.empty((words.shape[0], nb), _GGUF_RECORD)

    def chunk(r0: int, r1: int) -> None:
        sc = sc_all[r0:r1]
        sc = np.where(sc == 0x80, np.uint8(0), sc)  # -0 is 0
        bad = np.flatnonzero((sc & 0x80) | (sc == 0x7F))
        if bad.size:
            i = r0 * (k // BLOCK) + int(bad[0])
            raise NVFP4FormatError(f"scale {sc.flat[int(bad[0])]:#04x} at row {i // (k // BLOCK)}, group "
                                   f"{i % (k // BLOCK)} is negative or NaN: UE4M3 cannot hold it", block=i // 4)
        p = words[r0:r1]
        vals = np.concatenate([p & _NIBBLES, (p >> np.uint64(4)) & _NIBBLES], axis=1)  # value order, [r, K/8]
        vals = vals.reshape(r1 - r0, nb, 4, 2)
        out["d"][r0:r1] = sc.reshape(r1 - r0, nb, 4)
        out["q"][r0:r1] = vals[..., 0] | (vals[..., 1] << np.uint64(4))
    _for_row_chunks(words.shape[0], k, chunk)
    return out.view(np.uint8).reshape(*lead, n, nb * GGUF_BLOCK_BYTES)


def ue4m3_encode(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3 (ggml-impl.h), elementwise: FP32 -> UE4M3 byte. Mantissa rounds half up on the 4th bit;
    subnormals round `int(x * 512 + 0.5)`; every value from 256 up (exponent 15) becomes 0x7E (448); <= 0 -> 0."""
    x = np.minimum(np.asarray(x, np.float32), np.float32(448.0))
    bits = x.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7  # before rounding: ggml picks the branch on this
    man = ((bits >> 20) & 0x7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carried = np.where(man > 7, exp + 1, exp)
    normal = np.where(carried >= 15, 0x7E, (np.clip(carried, 0, 15) << 3) | np.where(man > 7, 0, man))
    sub = np.minimum((x * np.float32(512.0) + np.float32(0.5)).astype(np.int32), 7)
    out = np.where(exp <= 0, sub, normal)
    return np.where(x > 0, out, 0).astype(np.uint8)


def ue4m3_decode(b: np.ndarray) -> np.ndarray:
    """UE4M3 byte -> FP32 scale value (the E4M3 value of the byte; ggml's decoder is this times 0.5)."""
    return np.asarray(b, np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)


def quantize_gguf_blocks(x: np.ndarray, divisor: float | np.ndarray | None = None) -> np.ndarray:
    """quantize_row_nvfp4_ref (ggml-quants.c) on rows of x `[..., K]` (K a multiple of 64) -> GGUF NVFP4 bytes
    `[..., K/64 * 36]`. Per 16 values: scale byte = ue4m3_encode(amax / 6) and each value takes the nearest of
    scale x E2M1, ties to the smaller magnitude, and code 0 (never 8) for zero: ggml's first-index argmin over its
    table {0, .5, ..., 6, -0, -.5, ..., -6} (its differences are exact there, so nearest is decided exactly).
    `divisor`: quantize `float32(x) / divisor` instead (a global scale; a scalar or one per row), chunk by chunk."""
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] % GGUF_BLOCK:
        raise NVFP4FormatError(f"NVFP4 needs a row length that is a multiple of {GGUF_BLOCK}, got shape {x.shape}")
    *lead, k = x.shape
    rows = x.reshape(-1, k)
    nb = k // GGUF_BLOCK
    out = np.empty((rows.shape[0], nb, GGUF_BLOCK_BYTES), np.uint8)
    div = None if divisor is None else np.broadcast_to(np.asarray(divisor, np.float32), (rows.shape[0],))

    def chunk(r0: int, r1: int) -> None:
        xb = rows[r0:r1].astype(np.float32).reshape(r1 - r0, k // BLOCK, BLOCK)
        if div is not None and np.any(div[r0:r1] != 1.0):
            xb = xb / div[r0:r1, None, None]
        mag = np.abs(xb)
        amax = mag.max(axis=-1)  # [r, K/16]; NaN and inf propagate here
        if not np.isfinite(amax).all():
            i = int(np.flatnonzero(~np.isfinite(xb))[0])
            raise NVFP4FormatError(f"non-finite value {xb.flat[i]} at row {r0 + i // k}, column {i % k}",
                                   block=(r0 * k + i) // GGUF_BLOCK)
        sc = ue4m3_encode(amax / np.float32(6.0))
        s = ue4m3_decode(sc)[..., None]
        idx = np.zeros(mag.shape, np.uint8)  # magnitude code 0..7: how many midpoints |x| exceeds
        for m in _E2M1_MIDPOINTS:
            idx += mag > m * s
        idx[np.broadcast_to(s == 0, idx.shape)] = 0
        codes = idx | (((xb < 0) & (idx > 0)).view(np.uint8) << 3)  # [r, K/16, 16]
        out[r0:r1, :, :4] = sc.reshape(r1 - r0, nb, 4)
        out[r0:r1, :, 4:] = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(r1 - r0, nb, 32)
    _for_row_chunks(rows.shape[0], k, chunk)
    return out.reshape(*lead, nb * GGUF_BLOCK_BYTES)


def pow2_global_scale(x: np.ndarray, lead_dims: int = 0) -> np.ndarray:
    """A power-of-two global scale per tensor (or per leading index, e.g. per expert) that puts the largest block
    scale in [128, 256), the top octave that ue4m3_encode does not collapse. Dividing by a power of two is exact, so
    quantizing x / gs is ggml's rounding of a shifted exponent range; it keeps small weights (std ~0.02, whose
    amax / 6 would land in UE4M3's 3-bit subnormals) at full 4-bit scale precision. All-zero tensors get 1.0."""
    x = np.asarray(x)
    flat = x.reshape(*x.shape[:lead_dims], -1)
    amax = np.maximum(flat.max(axis=-1), -flat.min(axis=-1)).astype(np.float32)  # no |x| copy
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(amax / np.float32(6.0))) - 7
    return np.where(amax > 0, np.exp2(e), 1.0).astype(np.float32)


def quantize(x: np.ndarray, global_scale: np.ndarray | float | str | None = None) -> NVFP4Weight:
    """FP32/BF16 weight `[..., N, K]` -> `NVFP4Weight` of numpy arrays, with ggml's reference rounding of
    `x / global_scale`. `global_scale`: None (1.0, bytes identical to ggml's quantize_row_nvfp4_ref), a scalar or
    `[...]` array, or "pow2" (see `pow2_global_scale`, one per leading index)."""
    x = np.asarray(x)
    check_shape(x.shape)
    lead = x.shape[:-2]
    if isinstance(global_scale, str):
        if global_scale != "pow2":
            raise ValueError(f"global_scale must be None, a number, an array or 'pow2', got {global_scale!r}")
        gs = pow2_global_scale(x, len(lead))
    else:
        gs = np.broadcast_to(np.asarray(1.0 if global_scale is None else global_scale, np.float32), lead).copy()
    n, k = x.shape[-2:]
    row_gs = np.repeat(gs.reshape(-1), n)  # the global scale of each row
    w = from_gguf_blocks(quantize_gguf_blocks(x.reshape(-1, k), divisor=row_gs))
    return NVFP4Weight(w.codes.reshape(*lead, n, k // 2), w.scales.reshape(*lead, n, k // BLOCK), gs)


def dequantize_np(w: NVFP4Weight) -> np.ndarray:
    """Host-side `dequantize_f32`: FP32 values including the global scale, same arithmetic."""
    vals = E2M1_VALUES[unpack_codes(np.asarray(w.codes))]
    sc = np.repeat(np.asarray(w.scales).astype(np.float32), BLOCK, axis=-1)
    return (vals * sc) * np.asarray(w.global_scale, np.float32)[..., None, None]
