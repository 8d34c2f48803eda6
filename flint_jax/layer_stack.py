"""The per-layer parameters stacked into a few large buffers, for a decode step that the host can dispatch cheaply.

A jitted step takes every array of its arguments as a separate device buffer, and the host pays for each one on
every call (~3 us per buffer on the H200 machine, run AS in docs/BENCHMARKS.md: 1,796 NVFP4 weight buffers cost
~5.5 ms per step, more than the device needs for the step). `stack_layers(params)` turns the 49 layers' arrays into
one stack per parameter position (`attn.q.codes` of every layer in one [n, ...] array), split into chunks of at most
`MAX_CHUNK_BYTES`: 55 stacks for NVFP4 Flint, and 194 argument buffers per decode call with the state instead of
1,930 (runs BM-BO, docs/BENCHMARKS.md).

Inside a traced step, `StackedParams.layers` gives each layer's parameters as plain arrays (static slices of the
stacks: what the reference path and the prefill path read), and `layer_slices()` gives them as `LayerSlice`s: the
stack and the layer's index, which the decode kernels take whole and index through a BlockSpec
(`kernel_args`), so no per-layer copy is made. A slice materialised for an XLA op is a copy where XLA cannot fuse
it into its consumer (the XLA reference path on stacked parameters pays that: run it on unstacked `Params`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax.params import Params

# Pallas' Triton lowering computes a kernel's load offsets (in elements) in 32-bit integers for operands up to 4 GiB
# and in 64-bit ones above (more instructions per load); Triton's pointer arithmetic sign-extends 32-bit offsets, so an
# element at 2^31 or beyond would be read from the wrong address. Chunks stay under 2 GiB: every offset is in range
# for any element size, and no kernel pays for 64-bit offsets.
MAX_CHUNK_BYTES = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer `index` of a stacked parameter `stack` [n, *shape]; with `keep_axis` it stands for the slice with a
    leading axis of 1 ([1, *shape], the `x[None]` of the layer's array)."""
    stack: jax.Array
    index: int = dataclasses.field(metadata=dict(static=True))
    keep_axis: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return ((1,) if self.keep_axis else ()) + tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def astype(self, dtype) -> "LayerSlice":
        if jnp.dtype(dtype) != self.dtype:
            raise TypeError(f"a stacked {self.dtype} parameter cannot be cast to {jnp.dtype(dtype)} without a copy")
        return self

    def reshape(self, *shape) -> "LayerSlice":
        """The same layer of the stack with its per-layer shape changed (a free reshape of the whole stack)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"cannot reshape a layer slice of shape {self.shape} to {shape}")
        if self.keep_axis:
            if shape[:1] != (1,):
                raise ValueError(f"a slice with its leading axis kept must stay [1, ...], got {shape}")
            shape = shape[1:]
        return LayerSlice(self.stack.reshape(self.stack.shape[0], *shape), self.index, self.keep_axis)

    def expand(self) -> "LayerSlice":
        """`x[None]`: the layer's array with a leading axis of 1."""
        if self.keep_axis:
            raise ValueError("the slice already has its leading axis")
        return LayerSlice(self.stack, self.index, True)

    def value(self) -> jax.Array:
        """The layer's array (an XLA slice of the stack)."""
        v = self.stack[self.index]
        return v[None] if self.keep_axis else v

    def block_spec(self):
        """The BlockSpec that hands a kernel this layer's array out of the whole stack."""
        from jax.experimental import pallas as pl
        rest = tuple(self.stack.shape[1:])
        index, zeros = self.index, (0,) * len(rest)
        lead = 1 if self.keep_axis else pl.squeezed
        return pl.BlockSpec((lead, *rest), lambda *_: (index, *zeros))


def is_slice(x) -> bool:
    return isinstance(x, LayerSlice)


def value(x):
    """x as an array: a LayerSlice's layer, anything else unchanged."""
    return x.value() if isinstance(x, LayerSlice) else x


def materialize(tree):
    """A tree with every LayerSlice replaced by the layer's array."""
    return jax.tree.map(value, tree, is_leaf=is_slice)


def kernel_args(args: Sequence[Any], specs: Sequence[Any] | None = None) -> tuple[list, list]:
    """(operands, in_specs) for a pallas_call: a LayerSlice passes its whole stack with a BlockSpec that selects its
    layer; any other operand passes as is with `specs[i]` (default: the whole array)."""
    from jax.experimental import pallas as pl
    ops, in_specs = [], []
    for i, a in enumerate(args):
        if isinstance(a, LayerSlice):
            ops.append(a.stack)
            in_specs.append(a.block_spec())
        else:
            ops.append(a)
            in_specs.append(pl.no_block_spec if specs is None or specs[i] is None else specs[i])
    return ops, in_specs


