"""Grouped-expert GEMM for many tokens (prefill): rows sorted by expert against stacked expert weights.

    grouped_matmul(x, w, group_sizes)          y[r] = bf16(f32acc(x[r] @ W[e(r)].T) * gs[e(r)])      [R, N]
    grouped_swiglu(x, gate, up, group_sizes)   layers.swiglu of the two grouped linears, fused         [R, I]

x [R, K] bf16 holds the (token, expert) pairs sorted by expert: the first group_sizes[0] rows go to expert 0, the
next group_sizes[1] to expert 1, and so on (layers.routed_experts_grouped builds exactly this). w is a stacked
Linear [E, N, K]: BF16, or NVFP4 (flint_jax.nvfp4 kernel layout) dequantized in registers. Rows past
sum(group_sizes) are not computed and read as unspecified.

Schedule ("visits"). Each expert's rows are cut into tiles of BM rows that start at the expert's first row, so only
the last tile of a group is partial (on average BM/2 idle rows per expert, where tiles aligned to multiples of BM
would compute every tile that straddles a boundary twice). `group_layout` lists the visits (at most R/BM + E) as
(expert, tile start, first row, end row); program (j, v) computes rows [tile, tile + BM) x columns [j*BN, j*BN+BN)
with expert e_v's weights and stores only rows [first, end) (a masked store: rows of the tile past the group
belong to the next expert's visits). A tile that would run past the last row starts earlier instead (rows
[R - BM, R)); it still stores only its own rows. Visits past the real count do nothing. Only the selected experts'
work is done: an empty expert has no visit, and all tokens on one expert is R/BM visits of that expert.

Tail tiles (`tails`, the table's TAIL_BLOCKS): a visit costs its weight tiles' loads (and NVFP4 decode) and BM rows of
tensor-core work however few of its rows are real, so an expert with a few rows past a multiple of BM pays a whole
tile for them. With tail blocks of BM' < BM rows, each expert's last, partial tile goes to the smallest tail tile that
holds it (`tiered_layouts`), one launch per tile size; the later launches write their rows into the first one's
output (aliased). Each row's sum runs over the same K tiles whatever its tile, so the result is the same bit for bit.

NVFP4 decode (integer ops only; the Triton lowering has no fp4/fp8 conversions we rely on): nvfp4.decode_codes and
decode_scales turn code and scale bytes into f32 values whose product is the weight value, exact in BF16 (at most 6
significant bits), so the tensor-core dot sees the same BF16 weights as the reference. A K step of BK bytes of codes covers values
[c0, c0 + BK) (low nibbles) and [K/2 + c0, K/2 + c0 + BK) (high nibbles): two dots against two x slices.
That is `Block.decode = "int"`; the default "packed" decode (inline PTX on four code bytes at once, about a third
of the instructions; see weight_tiles.decode_packed) gives the same BF16 weights times 2^-8, undone in the epilogue. Interpret
mode cannot run PTX and computes the packed decode's values with array ops instead.

Numerics: FP32 accumulation in tiles of K; the reference sums the same exact products in another order, so a BF16
output can differ from `ref_grouped_matmul` by one ulp where the FP32 sum sits on a rounding boundary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax import layers as L
from flint_jax import layer_stack, nvfp4
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.pallas_kernels import weight_tiles as wt

F32, BF16 = jnp.float32, jnp.bfloat16
GROUP = nvfp4.BLOCK  # values per E4M3 scale


@dataclasses.dataclass(frozen=True)
class Block:
    """Tile sizes: bm rows, bn output columns, bk K values per step (NVFP4: per half, i.e. bytes of codes).
    weights_lhs: compute the transposed tile W x^T, the decoded weight tile as the dot's left operand (which the
    tensor-core instruction can read from registers, where the right one goes through shared memory), then
    transpose the accumulator once for the store."""
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    weights_lhs: bool = False
    decode: str = "packed"  # NVFP4 only: "packed" (PTX on 4 code bytes at once, weight_tiles.decode_packed) or "int"


# Starting points for the H200 (Hopper wgmma through Triton; scripts/bench_prefill.py sweeps alternatives). 128-row
# tiles halve the operand traffic per FLOP against 64-row ones (the tiles are fed from L2) and amortise NVFP4's
# decode; with Flint's 8K-token prefill an expert gets ~190 rows, so a partial last tile costs ~25% extra work.
# All four compiled for sm_90 with Triton 3.6 without register spills at 128 rows (128 x 128 x 2 FP32 accumulators
# for SwiGLU use all 255 registers; NVFP4 SwiGLU uses BN = 64 to stay there).
# The down projection with the decoded weight tile as the dot's left operand, 64 weight rows, 4 warps. For the SwiGLU
# pair the same swap was no faster (1.729 ms at 128 x 128, 3.28 at 128 x 64, against 1.706).
NVFP4_LINEAR_LHS = Block(128, 64, 64, 4, 3, weights_lhs=True)
BLOCKS = {
    ("bf16", "linear"): Block(128, 128, 64, 8, 3),
    ("bf16", "swiglu"): Block(128, 128, 64, 8, 3),
    # NVFP4_LINEAR_LHS: 1.235 -> 0.940 ms per layer at 8K tokens against (128, 128, 64), 8 warps (run L). With the
    # packed decode, inside the prefill program (rows scattered by index): 22.7 ms per 8K prefill against 25.2 with
    # the integer decode (runs AE, AD). (256, 64, 64) packed was faster alone (run AE's sweep: 0.687 against
    # 0.869 ms, without the scatter) but slower in the program: 31.5 ms (run AF).
    ("nvfp4", "linear"): NVFP4_LINEAR_LHS,
    # 256-row tiles: an expert's ~190 rows in one visit, so each weight tile is decoded once (the decode is integer
    # work on the CUDA cores) at the price of ~33% idle tensor-core rows: 1.577 -> 1.016 ms per layer at 8K tokens
    # (run X, docs/BENCHMARKS.md); the packed decode 1.031 against 1.082 ms for the integer one (run AE).
    ("nvfp4", "swiglu"): Block(256, 64, 64, 8, 3),
}


# With few rows per expert (short chunks: 2K tokens x top-6 / 256 experts ~ 48 rows) a 128-row tile is mostly
# padding; 64-row tiles then (also checked spill-free for sm_90).
# NVFP4 with the packed decode, as the 8K table: compiled on the H200 these blocks pass the kernel tests with
# either decode (run AH), and the tiny model's chunked prefill gave the same logits (to the last digit pytest
# printed) with the packed (run AF) and the integer decode (run AH).
BLOCKS_FEW_ROWS = {
    ("bf16", "linear"): Block(64, 128, 64, 4, 3),
    ("bf16", "swiglu"): Block(64, 128, 64, 8, 3),
    ("nvfp4", "linear"): Block(64, 128, 64, 4, 3),
    ("nvfp4", "swiglu"): Block(64, 128, 64, 8, 3),
}
FEW_ROWS = 128  # mean rows per expert below which BLOCKS_FEW_ROWS is used


# Blocks for each expert's last, partial tile (tiered_layouts), where the 8K table's tiles are large. An expert's
# visit costs its weight tiles' decode plus the tile's rows on the tensor cores whatever rows are real: at the
# synthetic Flint model's skewed routing (run AO: median layer 323 visits of 256 rows where uniform routing needs
# 256; 86 experts with 1-63 rows) the NVFP4 SwiGLU took 0.925 ms per layer against 0.756 at uniform routing.
# A 128- and a 64-row tile for the remainders (spill-free for sm_90 with rows gathered).
TAIL_BLOCKS = {("nvfp4", "swiglu"): (Block(128, 64, 64, 8, 3), Block(64, 64, 64, 4, 3))}


def default_tails(kind: str, mode: str, rows_per_expert: float | None = None) -> tuple[Block, ...]:
    """The tail blocks that go with default_block's choice (none with the few-rows table)."""
    if rows_per_expert is not None and rows_per_expert < FEW_ROWS:
        return ()
    return TAIL_BLOCKS.get((kind, mode), ())


