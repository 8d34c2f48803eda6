"""Grouped-expert GEMM (pallas_kernels/grouped_matmul.py) against its references, in interpret mode on the CPU.

Set FLINT_PALLAS_COMPILED=1 to run the same cases compiled on a GPU.

Tolerance, and why: every product x * w is exact in FP32 (BF16 x BF16; an NVFP4 value has at most 6 significant
bits and dequantizes exactly to BF16), so kernel and reference differ only in the order of the FP32 sum over K
(tiles of bk, and NVFP4's two halves). After the BF16 rounding of the output that can flip an output lying within
a few FP32 ulps of a BF16 rounding boundary: at most 1 BF16 ulp on a small fraction of outputs (none in the CPU
runs, where both sides sum in the same order).
"""


import dataclasses

import flint_jax  # noqa: F401  (XLA_FLAGS first)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flint_jax import layers as L
from flint_jax import nvfp4
from flint_jax.pallas_kernels import grouped_matmul as gm
from numerics import assert_bf16_close
from kernel_mode import INTERPRET

BF16, F32 = jnp.bfloat16, jnp.float32
E, N, K = 8, 64, 128
BLOCK = gm.Block(bm=16, bn=32, bk=32, num_warps=4, num_stages=1)  # several tiles, visits and K steps
BLOCK_LHS = gm.Block(bm=16, bn=32, bk=32, num_warps=4, num_stages=1, weights_lhs=True)  # W x^T, transposed back
BLOCK_INT = gm.Block(bm=16, bn=32, bk=32, num_warps=4, num_stages=1, decode="int")  # NVFP4: the integer decode


def weights(kind, n=N, k=K, seed=0):
    key = jax.random.key(seed)
    if kind == "bf16":
        return (jax.random.normal(key, (E, n, k), F32) / np.sqrt(k)).astype(BF16)
    w = nvfp4.random(key, (E, n, k), 1 / np.sqrt(k))
    # Global scales other than 1 (powers of two and not), one per expert.
    return nvfp4.NVFP4Weight(w.codes, w.scales, jnp.linspace(0.25, 3.0, E).astype(F32))


GROUPS = {
    "uneven_with_empty": [5, 0, 17, 1, 0, 40, 3, 9],
    "all_on_one_expert": [0, 0, 0, 75, 0, 0, 0, 0],
    "last_expert_only": [0, 0, 0, 0, 0, 0, 0, 33],
    "one_row_each": [1] * 8,
    "tile_aligned": [16, 32, 0, 16, 0, 0, 0, 16],
}


def inputs(sizes, extra_rows=3):
    sizes = jnp.asarray(sizes, jnp.int32)
    R = int(sizes.sum()) + extra_rows  # rows past sum(group_sizes) are ignored
    x = jax.random.normal(jax.random.key(7), (R, K), F32).astype(BF16)
    return x, sizes, int(sizes.sum())


@pytest.mark.parametrize("block", [BLOCK, BLOCK_LHS, BLOCK_INT], ids=["x_lhs", "weights_lhs", "int_decode"])
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("groups", list(GROUPS))
def test_grouped_matmul_matches_reference(kind, groups, block):
    x, sizes, n = inputs(GROUPS[groups])
    w = weights(kind)
    out = gm.grouped_matmul(x, w, sizes, interpret=INTERPRET, block=block)
    ref = gm.ref_grouped_matmul(x, w, sizes)
    assert out.shape == (x.shape[0], N)
    assert_bf16_close(out[:n], ref[:n])
    # The reference is layers' ragged_dot formulation, on other tiles.
    expert_of_row = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=n)
    assert_same_formulation(ref[:n], L._grouped_linear(x[:n], w, sizes, expert_of_row))


