"""Routed + shared experts of a Flint MoE layer for decode (M <= 8 tokens), and the MLP half of a layer.

    moe_block(h, layer, cfg)        = layers.mlp_block(h, layer, cfg) for an MoE layer in three kernels, four from
                                      TOPK_KERNEL_MIN_ROWS tokens on (or, with PERSISTENT, at most 2 tokens in
                                      one persistent kernel: moe_persistent.py):
        1. router.router_logits     b = rmsnorm(h), FP32 logits = b @ router.T                      [M, E]
                                    and (ROUTE_IN_ROUTER, off by default) the top-k ids and weights, by its
                                    last program
       (1b. router.top_k_slots      from TOPK_KERNEL_MIN_ROWS tokens: every token's top-k once (a program per
                                    token), read by both expert kernels                    ids, weights [M, KP])
        2. expert_gate_up           per (token, slot) pair and block of I rows: the slot's expert id (read, or
                                    recomputed from the logits), the expert's gate and up rows streamed once,
                                    SwiGLU fused;
                                    pairs M*k .. M*k+M-1 run the shared expert                  act [M*(k+1), I]
                                    and (ROUTING_TO_DOWN, on by default) each token's top-k ids and weights,
                                    written by one program per token                       ids, weights [M, KP]
        3. expert_down              per (token, block of H rows): the k routed experts' down rows and the shared
                                    expert's, combined in FP32 with the routing weights, rounded once, plus the
                                    residual                                                        h_new [M, H]
    dense_mlp_block(h, layer, cfg)  = layers.mlp_block for a dense layer: gemv_swiglu + gemv(residual), two kernels.

Expert ids are data: a program derives them from the logits (or reads them) at run time and indexes the stacked
[E, N, K] weights with them (Triton pointer arithmetic), so one compiled kernel serves every routing and only the
selected experts' bytes are read. With M tokens each (token, slot) pair reads its expert once (as
layers.routed_experts_gathered does); two tokens that pick one expert read it twice, which at M <= 8 costs less
than a sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax import layer_stack, layers
from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels import gemv as gemv_mod
from flint_jax.pallas_kernels import router as router_mod
from flint_jax.pallas_kernels import weight_tiles as wt

F32, BF16 = jnp.float32, jnp.bfloat16
# (rows of I per program, K tile, warps, stages); 1024-value K tiles: 8.4 us vs 8.9 with 512 on the H200
GATE_UP_BLOCK = (8, 1024, 4, 3)
DOWN_BLOCK = (8, 512, 4, 1)  # (rows of H per program, ...); I = 512 is one K step for Flint
# The same for BF16 experts. Gate/up: tune_weight_kernels.py --weights bf16 (run BB) 12.16 -> 11.22 us, and in the
# step (run BD) 12.5 -> 11.6 us. Down: the sweep's best (4, 512, 2, 1; 9.28 -> 9.01 us alone) was slower in the step
# (7.5 -> 8.1 us, run BD), so it keeps the NVFP4 block.
# NVFP4 down blocks from DOWN_MANY_ROWS tokens on (None: DOWN_BLOCK at every batch): 16 rows of H per program,
# half the programs of DOWN_BLOCK, each streaming its token's 7 experts. In the step on the H200 (runs DU-DV, 8K):
# down 14.1 -> 13.2 us per layer at batch 4, 24.6 -> 24.1 at batch 8; with 8 warps 16.8 at batch 4.
DOWN_MANY_ROWS: int | None = 4
DOWN_BLOCK_MANY = (16, 512, 4, 1)
BF16_GATE_UP_BLOCK = (4, 2048, 4, 3)
BF16_DOWN_BLOCK = DOWN_BLOCK
ROUTER_BLOCK = (2, 2048, 8, 1)  # 8 warps: 2.43 vs 2.53 us on the H200 (tune_weight_kernels)
# The top-k once, in the router kernel's last program (router.py), instead of in every expert-kernel program.
# Off: measured in the whole step on the H200 (run G, docs/BENCHMARKS.md) it cost more than it saved: the expert
# kernels got faster (gate/up 8.5 -> 7.1 us, down 7.0 -> 5.4) but the router's serial top-k tail (2.8 -> 5.8 us)
# and the counter's zeroing copy (one more launch, 0.9 us) ate it: 2.962 vs 2.916 ms per step at 100K.
ROUTE_IN_ROUTER = False
# Batches of at least this many tokens take the top-k from one kernel of its own (router.top_k_slots: one program
# per token, one launch more per MoE layer), which both expert kernels read, instead of every routed gate/up
# program recomputing its token's top-k (the default below it; None: never). At batches 4-8 the gate/up kernel runs
# 1,500-3,000 programs, each of which otherwise spends 6 rounds of cross-warp argmax on the same 256 logits.
# The same ids and weights bit for bit (the same rounds in the same order; test_kernels_moe). Measured in the step
# on the H200 (scripts/profile_decode.py, 8K, device time; docs/BENCHMARKS.md runs DU-DY): batch 4 gate/up 23.6 ->
# 18.8 us per layer plus 3.5 us for the top-k kernel, step 3.647 -> 3.573 ms; batch 8 gate/up 42.7 -> 34.0 us plus
# 5.3, step 5.672 -> 5.519 ms. One warp at batch 4 took 7.9 us against 3.5 with 4 (TOPK_SLOTS_WARPS); one
# program per token 2.7 us (router.TOPK_SLOTS_ROWS, run DY: step 3.512 ms). From 2 tokens since runs DZ-EB (one
# program per token): batch 2 gate/up 14.3 -> 11.4 us plus 2.7, step 2.554 -> 2.530 ms (2.563 -> 2.542 in a second
# run); batch 3 3.690 -> 3.650 ms. At one token it loses (run EA, 100K: gate/up 8.5 -> 7.2 us plus 2.7, step
# 2.309 -> 2.362 ms), so a single token keeps the per-program top-k.
TOPK_KERNEL_MIN_ROWS: int | None = 2
# Blocks of at most moe_persistent.PERSISTENT_MAX_ROWS tokens as one persistent kernel (router, gate/up and down
# phases behind grid barriers, moe_persistent.py) instead of the three kernels below. Off: measured in the whole
# step on the H200 (NVFP4, 100K, B = 1) it took 28.2 us per layer (29.2 with load polling) against 18.4 us for the
# three kernels, and 17.6 us with its barriers removed (wrong results, timing only): the three phases' own serial
# latency, not the launches, is what the block costs, and each barrier adds ~5 us (docs/BENCHMARKS.md, run H).
PERSISTENT = False
# The gate/up kernel writes each token's top-k ids and weights (computed by its programs anyway) and the down kernel
# reads them, instead of every down program recomputing the top-k from the logits: down's chain loses 6 rounds of
# reductions before its first weight load. The output bits are unchanged (the same rounds, in the same order).
ROUTING_TO_DOWN = True


def _pick(e_or_n: int, k: int, kind: str, block) -> tuple[int, int, int, int, bool, bool]:
    """(bn, bk, num_warps, num_stages[, elementwise[, prefetch]]) fitted to the shape."""
    bn, bk, warps, stages, *rest = block
    rest = list(rest) + [False, False]
    spec = wt.WeightSpec(kind, 1, e_or_n, k)
    return (wt.largest_pow2_divisor(e_or_n, bn), wt.k_tile(spec, bk), warps, stages, bool(rest[0]), bool(rest[1]))


def _slot_value(vec: jax.Array, slot) -> jax.Array:
    """vec[slot] for a short vector and a traced slot (a masked sum: no dynamic scalar indexing in the kernel)."""
    return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, vec.shape, 0) == slot, vec, jnp.zeros_like(vec)))


def routing_from_refs(route_a, route_b, k, norm, scaling, lazy_weights: bool = False):
    """token(t) -> (k expert ids, k weights) of token t: read from the router's output (route_a, route_b = ids_ref,
    w_ref), or recomputed from the logits (logits_ref, bias_ref) on every call. lazy_weights: the weights come as a
    function that emits their computation where it is called (router.top_k_lazy)."""
    def token(t):
        if route_a.dtype == jnp.int32:
            ids_row = route_a[t, :]

            def weights():
                w_row = route_b[t, :]
                return [_slot_value(w_row, s) for s in range(k)]
            return [_slot_value(ids_row, s) for s in range(k)], (weights if lazy_weights else weights())
        ids, weights = router_mod.top_k_lazy(route_a[t, :], route_b[...], k, norm, scaling)
        return ids, (weights if lazy_weights else weights())
    return token


def routing_from_rows(ids: jax.Array, ws: jax.Array, k: int):
    """token(t) for the top-k of every row already in registers (router.select_experts_rows: ids, ws [R, KP])."""
    row = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    col = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 1)

    def token(t):
        hit = [(row == t) & (col == s) for s in range(k)]
        return ([jnp.sum(jnp.where(h, ids, 0)) for h in hit], [jnp.sum(jnp.where(h, ws, 0.0)) for h in hit])
    return token


def _slot_expert(ids, slot):
    e = ids[0]
    for s in range(1, len(ids)):
        e = jnp.where(slot == s, ids[s], e)
    return e


def gate_up_tile(p, blk, token, xs, g_spec, gate, up, s_spec, sgate, sup, store, *, m, k, bn, bk, elementwise,
                 prefetch, store_routing=None):
    """Rows [blk*bn, (blk+1)*bn) of pair p's SwiGLU activations: pair t*k + s is token t's slot-s expert (from
    token(t)), pair M*k + t token t's shared expert (s_spec None: no shared expert). store(p, n0, values bf16 [bn]).
    store_routing(t, ids, weights): called by the program of token t's slot 0 and block 0 (see ROUTING_TO_DOWN);
    then token(t) gives the weights as a function (routing_from_refs' lazy_weights), called there only."""
    n0 = pl.multiple_of(blk * bn, bn)

    def run(spec, g_refs, u_refs, t, e):
        scales = wt.epilogue_loads(lambda: (wt.global_scale(spec, g_refs, e), wt.global_scale(spec, u_refs, e)))
        acc_g, acc_u = wt.stream_rows([xs], [t], [(spec, g_refs), (spec, u_refs)], [e, e], n0, bn, bk,
                                      elementwise=elementwise, prefetch=prefetch)
        gs_g, gs_u = scales()
        g = wt.apply_global_scale(acc_g, gs_g).astype(BF16)
        u = wt.apply_global_scale(acc_u, gs_u).astype(BF16)
        store(p, n0, gemv_mod.swiglu_f32(g, u))

    @pl.when(p < m * k)
    def _routed():
        t = p // k
        ids, ws = token(t)
        if store_routing is not None:  # before the weights: the top-k's masks die here, not after the K loop
            @pl.when((blk == 0) & (p == t * k))
            def _():
                store_routing(t, ids, ws())
        run(g_spec, gate, up, t, _slot_expert(ids, p - t * k))

    if s_spec is not None:
        @pl.when(p >= m * k)
        def _shared():
            run(s_spec, sgate, sup, p - m * k, 0)


def _gate_up_kernel(route_a, route_b, x_ref, *refs, m, k, g_spec, s_spec, bn, bk, norm, scaling, elementwise,
                    prefetch, emit_routing):
    refs = list(refs)
    store_routing = None
    if emit_routing:
        w_out, ids_out = refs.pop(), refs.pop()

        def write_routing(t, ids, ws):
            slot = jax.lax.broadcasted_iota(jnp.int32, ids_out.shape[1:], 0)
            id_row, w_row = jnp.zeros(slot.shape, jnp.int32), jnp.zeros(slot.shape, F32)
            for s in range(k):
                id_row = jnp.where(slot == s, ids[s], id_row)
                w_row = jnp.where(slot == s, ws[s], w_row)
            ids_out[t, :] = id_row
            w_out[t, :] = w_row
        store_routing = write_routing
    o_ref = refs.pop()
    ng, ns = g_spec.num_operands, (s_spec.num_operands if s_spec is not None else 0)
    gate, up = refs[:ng], refs[ng:2 * ng]
    sgate, sup = refs[2 * ng:2 * ng + ns], refs[2 * ng + ns:2 * ng + 2 * ns]

    def store(p, n0, values):
        o_ref[p, pl.ds(n0, bn)] = values

    token = routing_from_refs(route_a, route_b, k, norm, scaling, lazy_weights=emit_routing)
    gate_up_tile(pl.program_id(0), pl.program_id(1), token,
                 wt.XSource(x_ref, g_spec.kind), g_spec, gate, up, s_spec, sgate, sup, store, m=m, k=k, bn=bn, bk=bk,
                 elementwise=elementwise, prefetch=prefetch, store_routing=store_routing)


def shared_expert_operands(moe):
    """(spec, gate + up operands, down spec, down operands) of the MoE's shared expert, or (None, [], None, [])
    without one. It must have the routed experts' kind and intermediate size (one kernel streams both)."""
    if moe.shared_gate is None:
        return None, [], None, []
    g_spec, _ = wt.weight_operands(moe.gate, stacked=True)
    d_spec, _ = wt.weight_operands(moe.down, stacked=True)
    s_spec, sg_ops = wt.weight_operands(moe.shared_gate)
    _, su_ops = wt.weight_operands(moe.shared_up)
    sd_spec, sd_ops = wt.weight_operands(moe.shared_down)
    if (s_spec.kind, s_spec.n, sd_spec.kind, sd_spec.k) != (g_spec.kind, g_spec.n, d_spec.kind, d_spec.k):
        raise NotImplementedError("the shared expert must have the routed experts' kind and intermediate size")
    return s_spec, [*sg_ops, *su_ops], sd_spec, list(sd_ops)


def _route_operands(logits, moe, routing):
    """The expert kernels' first two operands: the router's (ids, weights) when given, else (logits, bias)."""
    if routing is not None:
        ids, ws = routing
        return [ids.astype(jnp.int32), ws.astype(F32)]
    return [logits.astype(F32), moe.router_bias.astype(F32)]


def expert_gate_up(b: jax.Array, logits: jax.Array, moe, cfg: FlintConfig, *, interpret: bool = False,
                   block=None, routing=None, emit_routing: bool = False):
    """SwiGLU activations of the selected experts (and the shared expert) for normed inputs b [M, H]:
    row t*k + s is token t's slot-s expert, row M*k + t token t's shared expert. -> [M*(k+shared), I] bf16.
    routing: (ids [M, KP], weights [M, KP]) from `router_logits(..., select=...)`; else the top-k is recomputed
    from the logits in every program. emit_routing (without routing): also return the top-k the programs computed,
    (act, ids [M, KP] int32, weights [M, KP] f32), KP = k rounded up to a power of two, slots past k zero."""
    if emit_routing and routing is not None:
        raise ValueError("emit_routing recomputes the top-k; it cannot be combined with a given routing")
    m, hidden = b.shape
    k = cfg.num_experts_per_tok
    g_spec, g_ops = wt.weight_operands(moe.gate, stacked=True)
    _, u_ops = wt.weight_operands(moe.up, stacked=True)
    s_spec, shared_ops, _, _ = shared_expert_operands(moe)
    operands = [*_route_operands(logits, moe, routing), wt.x_operand(b.astype(BF16), g_spec.kind), *g_ops, *u_ops,
                *shared_ops]
    table = GATE_UP_BLOCK if g_spec.kind == "nvfp4" else BF16_GATE_UP_BLOCK
    bn, bk, warps, stages, ew, pf = _pick(g_spec.n, hidden, g_spec.kind, block or table)
    pairs = m * (k + int(s_spec is not None))
    kernel = functools.partial(_gate_up_kernel, m=m, k=k, g_spec=g_spec, s_spec=s_spec, bn=bn, bk=bk,
                               norm=bool(cfg.norm_topk_prob), scaling=float(cfg.routed_scaling_factor),
                               elementwise=ew, prefetch=pf, emit_routing=emit_routing)
    out_shape = [jax.ShapeDtypeStruct((pairs, g_spec.n), BF16)]
    if emit_routing:
        kp = wt.pow2_rows(k)
        out_shape += [jax.ShapeDtypeStruct((m, kp), jnp.int32), jax.ShapeDtypeStruct((m, kp), F32)]
    operands, in_specs = layer_stack.kernel_args(operands)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pairs, g_spec.n // bn),
        in_specs=in_specs,
        out_specs=[pl.no_block_spec] * len(out_shape),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"moe_gate_up_{g_spec.kind}",
    )(*operands)
    return tuple(outs) if emit_routing else outs[0]


