"""Persistent-kernel helpers (Pallas, Triton lowering): a grid-wide barrier and a static round-robin of tiles.

A decode step at batch 1 is a chain of small dependent kernels. A persistent kernel runs several such phases in one
launch: `programs` programs, each looping over its share of a phase's tiles, with a
grid barrier between phases where the next phase reads what other programs wrote.

The barrier is a counter per barrier in a zeroed int32 buffer (`sync`, aliased in and out so that every call gets a
fresh one): each program arrives with one acq_rel atomic add after a CTA barrier (so all its threads' stores are
released), then polls the counter (POLL: volatile loads or atomic adds of 0; both go to L2, never to a stale L1
line) until every program has arrived. This needs every program of the grid resident at once: callers launch at most
`resident_programs()` programs with modest registers and shared memory. If the count is not reached within
SPIN_LIMIT polls (a program that never became resident), the program gives up, adds 1 to `sync[TIMEOUT_SLOT]` and
goes on: the result is then wrong and says so, instead of hanging the GPU. Tests check that slot is 0.

Measured on the H200 (run H, docs/BENCHMARKS.md): with 264 programs a barrier costs ~5 us, more than the kernel
boundary it replaces inside XLA's command buffer.

Interpret mode runs the programs of a grid one after another, so a barrier there would wait forever: callers run
each phase as its own pallas_call in interpret mode (same tile code), and the barrier only on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from flint_jax.pallas_kernels import gemv

SPIN_LIMIT = 1 << 17  # polls of about a microsecond each: ~0.1 s before a barrier gives up
TIMEOUT_SLOT = 3  # sync[TIMEOUT_SLOT] counts barriers given up; slots 0..TIMEOUT_SLOT-1 are barrier counters
SYNC_SLOTS = 4
# How waiting programs poll the counter: "load" = volatile loads (L2, no read-modify-write: hundreds of programs
# polling one address do not queue behind each other), then one acq_rel atomic for the acquire ordering;
# "atomic" = atomic adds of 0 (each poll is an acquire).
POLL = "load"
PROGRAMS_PER_SM = 2  # 4 warps each: two always fit one SM (registers <= 255 per thread, little shared memory)


def resident_programs() -> int:
    """Programs a barrier-synchronised grid may have: PROGRAMS_PER_SM per SM of the default device."""
    sms = getattr(jax.devices()[0], "core_count", None) or gemv.NUM_SMS  # the H200's where the device has none
    return PROGRAMS_PER_SM * int(sms)


def sync_buffer() -> jax.Array:
    return jnp.zeros((SYNC_SLOTS,), jnp.int32)


def grid_barrier(sync_ref, slot: int, programs: int) -> None:
    """Wait until all `programs` programs of the grid have reached barrier `slot` (compiled kernels only)."""
    one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
    where = (zero + slot,)  # a traced index: the lowering's scalar atomic wants one
    plt.debug_barrier()  # every thread's stores of the phase precede the release below
    arrived = plt.atomic_add(sync_ref, where, one) + 1

    def waiting(c):
        count, polls = c
        return (count < programs) & (polls < SPIN_LIMIT)

    def poll(c):
        _, polls = c
        if POLL == "atomic":
            return plt.atomic_add(sync_ref, where, zero), polls + 1
        return jnp.sum(plt.load(sync_ref.at[pl.ds(slot, 1)], volatile=True)), polls + 1

    count, _ = jax.lax.while_loop(waiting, poll, (arrived, zero))
    if POLL != "atomic":
        count = jnp.minimum(count, plt.atomic_add(sync_ref, where, zero))  # acquire: later loads see the phase

    @pl.when(count < programs)
    def _():
        plt.atomic_add(sync_ref, (zero + TIMEOUT_SLOT,), one)

    plt.debug_barrier()  # no thread reads the next phase's inputs before the poll has seen every arrival


def for_tiles(n_tiles: int, programs: int, body) -> None:
    """body(tile) for tiles pid, pid + programs, ... < n_tiles (this program's round-robin share)."""
    pid = pl.program_id(0)
    if n_tiles <= programs:
        pl.when(pid < n_tiles)(lambda: body(pid))  # runs it under the condition
        return
    count = (n_tiles - pid + programs - 1) // programs

    def step(i, c):
        body(pid + i * programs)
        return c
    jax.lax.fori_loop(0, count, step, 0)