@pytest.mark.parametrize("block", [BLOCK, BLOCK_LHS, BLOCK_INT], ids=["x_lhs", "weights_lhs", "int_decode"])
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("groups", ["uneven_with_empty", "all_on_one_expert"])
def test_grouped_swiglu_matches_reference(kind, groups, block):
    x, sizes, n = inputs(GROUPS[groups])
    gate, up = weights(kind, seed=1), weights(kind, seed=2)
    out = gm.grouped_swiglu(x, gate, up, sizes, interpret=INTERPRET, block=block)
    ref = gm.ref_grouped_swiglu(x, gate, up, sizes)
    assert_bf16_close(out[:n], ref[:n], max_ulp=2)  # a flipped gate or up bit moves the product by up to 2 ulps
    expert_of_row = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=n)
    want = L.swiglu(L._grouped_linear(x[:n], gate, sizes, expert_of_row),
                    L._grouped_linear(x[:n], up, sizes, expert_of_row))
    assert_same_formulation(ref[:n], want, max_ulp=2)


def assert_same_formulation(ref, ragged_dot_form, max_ulp=1):
    """The tiled reference against layers' ragged_dot formulation: bit for bit on the CPU, where XLA sums both in the
    same order; on the GPU XLA's GEMMs sum in their own order (the compiled run of 2026-11-29 found 1 of 4,800
    outputs one BF16 ulp apart), so there within the kernels' tolerance."""
    if INTERPRET:
        np.testing.assert_array_equal(np.asarray(ref, F32), np.asarray(ragged_dot_form, F32))
    else:
        assert_bf16_close(ref, ragged_dot_form, max_ulp=max_ulp)


@pytest.mark.parametrize("scale", [1, 24])  # ~9 rows per expert (64-row tiles), ~225 (128-row tiles)
def test_down_projection_shape_with_default_blocks(scale):
    """The Flint-like aspect (K = I < N = H) through the default block tables, rows not a multiple of bm."""
    x, sizes, n = inputs([scale * g for g in GROUPS["uneven_with_empty"]], extra_rows=0)
    assert gm.default_block("nvfp4", "linear", x.shape[0] / E).bm == (64 if scale == 1 else 128)
    w = weights("nvfp4", n=2 * K, k=K)
    out = gm.grouped_matmul(x, w, sizes, interpret=INTERPRET)
    assert_bf16_close(out, gm.ref_grouped_matmul(x, w, sizes))


@pytest.mark.parametrize("decode", ["packed", "int"])
@pytest.mark.parametrize("mode", ["swiglu", "linear"])
@pytest.mark.parametrize("k", [64, 128])
def test_nvfp4_decodes_at_the_few_rows_blocks(decode, mode, k):
    """NVFP4 through the few-rows table's blocks (what a tiny model's prefill uses: 64 x 32-byte tiles at K = 64)
    with either decode, rows gathered in and scattered out as prefill passes them."""
    _, sizes, n = inputs(GROUPS["uneven_with_empty"], extra_rows=0)
    x = jax.random.normal(jax.random.key(3), (n, k), F32).astype(BF16)
    blk = dataclasses.replace(gm.BLOCKS_FEW_ROWS[("nvfp4", mode)], decode=decode)
    rows = jax.random.permutation(jax.random.key(4), n).astype(jnp.int32)
    if mode == "swiglu":
        g, u = weights("nvfp4", k=k, seed=5), weights("nvfp4", k=k, seed=6)
        out = gm.grouped_swiglu(x, g, u, sizes, interpret=INTERPRET, block=blk, rows=rows)
        assert_bf16_close(out, gm.ref_grouped_swiglu(x, g, u, sizes, rows=rows), max_ulp=2)
    else:
        w = weights("nvfp4", k=k, seed=7)
        out = gm.grouped_matmul(x, w, sizes, interpret=INTERPRET, block=blk, out_rows=rows, out_size=n)
        assert_bf16_close(out, gm.ref_grouped_matmul(x, w, sizes, out_rows=rows, out_size=n))