def down_tile(t, blk, token, xs, d_spec, down, s_spec, sdown, res_ref, store, *, m, k, bn, bk):
    """Rows [blk*bn, (blk+1)*bn) of token t's `residual + bf16(shared + sum_s w_s * expert_s)` from the activation
    rows of gate_up_tile (xs), combined in FP32 and rounded once. store(t, n0, values bf16 [bn])."""
    n0 = pl.multiple_of(blk * bn, bn)
    ids, ws = token(t)
    rows = [t * k + s for s in range(k)]
    weights = [(d_spec, down)] * k
    experts = list(ids)
    if s_spec is not None:
        rows.append(m * k + t)
        weights.append((s_spec, sdown))
        experts.append(0)
    # The epilogue's operands (global scales, residual) before the K loop: loads after it would add a dependent
    # round trip to the end of the program's chain (wt.EARLY_EPILOGUE_LOADS).
    epilogue = wt.epilogue_loads(lambda: ([wt.global_scale(d_spec, down, ids[s]) for s in range(k)],
                                          wt.global_scale(s_spec, sdown, 0) if s_spec is not None else None,
                                          res_ref[t, pl.ds(n0, bn)]))
    accs = wt.stream_rows([xs] * len(rows), rows, weights, experts, n0, bn, bk,
                          pairs=[(i, i) for i in range(len(rows))])
    gs, sgs, res = epilogue()
    y = jnp.zeros((bn,), F32)
    for s in range(k):
        out_s = wt.apply_global_scale(accs[s], gs[s]).astype(BF16)
        y = y + ws[s] * out_s.astype(F32)
    if s_spec is not None:
        y = y + wt.apply_global_scale(accs[k], sgs).astype(BF16).astype(F32)
    store(t, n0, (res.astype(F32) + y.astype(BF16).astype(F32)).astype(BF16))