def default_block(kind: str, mode: str, rows_per_expert: float | None = None) -> Block:
    """The table's block for a weight kind and mode ("linear" | "swiglu"), given the mean rows per expert."""
    if rows_per_expert is not None and rows_per_expert < FEW_ROWS:
        return BLOCKS_FEW_ROWS[(kind, mode)]
    return BLOCKS[(kind, mode)]


# ---- schedule -------------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The visit list of `group_sizes` over R rows in tiles of bm (see the module docstring). int32 [V] each."""
    expert: jax.Array
    row0: jax.Array  # first row of the visit's tile of bm rows (row0 + bm <= rows)
    lo: jax.Array  # first row of the tile that belongs to the visit's expert
    hi: jax.Array  # one past the last such row (lo == hi: an idle visit)


def max_visits(rows: int, experts: int, bm: int) -> int:
    return -(-rows // bm) + experts


def group_layout(group_sizes: jax.Array, rows: int, bm: int) -> GroupLayout:
    """Visits for rows [0, sum(group_sizes)) sorted by expert, in tiles of bm rows from each group's start.
    Needs rows >= bm (the wrappers pad)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    return _layout(ends - sizes, ends, (sizes + bm - 1) // bm, rows, bm, max_visits(rows, sizes.shape[0], bm))


def tiered_layouts(group_sizes: jax.Array, rows: int, bms: tuple[int, ...]) -> list[GroupLayout]:
    """Visits in tiles of several sizes bms[0] > bms[1] > ...: each expert's rows in tiles of bms[0] from its start,
    except its last, partial tile of r rows, which goes to the smallest tile size that holds it (bms[j] for
    bms[j+1] < r <= bms[j], j >= 1; with r > bms[1] it stays a bms[0] tile). One layout per size (the first as long
    as group_layout's, the others one visit slot per expert); every row is in exactly one visit of one of them.
    An expert whose rows end just past a tile boundary (routing that leaves some experts with few rows, or with a
    few rows past a multiple of bms[0]) then costs a small tile instead of a whole large one."""
    if any(b <= c for b, c in zip(bms, bms[1:])):
        raise ValueError(f"tile sizes must decrease, got {bms}")
    sizes = group_sizes.astype(jnp.int32)
    E = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    full = sizes // bms[0]
    rem = sizes - full * bms[0]
    smaller = jnp.asarray(bms[1:] + (0,), jnp.int32)
    # tier of the last tile: 0 where rem > bms[1]; else the j >= 1 with bms[j+1] < rem <= bms[j]; -1: no rows left
    tier = jnp.where(rem > 0, jnp.sum(rem[:, None] <= smaller[None, :-1], axis=1), -1)
    out = [_layout(starts, ends, full + (tier == 0), rows, bms[0], max_visits(rows, E, bms[0]))]
    for j in range(1, len(bms)):
        out.append(_layout(starts + full * bms[0], ends, (tier == j).astype(jnp.int32), rows, bms[j], E))
    return out


def _layout(starts: jax.Array, ends: jax.Array, count: jax.Array, rows: int, bm: int, V: int) -> GroupLayout:
    """count[e] tiles of bm rows for expert e from starts[e] (the last one ending at ends[e] or earlier), listed
    expert by expert in V visit slots (V >= sum(count)); slots past the last visit are idle."""
    E = count.shape[0]
    cum = jnp.cumsum(count)
    v = jnp.arange(V, dtype=jnp.int32)
    # compare_all, not the default binary search: that one is a `while` loop, which XLA on the GPU runs with a
    # device-to-host copy of the loop condition per iteration (94 loops per 8K prefill; without them the prefill
    # program launched 3,698 kernels instead of 5,439 and took 240.7 instead of 246.2 ms, runs W and X).
    # E x V comparisons are nothing next to the GEMMs.
    e = jnp.minimum(jnp.searchsorted(cum, v, side="right", method="compare_all"), E - 1).astype(jnp.int32)
    live = v < cum[-1]
    lo = starts[e] + (v - (cum[e] - count[e])) * bm
    hi = jnp.minimum(lo + bm, ends[e])
    row0 = jnp.minimum(lo, rows - bm)
    return GroupLayout(e, jnp.where(live, row0, 0).astype(jnp.int32), jnp.where(live, lo, 0).astype(jnp.int32),
                       jnp.where(live, hi, 0).astype(jnp.int32))


# ---- operands -------------------------------------------------------------------------------------------------
def _weight_operands(w) -> tuple[str, int, int, int, tuple[jax.Array, ...]]:
    """(kind, E, N, K, operands): bf16 -> (w,); NVFP4 -> (codes uint8, scale bytes uint8, global scale f32 [E])."""
    if isinstance(w, NVFP4Weight):
        E, N, half = w.codes.shape
        if half % GROUP:
            raise ValueError(f"NVFP4 expert weight: K={2 * half} must be a multiple of {2 * GROUP} (whole scale "
                             "groups in each half)")
        if layer_stack.is_slice(w.scales):
            # A layer of stacked parameters: a bitcast here would copy the whole stack; the kernel's scale decode
            # (nvfp4.decode_scales) bit-casts the E4M3 tiles it loads instead.
            scales, gs = w.scales, w.global_scale
            if gs.shape != (E,) or gs.dtype != F32:
                raise ValueError(f"stacked NVFP4 expert weight: global scale must be float32 [{E}], got "
                                 f"{gs.dtype} {gs.shape}")
        else:
            scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
            gs = jnp.broadcast_to(jnp.asarray(w.global_scale, F32), (E,))
        return "nvfp4", E, N, 2 * half, (w.codes, scales, gs)
    if not layer_stack.is_slice(w):
        w = jnp.asarray(w)
    if w.ndim != 3 or w.dtype != BF16:
        raise ValueError(f"stacked expert weights are BF16 [E, N, K] or NVFP4, got {w.dtype} {w.shape}")
    E, N, K = w.shape
    return "bf16", E, N, K, (w,)


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _fit(block: Block, kind: str, n: int, k: int) -> Block:
    """Shrink bn / bk to powers of two that divide N and the K extent a step walks (NVFP4: K/2 per half)."""
    bn = _pow2_divisor(n, block.bn)
    kext = k // 2 if kind == "nvfp4" else k
    bk = _pow2_divisor(kext, block.bk)
    if kind == "nvfp4":
        bk = max(bk, GROUP)
        if kext % bk:
            raise ValueError(f"NVFP4: K/2={kext} is not a multiple of {bk}")
    return dataclasses.replace(block, bn=bn, bk=bk)


# ---- kernel -----------------------------------------------------------------------------------------------------
def _dequant(codes: jax.Array, sb_lo: jax.Array, sb_hi: jax.Array) -> tuple[jax.Array, jax.Array]:
    """codes uint8 [bn, bk], scale bytes uint8 [bn, bk/16] of each half -> the BF16 weight values [bn, bk] of the
    low and the high nibbles (nvfp4.decode_codes / decode_scales: E2M1 * 2^-14 times E4M3 * 2^14, exact)."""
    lo, hi = nvfp4.decode_codes(codes)
    bn, bk = lo.shape

    def scaled(v, sb):
        return (v.reshape(bn, bk // GROUP, GROUP) * nvfp4.decode_scales(sb)[:, :, None]).reshape(bn, bk).astype(BF16)
    return scaled(lo, sb_lo), scaled(hi, sb_hi)


def _dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [m, k] @ w[n, k].T with an FP32 result."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _kernel(e_ref, r0_ref, lo_ref, hi_ref, x_ref, *refs, kind, n_w, mode, blk, k, gather, scatter, chained,
            interpret):
    o_ref = refs[-1]
    refs = refs[:-2] if chained else refs[:-1]  # chained: the previous tier's output, aliased to o_ref
    src_ref = dst_ref = None
    if scatter:
        dst_ref, refs = refs[-1], refs[:-1]
    if gather:
        src_ref, refs = refs[-1], refs[:-1]
    wrefs = refs
    per = len(wrefs) // n_w
    ws = [wrefs[i * per:(i + 1) * per] for i in range(n_w)]
    bm, bn, bk = blk.bm, blk.bn, blk.bk
    j, v = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[v], hi_ref[v]

    @pl.when(hi > lo)
    def _visit():
        e = e_ref[v]
        row0 = r0_ref[v]
        n0 = pl.multiple_of(j * bn, bn)
        rows = pl.ds(row0, bm)
        cols = pl.ds(n0, bn)
        x_rows = src_ref[rows] if gather else rows  # gather: the tile's rows of x by index, read in the K loop
        lhs = blk.weights_lhs
        init = tuple(jnp.zeros((bn, bm) if lhs else (bm, bn), F32) for _ in range(n_w))

        def prod(xt, wt_):  # the tile's product, in the accumulator's orientation
            return _dot_t(wt_, xt) if lhs else _dot_t(xt, wt_)

        packed = kind == "nvfp4" and blk.decode == "packed"
        if kind == "nvfp4":
            half = k // 2
            hg = half // GROUP

            def body(t, accs):
                c0 = pl.multiple_of(t * bk, bk)
                g0 = t * (bk // GROUP)
                x_lo = x_ref[x_rows, pl.ds(c0, bk)]
                x_hi = x_ref[x_rows, pl.ds(half + c0, bk)]
                out = []
                for (codes, scales, _), acc in zip(ws, accs):
                    cb = codes[e, cols, pl.ds(c0, bk)]
                    sb_lo = scales[e, cols, pl.ds(g0, bk // GROUP)]
                    sb_hi = scales[e, cols, pl.ds(hg + g0, bk // GROUP)]
                    if packed:
                        w_lo, w_hi = wt.decode_packed(cb, wt.packed_scale(sb_lo, bk), wt.packed_scale(sb_hi, bk),
                                                    ptx=not interpret)
                    else:
                        w_lo, w_hi = _dequant(cb, sb_lo, sb_hi)
                    out.append(acc + prod(x_lo, w_lo) + prod(x_hi, w_hi))
                return tuple(out)
            steps = half // bk
        else:
            def body(t, accs):
                k0 = pl.multiple_of(t * bk, bk)
                xt = x_ref[x_rows, pl.ds(k0, bk)]
                return tuple(acc + prod(xt, w[e, cols, pl.ds(k0, bk)]) for (w,), acc in zip(ws, accs))
            steps = k // bk

        accs = jax.lax.fori_loop(0, steps, body, init)
        ys = []
        for wop, acc in zip(ws, accs):
            if lhs:
                acc = acc.T
            if kind == "nvfp4":  # (packed: the weights were w * 2^-8, an exact power of two to undo)
                acc = acc * (wop[2][e] * 2.0 ** wt.PACKED_EXP if packed else wop[2][e])
            ys.append(acc.astype(BF16))
        out = ys[0] if mode == "linear" else L.swiglu(ys[0], ys[1])
        r = row0 + jnp.arange(bm, dtype=jnp.int32)
        keep = ((r >= lo) & (r < hi))[:, None]
        if scatter:  # array indices in both dimensions (interpret mode's store takes no array-slice mix)
            dst = o_ref.at[dst_ref[rows][:, None], n0 + jnp.arange(bn, dtype=jnp.int32)[None, :]]
        else:
            dst = o_ref.at[rows, cols]
        plt.store(dst, out.astype(o_ref.dtype), mask=keep)


def _index_operand(idx, name: str, R: int, Rp: int, limit: int, *, distinct_padding: bool) -> jax.Array:
    idx = jnp.asarray(idx)
    if idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got {idx.dtype} {idx.shape}")
    if idx.shape[0] != R:
        raise ValueError(f"{name} has {idx.shape[0]} entries, expected {R} (one per sorted row)")
    if limit <= 0:
        raise ValueError(f"{name}: the array it indexes has no rows")
    # Padding rows (only when R < bm) read row 0 (a gather), or with distinct_padding own rows past the output's
    # end (a scatter: every destination distinct, which interpret mode's masked store needs; the wrapper cuts them
    # off).
    pad = (limit + jnp.arange(Rp - R, dtype=jnp.int32) if distinct_padding
           else jnp.zeros((Rp - R,), jnp.int32))
    return jnp.concatenate([idx.astype(jnp.int32), pad])


def _call(x, ws, group_sizes, *, mode, layout=None, interpret=False, block=None, rows=None, out_rows=None,
          out_size=None, tails=None):
    if x.ndim != 2:
        raise ValueError(f"x must be [R, K], got {x.shape}")
    specs = [_weight_operands(w) for w in ws]
    kind, E, N, K, _ = specs[0]
    for s in specs:
        if s[:4] != specs[0][:4]:
            raise ValueError("fused expert weights must share kind and shape")
    if x.shape[1] != K:
        raise ValueError(f"x has K={x.shape[1]} but the expert weights are [{E}, {N}, {K}]")
    if group_sizes.shape != (E,):
        raise ValueError(f"group_sizes must be [{E}], got {group_sizes.shape}")
    R = x.shape[0] if rows is None else jnp.shape(rows)[0]  # sorted rows
    if tails is None:
        tails = default_tails(kind, mode, R / E) if block is None and layout is None else ()
    if tails and layout is not None:
        raise ValueError("tails and a precomputed layout do not mix (the layout is one tile size)")
    blk = _fit(block or default_block(kind, mode, R / E), kind, N, K)
    tail_blks = [_fit(t, kind, N, K) for t in tails]
    for b in [blk] + tail_blks:
        if b.decode not in ("packed", "int"):
            raise ValueError(f"Block.decode must be 'packed' or 'int', got {b.decode!r}")
    Rp = max(R, blk.bm)  # tiles never start before row 0 or end past the last row; only R < bm needs padding
    xp = x.astype(BF16)
    if rows is None and Rp != R:
        xp = jnp.pad(xp, ((0, Rp - R), (0, 0)))
    if out_rows is not None and out_size is None:
        raise ValueError("out_rows needs out_size (the output's row count)")
    if layout is not None:
        layouts = [layout]
    elif tail_blks:
        layouts = tiered_layouts(group_sizes, Rp, tuple(b.bm for b in [blk] + tail_blks))
    else:
        layouts = [group_layout(group_sizes, Rp, blk.bm)]
    shared = [xp]
    for s in specs:
        shared.extend(s[4])
    if rows is not None:
        shared.append(_index_operand(rows, "rows", R, Rp, x.shape[0], distinct_padding=False))
    if out_rows is not None:
        shared.append(_index_operand(out_rows, "out_rows", R, Rp, out_size, distinct_padding=True))
    out_len = Rp if out_rows is None else out_size + (Rp - R)
    out = None
    # One launch per tile size; each writes only its visits' rows, the later ones into the first one's output.
    for b, lay in zip([blk] + tail_blks, layouts):
        operands = [lay.expert, lay.row0, lay.lo, lay.hi, *shared] + ([out] if out is not None else [])
        operands, in_specs = layer_stack.kernel_args(operands)
        kernel = functools.partial(_kernel, kind=kind, n_w=len(ws), mode=mode, blk=b, k=K, gather=rows is not None,
                                   scatter=out_rows is not None, chained=out is not None, interpret=interpret)
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((out_len, N), BF16),
            grid=(N // b.bn, lay.expert.shape[0]),
            in_specs=in_specs,
            out_specs=pl.no_block_spec,
            input_output_aliases={len(operands) - 1: 0} if out is not None else {},
            compiler_params=plt.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
            interpret=interpret,
            name=f"grouped_{mode}_{kind}",
        )(*operands)
    keep = R if out_rows is None else out_size
    return out if out_len == keep else out[:keep]


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, interpret: bool = False,
                   block: Block | None = None, layout: GroupLayout | None = None, out_rows: jax.Array | None = None,
                   out_size: int | None = None, tails: tuple[Block, ...] | None = None) -> jax.Array:
    """`bf16(f32acc(x[r] @ W[e(r)].T) * gs[e(r)])` for rows x [R, K] sorted by expert (group_sizes [E] int32),
    w a stacked [E, N, K] BF16 or NVFP4 weight -> [R, N] BF16. `layout`: a precomputed `group_layout(group_sizes,
    max(R, block.bm), block.bm)` to share between calls.
    out_rows [R] int (with out_size): sorted row r's result is stored at output row out_rows[r] of an
    [out_size, N] result instead (a scatter in the kernel's store; rows no real row maps to are unspecified). The
    indices must lie in [0, out_size) (data, not checked).
    tails: smaller blocks for each expert's last, partial tile (`tiered_layouts`: one more launch per block, each
    writing only its rows); None: the table's (`default_tails`) when `block` and `layout` are None, else none."""
    return _call(x, [w], group_sizes, mode="linear", layout=layout, interpret=interpret, block=block,
                 out_rows=out_rows, out_size=out_size, tails=tails)


def grouped_swiglu(x: jax.Array, gate, up, group_sizes: jax.Array, *, interpret: bool = False,
                   block: Block | None = None, layout: GroupLayout | None = None,
                   rows: jax.Array | None = None, tails: tuple[Block, ...] | None = None) -> jax.Array:
    """`layers.swiglu(grouped_matmul(x, gate), grouped_matmul(x, up))` in one kernel: x is read once and both
    accumulators share the K loop. gate/up [E, I, K] -> [R, I] BF16.
    rows [R] int: sorted row r is x[rows[r]] (a gather in the kernel's loads, so x can be the tokens' activations
    [S, K] without a gathered copy per (token, expert) pair). The indices must lie in [0, S): they are data, not
    checked, and the compiled kernel would read outside x. tails: as grouped_matmul's."""
    return _call(x, [gate, up], group_sizes, mode="swiglu", layout=layout, interpret=interpret, block=block,
                 rows=rows, tails=tails)


# ---- references -------------------------------------------------------------------------------------------------
REF_TILE = 64  # rows per tile of the reference
REF_BATCH = 16  # tiles per step of its loop (bounds the gathered weights to REF_BATCH experts at a time)


def _ref_linear_tiles(xt: jax.Array, w, experts: jax.Array) -> jax.Array:
    """Tiles xt [n, bm, K] against their experts' weights [n, N, K] -> [n, bm, N] BF16 (layers.linear rounding)."""
    we = jax.tree.map(lambda a: a[experts], w)
    acc = jnp.einsum("tmk,tnk->tmn", xt.astype(BF16), L.weight_values(we), preferred_element_type=F32)
    if isinstance(w, NVFP4Weight):
        acc = acc * we.global_scale[:, None, None]
    return acc.astype(BF16)


def _ref_call(x, ws, group_sizes, mode):
    R, K = x.shape
    bm = REF_TILE
    Rp = max(R, bm)
    xp = jnp.pad(x.astype(BF16), ((0, Rp - R), (0, 0)))
    lay = group_layout(group_sizes, Rp, bm)

    def one(args):
        row0, e = args
        xt = xp[row0[:, None] + jnp.arange(bm)[None, :]]  # [REF_BATCH, bm, K]: rows, not weights, are gathered
        ys = [_ref_linear_tiles(xt, w, e) for w in ws]
        return ys[0] if mode == "linear" else L.swiglu(ys[0], ys[1])

    V = lay.expert.shape[0]
    pad = -V % REF_BATCH
    row0 = jnp.pad(lay.row0, (0, pad)).reshape(-1, REF_BATCH)
    ex = jnp.pad(lay.expert, (0, pad)).reshape(-1, REF_BATCH)
    N = _weight_operands(ws[0])[2]
    ys = jax.lax.map(one, (row0, ex)).reshape(-1, bm, N)[:V]
    r = lay.row0[:, None] + jnp.arange(bm)[None, :]
    keep = (r >= lay.lo[:, None]) & (r < lay.hi[:, None])
    # Each row belongs to exactly one visit: the sum adds zeros to it, which leaves it unchanged.
    out = jnp.zeros((Rp, N), F32).at[r.reshape(-1)].add(jnp.where(keep[..., None], ys.astype(F32), 0.0).reshape(-1, N))
    return out[:R].astype(BF16)


def ref_grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, interpret: bool = False,
                       block: Block | None = None, layout: GroupLayout | None = None,
                       out_rows: jax.Array | None = None, out_size: int | None = None) -> jax.Array:
    """Plain-JAX `grouped_matmul` with the same rounding: tiles of 64 rows, each against its expert's weights,
    REF_BATCH tiles per loop step, so it runs at 8K tokens on the GPU without copying weights per token. Rows past
    sum(group_sizes) are zero."""
    del interpret, block, layout
    y = _ref_call(x, [w], group_sizes, "linear")
    if out_rows is None:
        return y
    return jnp.zeros((out_size, y.shape[1]), y.dtype).at[out_rows].set(y)


def ref_grouped_swiglu(x: jax.Array, gate, up, group_sizes: jax.Array, *, interpret: bool = False,
                       block: Block | None = None, layout: GroupLayout | None = None,
                       rows: jax.Array | None = None) -> jax.Array:
    del interpret, block, layout
    return _ref_call(x if rows is None else x[rows], [gate, up], group_sizes, "swiglu")