@pytest.mark.parametrize("groups", list(GROUPS))
def test_layout_visits_cover_each_row_once(groups):
    sizes = jnp.asarray(GROUPS[groups], jnp.int32)
    bm = 16
    R = max(int(sizes.sum()) + 3, bm)  # group_layout needs at least one tile of rows (the wrappers pad)
    lay = gm.group_layout(sizes, R, bm)
    assert lay.expert.shape == (gm.max_visits(R, E, bm),)
    cover = np.zeros(R, int)
    owner = np.repeat(np.arange(E), np.asarray(sizes))
    for e, r0, lo, hi in zip(*(np.asarray(a) for a in (lay.expert, lay.row0, lay.lo, lay.hi))):
        if hi > lo:
            assert 0 <= r0 <= lo < hi <= r0 + bm <= R
            assert (owner[lo:hi] == e).all()
            cover[lo:hi] += 1
    assert (cover[:int(sizes.sum())] == 1).all() and (cover[int(sizes.sum()):] == 0).all()
    # Only the selected experts' work: ceil(size / bm) visits per expert, none for an empty one.
    live = int((np.asarray(lay.hi) > np.asarray(lay.lo)).sum())
    assert live == sum(-(-int(n) // bm) for n in np.asarray(sizes))


# Expert sizes whose last tiles fall in every tier of (64, 32, 16)-row tiles (16 rows: the smallest tensor-core dot
# when compiled): none, > 32, 17..32, 1..16 rows past a multiple of 64, experts of one partial tile, and all rows on
# one expert.
TIERED_GROUPS = {"every_tier": [0, 64 + 40, 24, 5, 128, 64 + 12, 0, 33], "one_expert": [0, 0, 0, 0, 0, 150, 0, 0]}
TIER_BLOCKS = (gm.Block(64, 32, 32, 4, 1), gm.Block(32, 32, 32, 4, 1), gm.Block(16, 32, 32, 4, 1))


@pytest.mark.parametrize("groups", list(TIERED_GROUPS))
def test_tiered_layouts_cover_each_row_once_in_the_smallest_tile(groups):
    sizes = np.asarray(TIERED_GROUPS[groups])
    bms = tuple(b.bm for b in TIER_BLOCKS)
    R = int(sizes.sum()) + 3
    lays = gm.tiered_layouts(jnp.asarray(sizes, jnp.int32), R, bms)
    assert [lay.expert.shape[0] for lay in lays] == [gm.max_visits(R, E, bms[0]), E, E]
    owner = np.repeat(np.arange(E), sizes)
    cover = np.zeros(R, int)
    tiles = {}  # (expert, tier) -> rows per visit
    for tier, (lay, bm) in enumerate(zip(lays, bms)):
        for e, r0, lo, hi in zip(*(np.asarray(a) for a in (lay.expert, lay.row0, lay.lo, lay.hi))):
            if hi > lo:
                assert 0 <= r0 <= lo < hi <= r0 + bm <= R
                assert (owner[lo:hi] == e).all()
                cover[lo:hi] += 1
                tiles.setdefault((int(e), tier), []).append(int(hi - lo))
    assert (cover[:sizes.sum()] == 1).all() and (cover[sizes.sum():] == 0).all()
    for e, n in enumerate(sizes):
        full, rem = divmod(int(n), bms[0])
        want = {0: [bms[0]] * full + ([rem] if rem > bms[1] else [])}
        if bms[2] < rem <= bms[1]:
            want[1] = [rem]
        if 0 < rem <= bms[2]:
            want[2] = [rem]
        got = {t: v for (ee, t), v in tiles.items() if ee == e}
        assert got == {t: v for t, v in want.items() if v}, (e, n, got)


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("groups", list(TIERED_GROUPS))
def test_tail_blocks_equal_the_one_tile_size_kernels(kind, groups):
    """Each expert's last tile in a smaller block (one launch per tile size, each writing its rows into the first
    one's output): the same values as the one-tile-size kernel, bit for bit (each row's sum runs over the same K
    tiles), with rows gathered in (SwiGLU) and scattered out (down) as prefill passes them."""
    sizes = jnp.asarray(TIERED_GROUPS[groups], jnp.int32)
    n = int(sizes.sum())
    main, tails = TIER_BLOCKS[0], TIER_BLOCKS[1:]
    tokens = jax.random.normal(jax.random.key(3), (n + 5, K), F32).astype(BF16)
    rows = jax.random.randint(jax.random.key(4), (n,), 0, n + 5)
    out_rows = jax.random.permutation(jax.random.key(5), n).astype(jnp.int32)
    gate, up, down = weights(kind, seed=1), weights(kind, seed=2), weights(kind, n=K, k=N, seed=3)
    act = gm.grouped_swiglu(tokens, gate, up, sizes, rows=rows, interpret=INTERPRET, block=main, tails=tails)
    one = gm.grouped_swiglu(tokens, gate, up, sizes, rows=rows, interpret=INTERPRET, block=main)
    np.testing.assert_array_equal(np.asarray(act, F32), np.asarray(one, F32))
    assert_bf16_close(act, gm.ref_grouped_swiglu(tokens, gate, up, sizes, rows=rows), max_ulp=2)
    y = gm.grouped_matmul(act, down, sizes, out_rows=out_rows, out_size=n, interpret=INTERPRET, block=main,
                          tails=tails)
    y_one = gm.grouped_matmul(act, down, sizes, out_rows=out_rows, out_size=n, interpret=INTERPRET, block=main)
    np.testing.assert_array_equal(np.asarray(y, F32), np.asarray(y_one, F32))
    assert_bf16_close(y, gm.ref_grouped_matmul(act, down, sizes, out_rows=out_rows, out_size=n))


def test_tail_defaults_follow_the_block_tables():
    """The table's tails go with the table's block at 8K-like rows per expert only; an explicit block, a given
    layout or the few-rows table run one tile size; tiles must decrease."""
    assert gm.default_tails("nvfp4", "swiglu", 192.0) == gm.TAIL_BLOCKS[("nvfp4", "swiglu")]
    assert gm.default_tails("nvfp4", "swiglu", 40.0) == ()
    assert gm.default_tails("bf16", "linear", 192.0) == ()
    bms = [b.bm for b in (gm.BLOCKS[("nvfp4", "swiglu")],) + gm.TAIL_BLOCKS[("nvfp4", "swiglu")]]
    assert bms == sorted(bms, reverse=True) and len(set(bms)) == len(bms)
    with pytest.raises(ValueError, match="decrease"):
        gm.tiered_layouts(jnp.ones((E,), jnp.int32), 16, (8, 16))
    x, sizes, _ = inputs(GROUPS["uneven_with_empty"])
    lay = gm.group_layout(sizes, x.shape[0], 16)
    with pytest.raises(ValueError, match="tails and a precomputed layout"):
        gm.grouped_matmul(x, weights("bf16"), sizes, block=BLOCK, layout=lay, tails=(gm.Block(8, 32, 32, 4, 1),),
                          interpret=INTERPRET)


@pytest.mark.parametrize("block", [BLOCK, BLOCK_LHS], ids=["x_lhs", "weights_lhs"])
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_rows_by_index_equal_the_gathered_and_scattered_arrays(kind, block):
    """How prefill runs the experts: gate/up reads each sorted row from the tokens' activations by index (rows),
    down stores each result at its (token, slot) row (out_rows). Same values as gathering and un-permuting outside
    the kernels, bit for bit, and as the references given the same indices."""
    tokens, slots = 13, 3
    ids = jax.random.randint(jax.random.key(3), (tokens, slots), 0, E).at[0, :].set(5)  # an expert gets a repeat
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    b = jax.random.normal(jax.random.key(4), (tokens, K), F32).astype(BF16)
    gate, up, down = weights(kind, seed=1), weights(kind, seed=2), weights(kind, n=K, k=N, seed=3)
    act = gm.grouped_swiglu(b, gate, up, sizes, rows=order // slots, interpret=INTERPRET, block=block)
    act_gathered = gm.grouped_swiglu(b[order // slots], gate, up, sizes, interpret=INTERPRET, block=block)
    np.testing.assert_array_equal(np.asarray(act, F32), np.asarray(act_gathered, F32))
    assert_bf16_close(act, gm.ref_grouped_swiglu(b, gate, up, sizes, rows=order // slots), max_ulp=2)
    y = gm.grouped_matmul(act, down, sizes, out_rows=order, out_size=tokens * slots, interpret=INTERPRET,
                          block=block)
    y_sorted = gm.grouped_matmul(act, down, sizes, interpret=INTERPRET, block=block)
    assert y.shape == (tokens * slots, K)
    np.testing.assert_array_equal(np.asarray(y[order], F32), np.asarray(y_sorted, F32))
    assert_bf16_close(y, gm.ref_grouped_matmul(act, down, sizes, out_rows=order, out_size=tokens * slots))


def test_bad_row_indices_are_refused():
    x, sizes, n = inputs(GROUPS["one_row_each"], extra_rows=0)
    w = weights("bf16")
    with pytest.raises(ValueError, match="out_rows has 5 entries, expected 8"):
        gm.grouped_matmul(x, w, sizes, out_rows=jnp.arange(5), out_size=8, interpret=True)
    with pytest.raises(ValueError, match="rows must be a 1-D integer array"):
        gm.grouped_swiglu(x, w, w, sizes, rows=jnp.zeros((8,), F32), interpret=True)
    with pytest.raises(ValueError, match="out_rows needs out_size"):
        gm.grouped_matmul(x, w, sizes, out_rows=jnp.arange(8), interpret=True)


def test_wrong_shapes_are_refused():
    x, sizes, _ = inputs(GROUPS["one_row_each"])
    with pytest.raises(ValueError, match="K="):
        gm.grouped_matmul(x[:, :64], weights("bf16"), sizes, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        gm.grouped_matmul(x, weights("bf16"), sizes[:4], interpret=True)


# ---- the GPU lowering, checked on the CPU ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernels_lower_to_triton_for_h200(lower_for_h200):
    """Both kernels, both weight kinds, at Flint's expert shapes (8K tokens x top-6), lower to Triton IR for CUDA (an
    H200 described abstractly, no GPU needed): catches ops the Triton lowering lacks and non-power-of-two tiles
    that interpret mode accepts. (Compiling the IR to PTX needs the device machine, or a standalone Triton 3.6:
    docs/KERNELS.md, "Prefill (issue 7)".)"""
    S = jax.ShapeDtypeStruct
    Ef, I, H, R = 256, 512, 2048, 8192 * 6
    sizes = S((Ef,), jnp.int32)
    for kind in ("bf16", "nvfp4"):
        gu = S((Ef, I, H), BF16) if kind == "bf16" else nvfp4.abstract((Ef, I, H))
        dn = S((Ef, H, I), BF16) if kind == "bf16" else nvfp4.abstract((Ef, H, I))
        for lhs in (False, True):
            blk = {mode: dataclasses.replace(gm.default_block(kind, mode), weights_lhs=lhs)
                   for mode in ("swiglu", "linear")}
            if lhs and kind == "nvfp4":
                blk["linear"] = gm.NVFP4_LINEAR_LHS  # the measured candidate for the table (docs/KERNELS.md)
            for fn, args in ((lambda x, g, u, s: gm.grouped_swiglu(x, g, u, s, block=blk["swiglu"]),
                              (S((R, H), BF16), gu, gu, sizes)),
                             (lambda x, w, s: gm.grouped_matmul(x, w, s, block=blk["linear"]),
                              (S((R, I), BF16), dn, sizes)),
                             # prefill's form: rows gathered by index in, scattered by index out
                             (lambda x, g, u, s, r: gm.grouped_swiglu(x, g, u, s, block=blk["swiglu"], rows=r),
                              (S((R // 6, H), BF16), gu, gu, sizes, S((R,), jnp.int32))),
                             (lambda x, w, s, r: gm.grouped_matmul(x, w, s, block=blk["linear"], out_rows=r,
                                                                   out_size=R),
                              (S((R, I), BF16), dn, sizes, S((R,), jnp.int32)))):
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                assert "__gpu$xla.gpu.triton" in text