def _down_kernel(route_a, route_b, x_ref, *refs, m, k, d_spec, s_spec, bn, bk, norm, scaling):
    refs = list(refs)
    o_ref = refs.pop()
    h_ref = refs.pop()
    nd = d_spec.num_operands
    down, sdown = refs[:nd], refs[nd:]

    def store(t, n0, values):
        o_ref[t, pl.ds(n0, bn)] = values

    down_tile(pl.program_id(0), pl.program_id(1), routing_from_refs(route_a, route_b, k, norm, scaling),
              wt.XSource(x_ref, d_spec.kind), d_spec, down, s_spec, sdown, h_ref, store, m=m, k=k, bn=bn, bk=bk)


def expert_down(act: jax.Array, logits: jax.Array, moe, cfg: FlintConfig, residual: jax.Array, *,
                interpret: bool = False, block=None, routing=None) -> jax.Array:
    """`residual + bf16(shared(act) + sum_s w_s * expert_s(act))` from expert_gate_up's rows: [M, H] bf16."""
    m, hidden = residual.shape
    k = cfg.num_experts_per_tok
    d_spec, d_ops = wt.weight_operands(moe.down, stacked=True)
    _, _, s_spec, shared_ops = shared_expert_operands(moe)
    operands = [*_route_operands(logits, moe, routing), wt.x_operand(act.astype(BF16), d_spec.kind), *d_ops,
                *shared_ops]
    table = DOWN_BLOCK if d_spec.kind == "nvfp4" else BF16_DOWN_BLOCK
    if d_spec.kind == "nvfp4" and DOWN_MANY_ROWS is not None and m >= DOWN_MANY_ROWS:
        table = DOWN_BLOCK_MANY
    bn, bk, warps, stages, _, _ = _pick(hidden, d_spec.k, d_spec.kind, block or table)
    operands.append(residual.astype(BF16))
    operands, in_specs = layer_stack.kernel_args(operands)
    kernel = functools.partial(_down_kernel, m=m, k=k, d_spec=d_spec, s_spec=s_spec, bn=bn, bk=bk,
                               norm=bool(cfg.norm_topk_prob), scaling=float(cfg.routed_scaling_factor))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, hidden), BF16),
        grid=(m, hidden // bn),
        in_specs=in_specs,
        out_specs=pl.no_block_spec,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"moe_down_{d_spec.kind}",
    )(*operands)


