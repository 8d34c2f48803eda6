"""The packed NVFP4 -> BF16 decode's inline PTX (`weight_tiles._packed_ptx`) runs only on the GPU (the prefill GEMMs
and the decode path's tensor-core GEMVs), and so does the FP8 KV cache's decode (`decode_attention._fp8_ptx`). Here a
small interpreter of the instructions they use (mov, prmt, shl, shr, and, or, fma.rn.bf16x2) runs the PTX text on
the CPU, and it must give the bits of the array path that interpret mode runs, for every code byte and every finite
E4M3 scale (every finite E4M3 value): an edit that breaks the PTX fails CI, not a device run."""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax.pallas_kernels import decode_attention as da
from flint_jax.pallas_kernels import weight_tiles as wt

U32 = np.uint32


def _bf16_bits_to_f32(bits):
    return (bits.astype(U32) << U32(16)).view(np.float32)


def _f32_to_bf16_bits(x):
    """Round to nearest even, as the PTX's .rn does (jnp's conversion)."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)).view(np.uint16).astype(U32)


def _prmt(a, b, sel: int):
    """prmt.b32 default mode: result byte i = byte (sel's nibble i & 7) of {b:a} (a bytes 0-3, b bytes 4-7)."""
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, "sign-replicate selectors are not modelled"
        src = a if nib < 4 else b
        byte = (src >> U32(8 * (nib % 4))) & U32(0xFF)
        out |= byte << U32(8 * i)
    return out


def _fma_bf16x2(a, b, c):
    """Per 16-bit lane: bf16(a * b + c), rounded once (the products here are exact in FP32)."""
    out = np.zeros_like(a)
    for shift in (0, 16):
        lane = [_bf16_bits_to_f32((v >> U32(shift)) & U32(0xFFFF)).astype(np.float64) for v in (a, b, c)]
        out |= _f32_to_bf16_bits((lane[0] * lane[1] + lane[2]).astype(np.float32)) << U32(shift)
    return out


def run_ptx(text: str, inputs: dict) -> dict:
    """Interpret `text` (the instructions _packed_ptx emits) over uint32 arrays; inputs/outputs keyed "$k"."""
    regs = dict(inputs)
    shape = next(iter(inputs.values())).shape

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else U32(int(tok, 0))

    for stmt in re.split(r"[;\n]", text):
        stmt = stmt.strip()
        if not stmt or stmt in "{}" or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [s.strip() for s in args.split(",")]
        if op == "mov.b32":
            regs[dst] = np.broadcast_to(val(src[0]), shape).astype(U32)
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(src[0]), val(src[1]), int(src[2], 0))
        elif op == "shl.b32":
            regs[dst] = (val(src[0]).astype(np.uint64) << np.uint64(int(src[1], 0))).astype(U32)
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> U32(int(src[1], 0))
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise AssertionError(f"instruction {op!r} is not modelled")
    return regs


@pytest.mark.parametrize("high", [False, True], ids=["low_nibbles", "high_nibbles"])
def test_packed_ptx_matches_the_array_path(high):
    """Every code byte with every finite E4M3 scale (65,024 values), against decode_packed(ptx=False)."""
    e4m3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    codes = np.tile(np.arange(256, dtype=np.uint8), len(e4m3))
    scale_bytes = np.repeat(e4m3, 256)
    n = codes.size
    # packed_scale broadcasts each scale over its group of 16 values; here every value gets a group of its own
    s = wt.packed_scale(jnp.asarray(scale_bytes[None, :]), n * 16)[0, ::16]
    s_bits = np.asarray(s).view(np.uint16).astype(U32)
    lo, hi = wt.decode_packed(jnp.asarray(codes[None, :]), s[None, :], s[None, :], ptx=False)
    want = np.asarray(hi if high else lo)[0].view(np.uint16).astype(U32)

    words = codes.reshape(-1, 4).astype(U32)
    sw = s_bits.reshape(-1, 4)
    regs = run_ptx(wt._packed_ptx(high), {
        "$2": words[:, 0] | words[:, 1] << U32(8) | words[:, 2] << U32(16) | words[:, 3] << U32(24),
        "$3": sw[:, 0] | sw[:, 1] << U32(16), "$4": sw[:, 2] | sw[:, 3] << U32(16)})
    got = np.stack([regs["$0"] & U32(0xFFFF), regs["$0"] >> U32(16), regs["$1"] & U32(0xFFFF), regs["$1"] >> U32(16)],
                   axis=1).reshape(n)
    np.testing.assert_array_equal(got, want)
    assert len(set(want.tolist())) > 400  # not degenerate: 476 distinct BF16 values (8 magnitudes x 254 scales, signed)


def test_the_interpreter_catches_a_wrong_mask():
    """The check can fail: the same PTX with the magnitude mask one bit short gives other bits."""
    good = wt._packed_ptx(False)
    bad = good.replace("0x01C001C0", "0x01800180")
    words = np.arange(64, dtype=U32) * U32(0x01030507)
    inputs = {"$2": words, "$3": np.full(64, 0x3F803F80, U32), "$4": np.full(64, 0x3F803F80, U32)}
    assert not np.array_equal(run_ptx(good, inputs)["$0"], run_ptx(bad, inputs)["$0"])


@pytest.mark.parametrize("to_f32", [False, True], ids=["bf16", "f32"])
def test_fp8_cache_ptx_gives_the_casts_values(to_f32):
    """decode_attention._fp8_ptx: every finite E4M3 byte (254: subnormals, both zeros, +-448) in every position of a
    4-byte word, against jnp's cast of the same FP8 values to BF16 / FP32 (what interpret mode runs)."""
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    codes = np.concatenate([np.roll(finite, r) for r in range(4)])  # each value in each lane
    dtype = jnp.float32 if to_f32 else jnp.bfloat16
    want = np.asarray(jnp.asarray(codes).view(jnp.float8_e4m3fn).astype(dtype))
    want_bits = want.view(np.uint32) if to_f32 else want.view(np.uint16).astype(U32)
    words = codes.reshape(-1, 4).astype(U32)
    packed = words[:, 0] | words[:, 1] << U32(8) | words[:, 2] << U32(16) | words[:, 3] << U32(24)
    regs = run_ptx(da._fp8_ptx(to_f32), {"$4" if to_f32 else "$2": packed})
    if to_f32:
        got = np.stack([regs[f"${i}"] for i in range(4)], axis=1).reshape(-1)
    else:
        got = np.stack([regs["$0"] & U32(0xFFFF), regs["$0"] >> U32(16), regs["$1"] & U32(0xFFFF),
                        regs["$1"] >> U32(16)], axis=1).reshape(-1)
    np.testing.assert_array_equal(got, want_bits)
    assert np.abs(want).max() == 448.0 and np.abs(want[want != 0]).min() == 2.0 ** -9  # the range's both ends


def test_fp8_interpreter_catches_a_wrong_shift():
    """The FP8 check can fail: a shift of 3 instead of 4 gives other bits."""
    good = da._fp8_ptx(False)
    bad = good.replace("shr.b32 a, t, 4", "shr.b32 a, t, 3")
    words = np.arange(64, dtype=U32) * U32(0x01030507)
    assert not np.array_equal(run_ptx(good, {"$2": words})["$0"], run_ptx(bad, {"$2": words})["$0"])
