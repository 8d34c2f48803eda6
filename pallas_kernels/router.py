"""MoE router: FP32 logits of the post-attention-normed hidden state, and sigmoid top-k selection.

    router_logits(h, router, norm_weight)  -> (logits [M, E] f32, b = rmsnorm(h) [M, H] bf16)      one kernel
    router_logits(..., select=(bias, cfg)) -> (logits, b, ids [M, KP] int32, weights [M, KP] f32)  one kernel
    route(h, router, bias, cfg)            -> (ids [M, k] int32, weights [M, k] f32)              two kernels
    select_experts(logits_row, bias, ...)  the in-kernel top-k, also run inside the expert kernels (moe_experts.py)

The logits kernel spreads the E x H FP32 router matrix (2 MB for Flint) over E/BE programs; each recomputes the
RMSNorm of its M rows (a few KB) and program 0 also writes b for the expert kernels, so the norm is fused here.
Top-k needs all E logits. With `select`, the program that arrives last at an atomic counter (after every program
has stored its logits) runs it for all rows at once and writes the expert ids and weights (KP = k rounded up to a
power of two; slots past k are 0): the expert kernels then start their weight loads after a 64-byte read instead of
6 dependent rounds of max / first-index / mask over E in each of their programs (`moe_experts.ROUTE_IN_ROUTER`).
On the H200 that made the step slower (the serial tail and the counter's zeroing outweigh the expert kernels'
gain; numbers at ROUTE_IN_ROUTER), so by default every expert-kernel program recomputes the top-k from the 1 KB of
logits. Ties go to the lower expert index, as `jax.lax.top_k` does in layers.route.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax import layer_stack, layers
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels import weight_tiles as wt

F32, BF16 = jnp.float32, jnp.bfloat16


# Each top-k round finds the highest score + bias and its lowest index with one argmax: the Triton lowering reduces
# (value, index) pairs in one pass, ties to the lower index, so a round costs one cross-warp reduction instead of two
# (max, then min over the indices that hold it). The same ids and weights for any scores without NaN. A knob so the
# whole step can time both (scripts/profile_decode.py variant `topk_two_reductions`).
TOPK_ARGMAX = True


def _top_k_rounds(logits: jax.Array, bias: jax.Array, k: int, norm_topk_prob: bool, scaling: float,
                  scores_given: bool = False):
    """k rounds of max / first index / mask over the last axis of logits ([E], or [R, E] per row): (k ids, k weights),
    each a scalar or an [R] vector. Selection by sigmoid score + bias, ties to the lower index; weights from the
    unbiased score, normalised over the k and scaled (layers.route). scores_given: `logits` already holds the
    sigmoid scores."""
    ids, weights = top_k_lazy(logits, bias, k, norm_topk_prob, scaling, scores_given)
    return ids, weights()


def top_k_lazy(logits: jax.Array, bias: jax.Array, k: int, norm_topk_prob: bool, scaling: float,
               scores_given: bool = False):
    """_top_k_rounds as (k ids, weights): `weights()` emits the weights' reductions where it is called, so a kernel
    that needs them in one branch only (moe_experts.ROUTING_TO_DOWN) keeps them off its other programs' chains.
    The same operations as computing them in the rounds, so the same bits."""
    axis = None if logits.ndim == 1 else 1
    keep = (lambda v: v) if axis is None else (lambda v: v[:, None])  # a per-row value against its row
    scores = logits if scores_given else 1.0 / (1.0 + jnp.exp(-logits))
    sel = scores + bias
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    ids, hits = [], []
    for _ in range(k):
        if TOPK_ARGMAX:  # one (value, index) reduction per round
            idx = jnp.argmax(sel, axis=axis).astype(jnp.int32)
        else:  # two: the max, then the lowest index holding it
            top = jnp.max(sel, axis=axis)
            idx = jnp.min(jnp.where(sel == keep(top), iota, logits.shape[-1]), axis=axis)
        hit = iota == keep(idx)
        ids.append(idx)
        hits.append(hit)
        sel = jnp.where(hit, -jnp.inf, sel)

    def weights():
        ws = [jnp.sum(jnp.where(hit, scores, 0.0), axis=axis) for hit in hits]
        if norm_topk_prob:
            total = ws[0]
            for w in ws[1:]:
                total = total + w
            ws = [w / total for w in ws]
        return [w * scaling for w in ws]
    return ids, weights


def select_experts(logits: jax.Array, bias: jax.Array, k: int, norm_topk_prob: bool, scaling: float):
    """In-kernel sigmoid top-k of one token. logits, bias f32 [E] -> (k expert ids, k weights) as scalars.
    Selection by score + bias, ties to the lower index; weights from the unbiased score (layers.route)."""
    return _top_k_rounds(logits, bias, k, norm_topk_prob, scaling)


def select_experts_rows(logits: jax.Array, bias: jax.Array, k: int, kp: int, norm_topk_prob: bool, scaling: float,
                        scores_given: bool = False):
    """select_experts for every row of logits [R, E] at once -> (ids [R, kp] int32, weights [R, kp] f32), slots
    past k zero. The same operations in the same order per row, so the same ids and bit-identical weights."""
    r = logits.shape[0]
    ids, ws = _top_k_rounds(logits, bias, k, norm_topk_prob, scaling, scores_given)
    slot = jax.lax.broadcasted_iota(jnp.int32, (r, kp), 1)
    id_out, w_out = jnp.zeros((r, kp), jnp.int32), jnp.zeros((r, kp), F32)
    for s in range(k):
        id_out = jnp.where(slot == s, ids[s][:, None], id_out)
        w_out = jnp.where(slot == s, ws[s][:, None], w_out)
    return id_out, w_out


def logits_tile(j, h_ref, nw_ref, r_ref, logits_ref, store_b, *, mp, be, bk, eps, has_norm):
    """Logits of experts [j*be, (j+1)*be) for the mp rows of h (RMS-normed on the fly), and, in tile 0, the normed
    rows b through store_b(row, k0, values) (the persistent MoE kernel stores them in its own layout)."""
    e0 = pl.multiple_of(j * be, be)
    hidden = h_ref.shape[-1]
    xs = wt.XSource(h_ref, "bf16", nw_ref if has_norm else None, eps)
    norms = wt.row_norms(xs, mp, hidden) if has_norm else None
    spec = wt.WeightSpec("bf16", 1, r_ref.shape[1], hidden)  # FP32 values; streamed like a BF16 weight
    accs = wt.stream_rows([xs] * mp, list(range(mp)), [(spec, (r_ref,))], [0], e0, be, bk, norms)
    inv = norms.value if isinstance(norms, wt.RowNorms) else norms
    for r in range(mp):
        logits_ref[r, pl.ds(e0, be)] = accs[r]

    @pl.when(j == 0)
    def _():
        bkn = xs.norm_tile(hidden)

        def body(t, c):
            for r in range(mp):
                store_b(r, wt.k_start(t, bkn), xs.tile(r, t, bkn, 0, None if inv is None else inv[r]).astype(BF16))
            return c
        wt.k_loop(hidden // bkn, body, 0)


def _logits_kernel(h_ref, nw_ref, r_ref, *refs, mp, be, bk, eps, has_norm, select, compiled):
    if select is not None:
        bias_ref, _, logits_ref, b_ref, ids_ref, w_ref, cnt_ref = refs
    else:
        logits_ref, b_ref = refs

    def store_b(r, k0, values):
        b_ref[r, pl.ds(k0, values.shape[0])] = values

    logits_tile(pl.program_id(0), h_ref, nw_ref, r_ref, logits_ref, store_b, mp=mp, be=be, bk=bk, eps=eps,
                has_norm=has_norm)

    if select is not None:
        k, kp, norm, scaling = select
        if compiled:
            plt.debug_barrier()  # every thread's logits stores precede the release of the atomic
        ticket = plt.atomic_add(cnt_ref, (jnp.zeros((), jnp.int32),), jnp.ones((), jnp.int32))  # a traced index

        @pl.when(ticket == pl.num_programs(0) - 1)  # the last program: every logit is stored
        def _():
            # Volatile: the logits were written by other SMs during this launch (not via L1).
            logits = plt.load(logits_ref, volatile=True)
            ids, ws = select_experts_rows(logits, bias_ref[...], k, kp, norm, scaling)
            ids_ref[...] = ids
            w_ref[...] = ws


def router_logits(h: jax.Array, router: jax.Array, *, norm_weight: jax.Array | None = None, eps: float = 1e-5,
                  interpret: bool = False, block=None, select=None):
    """FP32 router logits of b = rmsnorm(h, norm_weight) (or b = h): h [M, H] bf16, router [E, H] f32 ->
    (logits [M, E] f32, b [M, H] bf16). `block` = (be, bk, num_warps, num_stages).
    select = (bias [E], cfg): also the top-k routing, computed by the last program (module docstring) ->
    (logits, b, ids [M, KP] int32, weights [M, KP] f32), KP = k rounded up to a power of two, slots >= k zero."""
    m, hidden = h.shape
    e = router.shape[0]
    if not 1 <= m <= 8:
        raise ValueError(f"router kernel serves M = 1..8 rows, got {m}")
    mp = wt.pow2_rows(m)
    be, bk, warps, stages = block or (2, 2048, 4, 1)
    be = wt.largest_pow2_divisor(e, be)
    bk = wt.largest_pow2_divisor(hidden, bk)
    hp = wt.pad_rows(h.astype(BF16), mp)
    nw = norm_weight.astype(BF16) if norm_weight is not None else jnp.ones((hidden,), BF16)
    args = [hp, nw, wt.lead_axis(router).astype(F32)]
    out_shape = [jax.ShapeDtypeStruct((mp, e), F32), jax.ShapeDtypeStruct((mp, hidden), BF16)]
    aliases, sel = {}, None
    if select is not None:
        bias, cfg = select
        kp = wt.pow2_rows(cfg.num_experts_per_tok)
        sel = (cfg.num_experts_per_tok, kp, bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor))
        # the arrival counter: zeros in, aliased out, so every call gets a fresh zeroed buffer
        args += [bias.astype(F32), jnp.zeros((1,), jnp.int32)]
        out_shape += [jax.ShapeDtypeStruct((mp, kp), jnp.int32), jax.ShapeDtypeStruct((mp, kp), F32),
                      jax.ShapeDtypeStruct((1,), jnp.int32)]
        aliases = {len(args) - 1: len(out_shape) - 1}
    kernel = functools.partial(_logits_kernel, mp=mp, be=be, bk=bk, eps=float(eps),
                               has_norm=norm_weight is not None, select=sel, compiled=not interpret)
    args, in_specs = layer_stack.kernel_args(args)
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(e // be,),
        in_specs=in_specs,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="router_logits" if select is None else "router_logits_topk",
    )(*args)
    if select is None:
        return outs[0][:m], outs[1][:m]
    return outs[0][:m], outs[1][:m], outs[2][:m], outs[3][:m]


def _topk_kernel(logits_ref, bias_ref, ids_ref, w_ref, *, k, kp, rows, norm, scaling, scores_given):
    t = pl.program_id(0)
    ids_ref[...], w_ref[...] = select_experts_rows(logits_ref[pl.ds(t * rows, rows), :], bias_ref[...], k, kp, norm,
                                                   scaling, scores_given)


# Tokens per program of top_k_experts for many tokens (a prefill chunk): XLA's lax.top_k there is a full sort of
# each token's 256 scores, 68 us per 8K-token layer on the H200 (run AD, docs/BENCHMARKS.md).
PREFILL_ROWS = 16


# Warps of the top_k_slots kernel, and tokens per program (None: a decode batch's <= 8 tokens in one program).
# In the batch-4 step on the H200 (scripts/profile_decode.py, 8K; docs/BENCHMARKS.md runs DU-DY): all 4 tokens in
# one program 3.5 us with 4 warps, 7.9 with 1, 3.2 with 8; one program per token (4 warps) 2.7 us, step 3.512 ms.
TOPK_SLOTS_WARPS = 4
TOPK_SLOTS_ROWS: int | None = 1


def top_k_slots(logits: jax.Array, bias: jax.Array, cfg: FlintConfig, *, interpret: bool = False,
                rows: int | None = None, scores_given: bool = False, num_warps: int | None = None):
    """Sigmoid top-k of FP32 logits [M, E] in the layout the expert kernels read (moe_experts routing): (ids
    [MP, KP] int32, weights [MP, KP] f32), MP = M rounded up to `rows` tokens per program (a power of two; default
    TOPK_SLOTS_ROWS, or every token in one program), KP = k rounded up to a power of two; slots past k and rows
    past M hold what the rounds give for padding (zeros and a padding row's selection): callers index rows < M and
    slots < k only.
    No slice follows the kernel, so in a jitted step it is one launch (two with a pad when M is not a multiple of
    `rows`)."""
    m, e = logits.shape
    rows = rows or TOPK_SLOTS_ROWS or wt.pow2_rows(m)
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two, got {rows}")
    k = cfg.num_experts_per_tok
    kp = wt.pow2_rows(k)
    mp = -(-m // rows) * rows
    logits = logits.astype(F32)
    if mp != m:  # padding rows select something; callers never read them
        logits = jnp.pad(logits, ((0, mp - m), (0, 0)))
    kernel = functools.partial(_topk_kernel, k=k, kp=kp, rows=rows, norm=bool(cfg.norm_topk_prob),
                               scaling=float(cfg.routed_scaling_factor), scores_given=scores_given)
    # a layer of a stacked bias goes in as its stack with the layer's BlockSpec: an XLA slice would be a kernel
    operands, in_specs = layer_stack.kernel_args([logits, bias.astype(F32)])
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((mp, kp), jnp.int32), jax.ShapeDtypeStruct((mp, kp), F32)),
        grid=(mp // rows,),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((rows, kp), lambda t: (t, 0)), pl.BlockSpec((rows, kp), lambda t: (t, 0))),
        compiler_params=plt.CompilerParams(num_warps=num_warps or TOPK_SLOTS_WARPS, num_stages=1),
        interpret=interpret,
        name="router_top_k",
    )(*operands)


def top_k_experts(logits: jax.Array, bias: jax.Array, cfg: FlintConfig, *, interpret: bool = False,
                  rows: int = 1, scores_given: bool = False):
    """Sigmoid top-k of FP32 logits [M, E] (select_experts_rows, `rows` tokens per program, a power of two) ->
    (ids [M, k] int32, weights [M, k] f32): layers.route_from_logits' ids, and its weights to FP32 rounding (the
    k scores are summed in slot order). scores_given: `logits` holds jax.nn.sigmoid(logits) already (computed by
    XLA, as layers.route_from_logits does: then the selection sees the very same scores; the kernel's own sigmoid
    uses the GPU's fast exponential, whose last bits can flip a near-tie)."""
    m = logits.shape[0]
    ids, w = top_k_slots(logits, bias, cfg, interpret=interpret, rows=rows, scores_given=scores_given, num_warps=4)
    k = cfg.num_experts_per_tok
    return ids[:m, :k], w[:m, :k]


def route(h: jax.Array, router: jax.Array, bias: jax.Array, cfg: FlintConfig, *,
          norm_weight: jax.Array | None = None, interpret: bool = False):
    """layers.route(rmsnorm(h, norm_weight), router, bias, cfg) with the norm fused: (ids [M, k] int32,
    weights [M, k] f32). The MoE block does not call this: its expert kernels select in-kernel."""
    logits, _ = router_logits(h, router, norm_weight=norm_weight, eps=cfg.rms_norm_eps, interpret=interpret)
    return top_k_experts(logits, bias, cfg, interpret=interpret)


def ref_route(h, router, bias, cfg, *, norm_weight=None, interpret=False):
    del interpret
    b = h if norm_weight is None else layers.rmsnorm(h, norm_weight, cfg.rms_norm_eps)
    return layers.route(b, router, bias, cfg)


def ref_router_logits(h, router, *, norm_weight=None, eps=1e-5, interpret=False, block=None):
    del interpret, block
    b = h if norm_weight is None else layers.rmsnorm(h, norm_weight, eps)
    return layers.router_logits(b, router), b
