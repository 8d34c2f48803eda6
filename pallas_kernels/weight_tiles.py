"""Streaming a linear weight through a Pallas (Triton-lowered) GPU kernel: operand layout, in-register NVFP4 decode,
and the K loop that every weight-streaming kernel of issue 4 shares (gemv.py, router.py, moe_experts.py); for 5-8
rows the tensor-core loop (`stream_rows_dot`) with the packed NVFP4 -> BF16 decode it shares with the prefill's
grouped GEMMs (`decode_packed`).

Operands (`weight_operands`), always with a leading expert axis (1 for a plain linear):

    bf16   w       bf16  [E, N, K]
    nvfp4  codes   uint8 [E, N, K/32, 16]   the planar-halves bytes of flint_jax.nvfp4, 16 per row of the last axis
           scales  fp8   [E, N, K/16]       the E4M3 scales as stored; the kernel bit-casts each tile to bytes.
                                            (An XLA bitcast_convert in the wrapper is not free: XLA emits it as a
                                            copy fusion, i.e. a full read + write of the scales per call, which
                                            for a stacked expert weight is the whole [E, N, K/16] array.)
           gscale  f32   [E]

Both reshapes are free views in XLA. A K tile of G scale groups reads codes[e, n0:n0+BN, g0:g0+G, :] once: the low
nibbles are values 16*g0 .. 16*(g0+G) (scales[g0:g0+G]) and the high nibbles the same positions + K/2 (scales
[K/32+g0 : K/32+g0+G]); x is passed as [M, K/16, 16] so both halves are plain 3-D slices. 16 contiguous bytes per row
and group keep the loads 16 bytes wide.

Decode: flint_jax.nvfp4.decode_codes / decode_scales (integer ops and exact f16 -> f32 conversions; the Triton
lowering has no fp4/fp8 casts we could rely on); decode_scales returns E4M3 * 2^14, which cancels the codes' 2^-14.
Products x * value are exact in f32 (8 + 5 bits); the kernel multiplies the block scale after summing the 16
products of its group (one multiply per 16 values instead of 16), so only the summation order differs from the
reference's f32 dot: the FP32 result differs from XLA's by reordering alone (a few f32 ulps of the largest partial
sum), which after the BF16 rounding of a linear output shows as at most one BF16 ulp on a small fraction of outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax import layer_stack, nvfp4
from flint_jax.nvfp4 import NVFP4Weight, decode_codes, decode_scales

F32, BF16 = jnp.float32, jnp.bfloat16
GROUP = nvfp4.BLOCK  # values per E4M3 scale = bytes per row of the codes' last axis


# ---- wrapper side -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Static facts about one streamed weight: its kind and logical [E, N, K] shape."""
    kind: str  # "bf16" | "nvfp4"
    experts: int
    n: int
    k: int

    @property
    def num_operands(self) -> int:
        return 3 if self.kind == "nvfp4" else 1


def lead_axis(a):
    """`a[None]`, also for a layer of a stacked parameter (layer_stack.LayerSlice)."""
    return a.expand() if layer_stack.is_slice(a) else a[None]