def moe_block(h: jax.Array, layer, cfg: FlintConfig, *, interpret: bool = False, blocks: dict | None = None):
    """`layers.mlp_block(h, layer, cfg)` for an MoE layer: three kernels, or one persistent kernel for at most
    moe_persistent.PERSISTENT_MAX_ROWS rows when PERSISTENT is set. h [..., H] bf16 with at most 8 rows.
    `blocks` may override the three kernels' "router", "gate_up", "down" block tuples (benchmark sweeps; they
    select the three-kernel path)."""
    blocks = blocks or {}
    lead = h.shape[:-1]
    flat = h.reshape(-1, h.shape[-1])
    from flint_jax.pallas_kernels import moe_persistent  # it builds on this module's tile functions
    if PERSISTENT and not blocks and flat.shape[0] <= moe_persistent.PERSISTENT_MAX_ROWS:
        return moe_persistent.moe_block_persistent(h, layer_stack.materialize(layer), cfg, interpret=interpret)
    moe = layer.mlp
    block = blocks.get("router", ROUTER_BLOCK)
    if ROUTE_IN_ROUTER:
        logits, b, ids, ws = router_mod.router_logits(flat, moe.router, norm_weight=layer.mlp_norm,
                                                      eps=cfg.rms_norm_eps, interpret=interpret, block=block,
                                                      select=(moe.router_bias, cfg))
        routing = (ids, ws)
    else:
        logits, b = router_mod.router_logits(flat, moe.router, norm_weight=layer.mlp_norm, eps=cfg.rms_norm_eps,
                                             interpret=interpret, block=block)
        routing = None
        if TOPK_KERNEL_MIN_ROWS is not None and flat.shape[0] >= TOPK_KERNEL_MIN_ROWS:
            routing = router_mod.top_k_slots(logits, moe.router_bias, cfg, interpret=interpret)
    if routing is None and ROUTING_TO_DOWN:
        act, ids, ws = expert_gate_up(b, logits, moe, cfg, interpret=interpret, block=blocks.get("gate_up"),
                                      emit_routing=True)
        routing = (ids, ws)
    else:
        act = expert_gate_up(b, logits, moe, cfg, interpret=interpret, block=blocks.get("gate_up"),
                             routing=routing)
    out = expert_down(act, logits, moe, cfg, flat, interpret=interpret, block=blocks.get("down"), routing=routing)
    return out.reshape(*lead, -1)


