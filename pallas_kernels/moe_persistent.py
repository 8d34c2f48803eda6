"""The MoE half of a decode layer (router, routed + shared experts, residual) in one persistent kernel.

    moe_block_persistent(h, layer, cfg) = moe_experts.moe_block(h, layer, cfg), same bits, one launch:

        phase 0  router.logits_tile      FP32 logits of rmsnorm(h) for E/BE tiles; tile 0 also stores b = rmsnorm(h)
        -- grid barrier --
                 every program: the top-k of every token from the logits, once (router.select_experts_rows)
        phase 1  moe_experts.gate_up_tile  SwiGLU rows of the selected experts and the shared expert
        -- grid barrier --
        phase 2  moe_experts.down_tile     the experts' down rows, combined with the routing weights, + residual

Built to test whether the three-kernel block's 18.3 us per layer (run G, against a 4.5 us weight-bytes roofline) was
the cost of its launches. It was not: in the step on the H200 this kernel took 28-29 us per layer, and 17.6 us with
its barriers removed (run H, docs/BENCHMARKS.md), so it is off by default (`moe_experts.PERSISTENT`).

The grid is `grid_sync.resident_programs()` programs that each take a round-robin share of every phase's tiles; the
phases hand over through small buffers (logits 1 KB, b 4 KB, activations 7 KB per token) and the grid barriers of
grid_sync.py. Used for M <= PERSISTENT_MAX_ROWS tokens: more
tokens give each program many tiles in series, where separate launches keep more loads in flight.

The buffers b and the activations are kept in the layout the NVFP4 tiles read (`wt.x_shape`: [M, K/16, 16]), so
the writers reshape their tile once and the K loops read plain slices.

In interpret mode the phases run as three pallas_calls of this same kernel (a barrier cannot work when programs run
one after another, grid_sync.py); the compiled GPU tests run the one-launch kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax.config import FlintConfig
from flint_jax.pallas_kernels import grid_sync as gs
from flint_jax.pallas_kernels import moe_experts as X
from flint_jax.pallas_kernels import router as router_mod
from flint_jax.pallas_kernels import weight_tiles as wt

F32, BF16 = jnp.float32, jnp.bfloat16
PERSISTENT_MAX_ROWS = 2
# (rows per tile, K tile): gate/up 16 rows (the NVFP4 activation store writes whole 16-value groups), 224 tiles for
# Flint at M = 1; down 8 rows, 256 tiles; router 2 experts, 128 tiles: about one tile per program of each phase.
GATE_UP_TILE = (16, 1024)
DOWN_TILE = (8, 512)
ROUTER_TILE = (2, 2048)
NUM_WARPS = 4  # grid_sync.PROGRAMS_PER_SM relies on it
# Diagnostic only (profile variant "persistent_no_barrier"): without the barriers the results are wrong; the
# timing shows what the barriers cost.
BARRIERS = True


def _kernel(*refs, n_ops, phases, barrier, programs, m, mp, k, kp, norm, scaling, eps, has_norm, kind, g_spec, s_spec,
            d_spec, sd_spec, router_tile, gate_up_tile, down_tile):
    # operands (moe_block_persistent's order), then the buffers: aliased inputs (if any) and the five outputs
    h_ref, nw_ref, r_ref, bias_ref, *w = refs[:n_ops]
    logits_ref, b_ref, act_ref, out_ref, sync_ref = refs[-5:]
    ng, nd = g_spec.num_operands, d_spec.num_operands
    shared = s_spec is not None
    gate, up, w = w[:ng], w[ng:2 * ng], w[2 * ng:]
    sgate, sup, w = (w[:ng], w[ng:2 * ng], w[2 * ng:]) if shared else ((), (), w)
    down, sdown = w[:nd], w[nd:]
    nvfp4_layout = kind == "nvfp4"

    def store_rows(ref):
        """store(row, start, values [n]) into a [R, K] buffer, or its [R, K/16, 16] NVFP4 layout."""
        def store(row, start, values):
            if nvfp4_layout:
                n = values.shape[0]
                ref[row, pl.ds(start // wt.GROUP, n // wt.GROUP), :] = values.reshape(n // wt.GROUP, wt.GROUP)
            else:
                ref[row, pl.ds(start, values.shape[0])] = values
        return store

    if 0 in phases:
        be, bk = router_tile
        gs.for_tiles(r_ref.shape[1] // be, programs, lambda j: router_mod.logits_tile(
            j, h_ref, nw_ref, r_ref, logits_ref, store_rows(b_ref), mp=mp, be=be, bk=bk, eps=eps,
            has_norm=has_norm))
    if barrier and BARRIERS and 1 in phases:
        gs.grid_barrier(sync_ref, 0, programs)
    if 1 in phases or 2 in phases:
        logits = plt.load(logits_ref, volatile=True)  # written by other programs of this launch
        ids, ws = router_mod.select_experts_rows(logits, bias_ref[...], k, kp, norm, scaling)
        token = X.routing_from_rows(ids, ws, k)
    if 1 in phases:
        bn, bk = gate_up_tile
        blocks = g_spec.n // bn
        pairs = m * (k + int(s_spec is not None))
        gs.for_tiles(pairs * blocks, programs, lambda i: X.gate_up_tile(
            i // blocks, i % blocks, token, wt.XSource(b_ref, kind), g_spec, gate, up, s_spec, sgate, sup,
            store_rows(act_ref), m=m, k=k, bn=bn, bk=bk, elementwise=False, prefetch=False))
    if barrier and BARRIERS and 2 in phases:
        gs.grid_barrier(sync_ref, 1, programs)
    if 2 in phases:
        bn, bk = down_tile
        blocks = d_spec.n // bn

        def store_out(t, n0, values):
            out_ref[t, pl.ds(n0, bn)] = values

        gs.for_tiles(m * blocks, programs, lambda i: X.down_tile(
            i // blocks, i % blocks, token, wt.XSource(act_ref, kind), d_spec, down, sd_spec, sdown, h_ref,
            store_out, m=m, k=k, bn=bn, bk=bk))


def _tile(block, n: int, k: int, kind: str) -> tuple[int, int]:
    bn, bk = block
    return wt.largest_pow2_divisor(n, bn), wt.k_tile(wt.WeightSpec(kind, 1, n, k), bk)


def moe_block_persistent(h: jax.Array, layer, cfg: FlintConfig, *, interpret: bool = False,
                         programs: int | None = None, with_sync: bool = False):
    """`layers.mlp_block(h, layer, cfg)` for an MoE layer in one kernel; h [..., H] bf16 with at most
    PERSISTENT_MAX_ROWS rows. programs: the grid (default grid_sync.resident_programs(); tests use small ones to
    give programs several tiles). with_sync: also return the barrier buffer (sync[grid_sync.TIMEOUT_SLOT] must be 0)."""
    lead = h.shape[:-1]
    flat = h.reshape(-1, h.shape[-1])
    m, hidden = flat.shape
    if not 1 <= m <= PERSISTENT_MAX_ROWS:
        raise ValueError(f"the persistent MoE kernel serves 1..{PERSISTENT_MAX_ROWS} rows, got {m}")
    moe = layer.mlp
    k = cfg.num_experts_per_tok
    mp, kp = wt.pow2_rows(m), wt.pow2_rows(k)
    g_spec, g_ops = wt.weight_operands(moe.gate, stacked=True)
    _, u_ops = wt.weight_operands(moe.up, stacked=True)
    d_spec, d_ops = wt.weight_operands(moe.down, stacked=True)
    s_spec, shared_gate_up, sd_spec, shared_down = X.shared_expert_operands(moe)
    kind = g_spec.kind
    if d_spec.kind != kind:
        raise NotImplementedError("gate/up and down weights of one kind")
    e = moe.router.shape[0]
    pairs = m * (k + int(s_spec is not None))
    hp = wt.pad_rows(flat.astype(BF16), mp)
    norm_weight = layer.mlp_norm
    nw = norm_weight.astype(BF16) if norm_weight is not None else jnp.ones((hidden,), BF16)
    operands = [hp, nw, moe.router[None].astype(F32), moe.router_bias.astype(F32), *g_ops, *u_ops, *shared_gate_up,
                *d_ops, *shared_down]
    gate_up = _tile(GATE_UP_TILE, g_spec.n, hidden, kind)
    if kind == "nvfp4" and gate_up[0] % wt.GROUP:
        raise NotImplementedError(f"NVFP4 gate/up tiles store whole {wt.GROUP}-value groups: I={g_spec.n}")
    bufs = [jax.ShapeDtypeStruct((mp, e), F32), jax.ShapeDtypeStruct(wt.x_shape(mp, hidden, kind), BF16),
            jax.ShapeDtypeStruct(wt.x_shape(pairs, g_spec.n, kind), BF16), jax.ShapeDtypeStruct((mp, hidden), BF16),
            jax.ShapeDtypeStruct((gs.SYNC_SLOTS,), jnp.int32)]
    programs = programs or (4 if interpret else gs.resident_programs())
    kernel = functools.partial(
        _kernel, n_ops=len(operands), programs=programs, m=m, mp=mp, k=k, kp=kp, norm=bool(cfg.norm_topk_prob),
        scaling=float(cfg.routed_scaling_factor), eps=float(cfg.rms_norm_eps), has_norm=norm_weight is not None,
        kind=kind, g_spec=g_spec, s_spec=s_spec, d_spec=d_spec, sd_spec=sd_spec,
        router_tile=(wt.largest_pow2_divisor(e, ROUTER_TILE[0]), wt.largest_pow2_divisor(hidden, ROUTER_TILE[1])),
        gate_up_tile=gate_up, down_tile=_tile(DOWN_TILE, hidden, g_spec.n, kind))

    def call(phases, barrier, state):
        """One pallas_call running `phases`; state: the five buffers passed in (aliased) or None (fresh outputs,
        except the zeroed barrier buffer)."""
        ins = list(operands) + (list(state) if state is not None else [gs.sync_buffer()])
        first = len(operands)
        aliases = ({first + i: i for i in range(5)} if state is not None else {first: 4})
        return pl.pallas_call(
            functools.partial(kernel, phases=phases, barrier=barrier),
            out_shape=bufs, grid=(programs,), input_output_aliases=aliases,
            compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1), interpret=interpret,
            name=f"moe_persistent_{kind}" if barrier else f"moe_phase{''.join(map(str, phases))}_{kind}",
        )(*ins)

    if interpret:
        state = [jnp.zeros(b.shape, b.dtype) for b in bufs]
        for phase in (0, 1, 2):
            state = call((phase,), False, state)
    else:
        state = call((0, 1, 2), True, None)
    out = state[3][:m].reshape(*lead, -1)
    return (out, state[4]) if with_sync else out