def weight_operands(w, stacked: bool = False) -> tuple[WeightSpec, tuple]:
    """The kernel operands of a Linear (`[N, K]`, or `[E, N, K]` with stacked=True); see the module docstring.
    Arrays that are layers of stacked parameters stay LayerSlices (pass the operands through
    `layer_stack.kernel_args`)."""
    if isinstance(w, NVFP4Weight):
        codes, scales, gs = w.codes, w.scales, w.global_scale
        if not layer_stack.is_slice(gs):
            gs = jnp.asarray(gs, F32)
        elif gs.dtype != F32:
            raise ValueError(f"NVFP4 global scale must be float32, got {gs.dtype}")
        if not stacked:
            codes, scales, gs = lead_axis(codes), lead_axis(scales), gs.reshape(1)
        e, n, half = codes.shape
        k = 2 * half
        if k % (2 * GROUP):
            raise ValueError(f"NVFP4 weight: K={k} must be a multiple of {2 * GROUP}")
        codes = codes.reshape(e, n, half // GROUP, GROUP)
        return WeightSpec("nvfp4", e, n, k), (codes, scales, gs.reshape(e))
    if not layer_stack.is_slice(w):
        w = jnp.asarray(w)
    if w.dtype != BF16:
        raise ValueError(f"linear weights are BF16 or NVFP4, got {w.dtype}")
    if not stacked:
        w = lead_axis(w)
    e, n, k = w.shape
    return WeightSpec("bf16", e, n, k), (w,)


def x_shape(m: int, k: int, kind: str) -> tuple[int, ...]:
    """The layout activations [M, K] stream against a weight kind in: [M, K/16, 16] for NVFP4, else [M, K]."""
    return (m, k // GROUP, GROUP) if kind == "nvfp4" else (m, k)


def x_kind(kind: str, dot: bool) -> str:
    """The layout x streams in: [M, K] ("bf16") on the tensor-core path (stream_rows_dot) whatever the weight's kind,
    else the weight kind's (`x_shape`)."""
    return "bf16" if dot else kind


def x_operand(x: jax.Array, kind: str) -> jax.Array:
    """Activations [M, K] in the layout of `x_shape` (a free reshape)."""
    return x.reshape(x_shape(*x.shape, kind))


def pad_rows(a: jax.Array, mp: int) -> jax.Array:
    """[M, ...] -> [mp, ...] with zero rows (kernels take 1, 2, 4 or 8 rows: `pow2_rows`)."""
    return a if a.shape[0] == mp else jnp.pad(a, ((0, mp - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def pow2_rows(m: int) -> int:
    """Triton tensors have power-of-two shapes: M rows are padded to 1, 2, 4 or 8."""
    p = 1
    while p < m:
        p *= 2
    return p


def largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def k_tile(spec: WeightSpec, bk: int) -> int:
    """The K tile in values: a power of two dividing K (NVFP4: dividing K/2 per half, in whole groups)."""
    if spec.kind == "nvfp4":
        g = largest_pow2_divisor(spec.k // 2 // GROUP, max(1, bk // 2 // GROUP))
        return 2 * GROUP * g
    return largest_pow2_divisor(spec.k, bk)


# ---- kernel side ----------------------------------------------------------------------------------------------------
NORM_TILE = 4096  # values per step of the RMSNorm prologue
# Kernels with a fused RMSNorm prologue on the FMA path issue their first K step's weight loads before computing the
# rows' inv_rms (stream_rows with a deferred `inv`): the norm's reduction has barriers, which no load crosses, so
# otherwise the weights' first HBM round trip waits for the norm. A knob so the whole step can time both
# (scripts/profile_decode.py variant `norm_before_loads`).
NORM_AFTER_LOADS = True
# Kernels load their epilogue's operands (NVFP4 global scales, the residual rows) before the K loop rather than after
# it, where each would add a dependent memory round trip to the end of the chain. A knob so the whole step can time
# both (scripts/profile_decode.py variant `late_epilogue_loads`).
EARLY_EPILOGUE_LOADS = True


def epilogue_loads(load):
    """A kernel's epilogue operands: `load()` issued here, before the K loop, under EARLY_EPILOGUE_LOADS, else where
    the returned function is called (after the loop). Call the result where the values are needed."""
    if EARLY_EPILOGUE_LOADS:
        values = load()
        return lambda: values
    return load


def k_start(t, bk: int):
    """Start of K tile t; t is a Python int when a one-step loop is unrolled."""
    return t * bk if isinstance(t, int) else pl.multiple_of(t * bk, bk)


def k_loop(steps: int, body, init):
    """fori_loop, or straight-line code for one step (lets every load of the step be in flight at once)."""
    return body(0, init) if steps == 1 else jax.lax.fori_loop(0, steps, body, init)


@dataclasses.dataclass(frozen=True)
class XSource:
    """How the kernel reads the activations of one row: from `ref` (layout of `x_operand`), optionally RMS-normed
    with `norm_ref` (same layout) on the fly: `nw * bf16(x * inv_rms)` rounded to BF16, FLINT_SPEC's rmsnorm."""
    ref: object
    kind: str
    norm_ref: object = None
    eps: float = 1e-5

    def norm_tile(self, k: int) -> int:
        """K tile of the norm prologue: as large as allowed (few serial steps; the row is a few KB in L2)."""
        return k_tile(WeightSpec(self.kind, 1, 1, k), NORM_TILE)

    def inv_rms(self, row, k: int, bk: int | None = None) -> jax.Array:
        """rsqrt(mean(x^2) + eps) of one row, FP32, by a loop over K tiles."""
        bk = bk or self.norm_tile(k)

        def body(t, ss):
            xt = self._raw(row, t, bk, 0).astype(F32)
            ss = ss + jnp.sum(xt * xt)
            if self.kind == "nvfp4":
                xh = self._raw(row, t, bk, 1).astype(F32)
                ss = ss + jnp.sum(xh * xh)
            return ss
        ss = k_loop(k // bk, body, jnp.zeros((), F32))
        return jax.lax.rsqrt(ss / k + self.eps)

    def inv_rms_block(self, k: int, bk: int | None = None) -> jax.Array:
        """inv_rms of every row of `ref` at once: f32 [R] (the tensor-core path's [R, ...] tiles)."""
        bk = bk or k_tile(WeightSpec(self.kind, 1, 1, k), NORM_TILE // self.ref.shape[0])
        def sq(a):
            a = a.astype(F32)
            a = a * a
            while a.ndim > 1:
                a = jnp.sum(a, axis=-1)
            return a

        def body(t, ss):
            ss = ss + sq(self._raw(slice(None), t, bk, 0))
            if self.kind == "nvfp4":
                ss = ss + sq(self._raw(slice(None), t, bk, 1))
            return ss
        ss = k_loop(k // bk, body, jnp.zeros((self.ref.shape[0],), F32))
        return jax.lax.rsqrt(ss / k + self.eps)

    def _slice(self, ref, row, t, bk, half):
        """Tile t of `ref` ([M, ...] with a row, or the [...] norm weight when row is None)."""
        lead = () if row is None else (row,)
        if self.kind == "nvfp4":
            g = bk // 2 // GROUP
            g0 = t * g + half * (ref.shape[-2] // 2)
            return ref[(*lead, pl.ds(g0, g), slice(None))]
        return ref[(*lead, pl.ds(k_start(t, bk), bk))]

    def _raw(self, row, t, bk, half):
        return self._slice(self.ref, row, t, bk, half)

    def load(self, row, t, bk, half):
        """The raw tile t (and its norm-weight tile): issue the loads, no arithmetic (see stream_rows' prefetch)."""
        nw = None if self.norm_ref is None else self._slice(self.norm_ref, None, t, bk, half)
        return self._raw(row, t, bk, half), nw

    def finish(self, raw, row, inv) -> jax.Array:
        """f32 activations from a loaded tile: cast, or RMS-normalise with the row's inv_rms."""
        xt, nw = raw
        if nw is None:
            return xt.astype(F32)
        if isinstance(row, slice):  # all rows: inv is [R], broadcast over the tile's other axes
            inv = inv.reshape(inv.shape + (1,) * (xt.ndim - 1))
            nw = nw[None]
        normed = (xt.astype(F32) * inv).astype(BF16).astype(F32)
        return (nw.astype(F32) * normed).astype(BF16).astype(F32)

    def tile(self, row, t, bk, half, inv) -> jax.Array:
        """The f32 activations of tile t (NVFP4: half 0 = low nibbles' values, 1 = high)."""
        return self.finish(self.load(row, t, bk, half), row, inv)


class RowNorms:
    """The inv_rms of rows 0..rows-1 of `xs`, computed on the first call (stream_rows calls it after issuing its first
    loads) and kept for later use in the same region of the kernel (`.value`)."""

    def __init__(self, xs: XSource, rows: int, k: int):
        self.xs, self.rows, self.k, self.value = xs, rows, k, None

    def __call__(self) -> list:
        if self.value is None:
            self.value = [self.xs.inv_rms(r, self.k) for r in range(self.rows)]
        return self.value


def row_norms(xs: XSource, rows: int, k: int):
    """The rows' inv_rms for stream_rows: deferred (RowNorms) under NORM_AFTER_LOADS, else computed here."""
    norms = RowNorms(xs, rows, k)
    return norms if NORM_AFTER_LOADS else norms()


def stream_rows(xs: Sequence[XSource], rows: Sequence, weights: Sequence[tuple[WeightSpec, Sequence]],
                experts: Sequence, n0, bn: int, bk: int, inv: Sequence | None = None,
                pairs: Sequence[tuple[int, int]] | None = None, elementwise: bool = False,
                prefetch: bool = False) -> list[jax.Array]:
    """FP32 accumulators `x_r @ W_w[e_w, n0:n0+bn, :].T` (without the global scale), one per (w, r) in `pairs`
    (default: every weight with every row, weight-major).

    xs[r] / rows[r]: where row r's activations come from; weights[w] = (spec, refs), experts[w] the expert index
    (a traced scalar: expert ids are data). One loop over K streams every weight once and reuses each decoded tile
    for all rows that pair with it. A single-step loop is emitted as straight-line code so that the loads of all
    weights can be in flight together.
    `elementwise`: keep a full-tile accumulator and reduce once after the loop (no cross-lane reduction, with its
    shared-memory round trip and barrier, inside the loop; more registers; for M <= 2).
    `prefetch`: load step t+1's tiles before computing step t (a register double buffer carried by the loop):
    Triton's num_stages pipelining only applies to loads that feed a dot, so without this every step waits for its
    own loads. `inv` may be a function returning the rows' inv_rms: it is called after the first K step's loads are
    issued, so the weights' HBM latency overlaps the norm prologue's reduction (NORM_AFTER_LOADS). Returns f32 [bn]
    per pair."""
    spec0 = weights[0][0]
    for spec, _ in weights:
        if (spec.kind, spec.k) != (spec0.kind, spec0.k):
            raise NotImplementedError("one kernel streams weights of one kind and one K")
    k = spec0.k
    steps = k // bk
    nr = len(rows)
    if pairs is None:
        pairs = [(w, r) for w in range(len(weights)) for r in range(nr)]
    used_rows = sorted({r for _, r in pairs})
    used_weights = sorted({w for w, _ in pairs})
    inv_later = inv if callable(inv) else None
    inv = list(inv) if inv is not None and inv_later is None else [None] * nr
    nvfp4_kind = spec0.kind == "nvfp4"
    g = bk // 2 // GROUP
    half_groups = k // 2 // GROUP
    halves = (0, 1) if nvfp4_kind else (0,)
    if nvfp4_kind:
        shape = (bn, g, GROUP) if elementwise else (bn, g)
    else:
        shape = (bn, bk) if elementwise else (bn,)
    init = tuple(jnp.zeros(shape, F32) for _ in pairs)

    def load(t):
        xr = tuple(tuple(xs[r].load(rows[r], t, bk, h) for h in halves) for r in used_rows)
        wr = []
        for wi in used_weights:
            (_, refs), e = weights[wi], experts[wi]
            if nvfp4_kind:
                codes, scales, _ = refs
                g0 = t * g
                wr.append((codes[e, pl.ds(n0, bn), pl.ds(g0, g), :], scales[e, pl.ds(n0, bn), pl.ds(g0, g)],
                           scales[e, pl.ds(n0, bn), pl.ds(half_groups + g0, g)]))
            else:
                wr.append((refs[0][e, pl.ds(n0, bn), pl.ds(k_start(t, bk), bk)],))
        return xr, tuple(wr)

    def compute(raw, accs):
        xr, wr = raw
        accs = list(accs)
        x = {r: [xs[r].finish(xr[i][h], rows[r], inv[r]) for h in halves] for i, r in enumerate(used_rows)}
        for wj, wi in enumerate(used_weights):
            mine = [(i, r) for i, (w, r) in enumerate(pairs) if w == wi]
            if nvfp4_kind:
                cb, sl, sh = wr[wj]
                s_lo, s_hi = decode_scales(sl), decode_scales(sh)
                w_lo, w_hi = decode_codes(cb)  # [bn, g, 16] each
                if elementwise:
                    w_lo = w_lo * s_lo[:, :, None]
                    w_hi = w_hi * s_hi[:, :, None]
                for i, r in mine:
                    xl, xh = x[r]
                    if elementwise:
                        accs[i] = accs[i] + w_lo * xl[None] + w_hi * xh[None]
                    else:
                        accs[i] = accs[i] + (jnp.sum(w_lo * xl[None], axis=2) * s_lo
                                             + jnp.sum(w_hi * xh[None], axis=2) * s_hi)
            else:
                wtile = wr[wj][0].astype(F32)  # [bn, bk]
                for i, r in mine:
                    prod = wtile * x[r][0][None]
                    accs[i] = accs[i] + (prod if elementwise else jnp.sum(prod, axis=1))
        return tuple(accs)

    def prefetch_loop(start, accs):
        """Steps start..steps-1, each loading the next step's tiles before computing its own."""
        def body(t, carry):
            accs, cur = carry
            nxt = load(jnp.minimum(t + 1, steps - 1))  # the last step reloads its own tiles: harmless, in bounds
            return compute(cur, accs), nxt
        return jax.lax.fori_loop(start, steps, body, (accs, load(start)))[0]

    if inv_later is not None:  # the first step's loads go out before the norm's reduction (and its barriers)
        first = load(0)
        inv = list(inv_later())  # RowNorms keeps them for the caller
        accs = compute(first, init)
        if prefetch and steps > 1:
            accs = prefetch_loop(1, accs)
        elif steps == 2:
            accs = compute(load(1), accs)
        elif steps > 2:
            accs = jax.lax.fori_loop(1, steps, lambda t, a: compute(load(t), a), accs)
    elif prefetch and steps > 1:
        accs = prefetch_loop(0, init)
    else:
        accs = k_loop(steps, lambda t, a: compute(load(t), a), init)
    out = []
    for a in accs:
        while a.ndim > 1:
            a = jnp.sum(a, axis=-1)
        out.append(a)
    return out


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [R, K] @ b [N, K].T with an FP32 accumulator (tensor cores under the Triton lowering)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


# ---- packed NVFP4 decode to BF16 (tensor-core paths: grouped_matmul, stream_rows_dot) ----------------------------
# The "int" decode as runs Z-AH timed it spent ~10 integer and conversion instructions per weight value on the CUDA
# cores, as many cycles as the tensor cores spend on the value's 256 products (run Z: the NVFP4 grouped GEMMs take
# 73 ms of an 8K prefill against 42 ms for BF16 weights). (It now shares nvfp4.decode_codes, which builds both
# nibbles of a byte in one word: the same values, not timed since.) The packed decode works on 32-bit registers
# holding two BF16 lanes: per 4 code bytes (8 values) two byte permutes spread the bytes over 16-bit lanes; per lane
# pair, shifts and masks place a nibble's magnitude bits (e e m) in the BF16 exponent/mantissa bits 8..6 and its
# sign in bit 15, which is exactly E2M1(c) * 2^-126 (the code 0.5 is a BF16 subnormal, still exact); one BF16x2 FMA
# multiplies by the scale E4M3 * 2^118 (exact in BF16: 4 significant bits, at most 2^126.8). The product is w * 2^-8,
# exact in BF16 (at most 6 significant bits, between 2^-18 and 2^3.4 in magnitude), so the tensor cores see the
# reference's BF16 weights times 2^-8, and the epilogue multiplies the FP32 accumulator by global_scale * 2^8: the
# same FP32 products and sums as the "int" decode, up to an exact power of two. About 3.3 instructions per value
# instead of ~10.
PACKED_EXP = 8  # the packed decode yields w * 2^-PACKED_EXP


def _packed_ptx(high: bool) -> str:
    """PTX for one nibble of 4 code bytes (pack=4, as Triton packs the operands): $0, $1 the 4 BF16 results (two
    lanes per register), $2 the 4 code bytes (byte i = element i), $3, $4 their 4 BF16 scales. prmt 0x4140 puts
    byte 0 in lane 0 and byte 1 in lane 1 (zero-extended), 0x4342 bytes 2 and 3. Low nibble: bits 2..0 -> 8..6
    (<< 6) and bit 3 -> 15 (<< 12); high nibble: bits 6..4 -> 8..6 (<< 2) and bit 7 -> 15 (<< 8); the masks drop
    what a shift carries into the other lane. (One asm per nibble: jax's lowering of elementwise_inline_asm returns
    one result.)"""
    mag, sign = (2, 8) if high else (6, 12)
    lanes = ""
    for out, sel, scale in (("$0", "0x4140", "$3"), ("$1", "0x4342", "$4")):
        lanes += (f"prmt.b32 t, $2, z, {sel};\n"
                  f"shl.b32 a, t, {mag}; and.b32 a, a, 0x01C001C0; shl.b32 b, t, {sign}; and.b32 b, b, 0x80008000;\n"
                  f"or.b32 a, a, b; fma.rn.bf16x2 {out}, a, {scale}, n;\n")
    return "{\n.reg .b32 t, a, b, z, n;\nmov.b32 z, 0;\nmov.b32 n, 0x80008000;\n" + lanes + "}"


def packed_scale(scale_bytes: jax.Array, bk: int) -> jax.Array:
    """E4M3 scale bytes [bn, bk/16] -> BF16 E4M3 * 2^118 broadcast over each group's 16 values -> [bn, bk]."""
    s = (decode_scales(scale_bytes) * (2.0 ** 104)).astype(BF16)  # E4M3 * 2^14 * 2^104, exact
    bn = s.shape[0]
    return jnp.broadcast_to(s[:, :, None], (bn, bk // GROUP, GROUP)).reshape(bn, bk)


def decode_packed(codes: jax.Array, s_lo: jax.Array, s_hi: jax.Array, *, ptx: bool):
    """codes uint8 [bn, bk], scales [bn, bk] from packed_scale -> (low, high nibbles' weights) * 2^-PACKED_EXP,
    BF16 [bn, bk] each. ptx=False computes the same values with array ops (interpret mode, where inline PTX cannot
    run): E2M1(c) * (scale * 2^-126), exact in FP32 and in BF16."""
    if ptx:
        out = jax.ShapeDtypeStruct(codes.shape, BF16)
        return tuple(plt.elementwise_inline_asm(_packed_ptx(high), args=[codes, s], constraints="=r,=r,r,r,r",
                                                pack=4, result_shape_dtypes=[out])[0]
                     for high, s in ((False, s_lo), (True, s_hi)))
    lo, hi = decode_codes(codes)  # E2M1 * 2^-14, FP32
    return ((lo * (s_lo.astype(F32) * 2.0 ** -112)).astype(BF16),
            (hi * (s_hi.astype(F32) * 2.0 ** -112)).astype(BF16))


def repeat_rows(x: jax.Array, cols: int) -> jax.Array:
    """x [R, K] -> [cols, K]: x's rows repeated cols / R times (a dot's right operand filled to the MMA's smallest
    N from R < 8 rows without an XLA pad: the repeats' columns are computed and dropped, `first_columns`)."""
    r = x.shape[0]
    if cols == r:
        return x
    return jnp.broadcast_to(x[None], (cols // r, *x.shape)).reshape(cols, *x.shape[1:])


def first_columns(acc: jax.Array, r: int) -> jax.Array:
    """acc [bn, cols] of repeat_rows' operand -> [bn, r]: the first copy's columns (the copies are the same bits)."""
    bn, cols = acc.shape
    if cols == r:
        return acc
    copies = acc.reshape(bn, cols // r, r)
    first = jax.lax.broadcasted_iota(jnp.int32, copies.shape, 1) == 0
    return jnp.sum(jnp.where(first, copies, 0.0), axis=1)


def stream_rows_dot(xs: XSource, weights: Sequence[tuple[WeightSpec, Sequence]], n0, bn: int, bk: int,
                    inv: jax.Array | None = None, ptx: bool = False, cols: int | None = None) -> list[jax.Array]:
    """Tensor-core variant of stream_rows for a block of rows: `W_w[0, n0:n0+bn, :] @ x[R, :].T` as f32 [bn, cols]
    per weight (the weight tile is the dot's left operand, which the tensor cores read from registers), R = the rows
    of xs.ref; the MMA needs at least 8 columns, so either the caller pads x to 8 rows (gemv.dot_rows) or passes
    `cols` (below). xs reads x as [R, K] (kind "bf16", whatever the weight's kind). NVFP4 codes come as [E, N, K/2] (`dot_operands`); each K step of bk values (bk/2 code bytes)
    is decoded to BF16 by the packed decode above (exact: E2M1 x E4M3 x 2^-8, at most 6 significant bits;
    inline PTX when `ptx`), and the caller multiplies the accumulator by global_scale * 2^PACKED_EXP
    (`dot_scale`). So the FMA pipe only decodes. Needs bn >= 16 and bk >= 32. cols (default R; a multiple of R,
    at least 8): the MMA's N, x's rows repeated to fill it (`repeat_rows`); the first R columns of the result are
    the rows' (`first_columns`)."""
    spec0 = weights[0][0]
    k = spec0.k
    rows = xs.ref.shape[0]
    cols = cols or rows
    if cols % rows:
        raise ValueError(f"stream_rows_dot: {cols} columns are not whole copies of {rows} rows")
    init = tuple(jnp.zeros((bn, cols), F32) for _ in weights)
    if spec0.kind == "nvfp4":
        bh = bk // 2  # code bytes (values per half) per step
        steps = k // bk

        def body(t, accs):
            c0 = k_start(t, bh)
            g0 = t * (bh // GROUP)
            xl = repeat_rows(xs.tile(slice(None), t, bh, 0, inv).astype(BF16), cols)
            xh = repeat_rows(xs.tile(slice(None), t + steps, bh, 0, inv).astype(BF16), cols)  # values K/2 + c0 ...
            out = []
            for (_, (codes, scales, _)), acc in zip(weights, accs):
                cb = codes[0, pl.ds(n0, bn), pl.ds(c0, bh)]
                s_lo = packed_scale(scales[0, pl.ds(n0, bn), pl.ds(g0, bh // GROUP)], bh)
                s_hi = packed_scale(scales[0, pl.ds(n0, bn), pl.ds(k // 2 // GROUP + g0, bh // GROUP)], bh)
                w_lo, w_hi = decode_packed(cb, s_lo, s_hi, ptx=ptx)
                out.append(acc + _dot_nt(w_lo, xl) + _dot_nt(w_hi, xh))
            return tuple(out)
    else:
        steps = k // bk

        def body(t, accs):
            xt = repeat_rows(xs.tile(slice(None), t, bk, 0, inv).astype(BF16), cols)
            k0 = k_start(t, bk)
            return tuple(acc + _dot_nt(w[0, pl.ds(n0, bn), pl.ds(k0, bk)], xt)
                         for (_, (w,)), acc in zip(weights, accs))
    return list(k_loop(steps, body, init))


def dot_operands(spec: WeightSpec, ops: Sequence) -> tuple:
    """A weight's operands for stream_rows_dot: NVFP4 codes as [E, N, K/2] (a free reshape)."""
    if spec.kind != "nvfp4":
        return tuple(ops)
    codes, scales, gs = ops
    return (codes.reshape(spec.experts, spec.n, spec.k // 2), scales, gs)


def dot_scale(spec: WeightSpec, refs: Sequence, e) -> jax.Array | None:
    """What stream_rows_dot's accumulator is multiplied by: NVFP4 global scale x 2^PACKED_EXP (the packed decode's
    weights are w x 2^-8); None for BF16."""
    if spec.kind != "nvfp4":
        return None
    return refs[2][e] * 2.0 ** PACKED_EXP


def global_scale(spec: WeightSpec, refs: Sequence, e) -> jax.Array | float:
    """The weight's FP32 global scale for expert e (1.0 for BF16 weights)."""
    if spec.kind == "nvfp4":
        return refs[2][e]
    return None


def apply_global_scale(acc: jax.Array, gs) -> jax.Array:
    return acc if gs is None else acc * gs