def dense_mlp_block(h: jax.Array, layer, cfg: FlintConfig, *, interpret: bool = False, blocks: dict | None = None):
    """`layers.mlp_block(h, layer, cfg)` for a dense layer: gemv_swiglu (norm fused) then gemv (residual fused)."""
    blocks = blocks or {}
    lead = h.shape[:-1]
    flat = h.reshape(-1, h.shape[-1])
    mlp = layer.mlp
    act = gemv_mod.gemv_swiglu(flat, mlp.gate, mlp.up, norm_weight=layer.mlp_norm, eps=cfg.rms_norm_eps,
                               interpret=interpret, block=blocks.get("gate_up"))
    out = gemv_mod.gemv(act, mlp.down, residual=flat, interpret=interpret, block=blocks.get("down"))
    return out.reshape(*lead, -1)


def mlp_block(h: jax.Array, layer, cfg: FlintConfig, *, interpret: bool = False, blocks: dict | None = None):
    """The MLP half of a layer with the Pallas kernels, dense or MoE by the layer's parameters."""
    if hasattr(layer.mlp, "router"):
        return moe_block(h, layer, cfg, interpret=interpret, blocks=blocks)
    return dense_mlp_block(h, layer, cfg, interpret=interpret, blocks=blocks)


def ref_moe_block(h, layer, cfg, *, interpret=False, blocks=None):
    del interpret, blocks
    return layers.mlp_block(h, layer, cfg)


ref_dense_mlp_block = ref_moe_block
ref_mlp_block = ref_moe_block