def aliased_output(x) -> tuple[jax.ShapeDtypeStruct, Any]:
    """(out_shape, out_spec) of a kernel output written in place over input x (input_output_aliases): for a
    LayerSlice the whole stack, with the BlockSpec of its layer, so the kernel writes only that layer."""
    from jax.experimental import pallas as pl
    if isinstance(x, LayerSlice):
        return jax.ShapeDtypeStruct(x.stack.shape, x.stack.dtype), x.block_spec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype), pl.no_block_spec


def like(out: jax.Array, x):
    """A kernel's aliased output in the form of its input x: the new stack as the same layer's LayerSlice."""
    return LayerSlice(out, x.index, x.keep_axis) if isinstance(x, LayerSlice) else out


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each layer's arrays live: per layer its tree structure and, per leaf, (stack number, index)."""
    layers: tuple[tuple[Any, tuple[tuple[int, int], ...]], ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedParams:
    """`Params` with the layers' arrays stacked (`stack_layers`). `embed`, `final_norm` and `lm_head` as in Params."""
    embed: jax.Array
    final_norm: jax.Array
    lm_head: Any
    stacks: tuple[jax.Array, ...]
    layout: _Layout = dataclasses.field(metadata=dict(static=True))

    def layer_slices(self) -> tuple:
        """Each layer's parameter tree with LayerSlice leaves (for the decode kernels)."""
        return tuple(treedef.unflatten([LayerSlice(self.stacks[s], i) for s, i in where])
                     for treedef, where in self.layout.layers)

    @property
    def layers(self) -> tuple:
        """Each layer's parameter tree with plain arrays (slices of the stacks), as `Params.layers`."""
        return tuple(materialize(layer) for layer in self.layer_slices())


def _chunks(n_bytes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive runs of items whose byte sizes add up to at most `limit` (an item alone may exceed it)."""
    runs, cur, total = [], [], 0
    for i, b in enumerate(n_bytes):
        if cur and total + b > limit:
            runs.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += b
    if cur:
        runs.append(cur)
    return runs


def stack_layers(params: Params, delete: bool = False, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 progress=None) -> StackedParams:
    """Stack the layers' arrays position by position (layers whose arrays agree in shape and dtype at a position
    share its stacks), in chunks of at most max_chunk_bytes. `delete=True` frees each layer array once it is copied
    into its stack, so stacking a model that fills the device needs one chunk of headroom, not a second model (the
    `params` passed in are unusable afterwards). `progress(done, total)` is called after each stack."""
    if isinstance(params, StackedParams):
        return params
    flat = [jax.tree_util.tree_flatten_with_path(layer) for layer in params.layers]
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for li, (leaves, _) in enumerate(flat):
        for j, (path, a) in enumerate(leaves):
            key = (jax.tree_util.keystr(path), tuple(a.shape), str(a.dtype))
            groups.setdefault(key, []).append((li, j))
    where: list[list] = [[None] * len(leaves) for leaves, _ in flat]
    stacks: list[jax.Array] = []
    plan = []
    for members in groups.values():
        sizes = [flat[li][0][j][1].size * flat[li][0][j][1].dtype.itemsize for li, j in members]
        plan.extend([members[i] for i in run] for run in _chunks(sizes, max_chunk_bytes))
    for done, run in enumerate(plan):
        arrays = [flat[li][0][j][1] for li, j in run]
        stacked = jnp.stack(arrays) if isinstance(arrays[0], jax.Array) else np.stack(arrays)
        for pos, (li, j) in enumerate(run):
            where[li][j] = (len(stacks), pos)
        stacks.append(stacked)
        if delete:
            jax.block_until_ready(stacked)
            for a in arrays:
                if isinstance(a, jax.Array) and not a.is_deleted():
                    a.delete()
        if progress is not None:
            progress(done + 1, len(plan))
    layout = _Layout(tuple((treedef, tuple(w)) for (_, treedef), w in zip(flat, where)))
    return StackedParams(embed=params.embed, final_norm=params.final_norm, lm_head=params.lm_head,
                         stacks=tuple(stacks), layout=layout)


def unstack_layers(sp: StackedParams) -> Params:
    """The plain `Params` again (copies every layer's arrays out of the stacks)."""
    return Params(embed=sp.embed, layers=sp.layers, final_norm=sp.final_norm, lm_head=sp.lm_head)
