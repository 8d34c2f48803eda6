"""`impl="pallas"`: the halves of a layer built from fused Pallas kernels.

Decode (T = 1) uses the attention kernels (prologue: norm + QKV + Q/K norm + RoPE + KV write; decode attention with
sinks; output projection + residual) and the weight-streaming MLP kernels (router, routed + shared experts, dense
SwiGLU). Prefill chunks (T > 1) use the prefill kernels. Where a kernel is missing the reference block runs instead;
`coverage()` says which, and the engine and benchmarks print it.

On a CPU backend the kernels run in Pallas interpret mode (how CI tests them); on the GPU they compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math

import jax

from flint_jax import layers as L

_interpret_override: bool | None = None


def _interpret() -> bool:
    if _interpret_override is not None:
        return _interpret_override
    return jax.default_backend() != "gpu"


@contextlib.contextmanager
def lowering_for_gpu():
    """Trace the kernels as compiled GPU kernels even on a CPU host: for exporting or inspecting the GPU program
    (e.g. counting its kernels) where no GPU is attached."""
    global _interpret_override
    saved, _interpret_override = _interpret_override, False
    # Without a GPU attached, Pallas' Triton lowering asks for a device description; describe an H200 (private API,
    # used only by this inspection helper).
    from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg
    # Mosaic GPU kernels (plgpu.kernel) lower through a rule that only the CUDA plugin imports; import it here.
    importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")
    saved_info = reg.gpu_info_lib.get_gpu_info
    if jax.default_backend() != "gpu":
        reg.gpu_info_lib.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    try:
        yield
    finally:
        _interpret_override = saved
        reg.gpu_info_lib.get_gpu_info = saved_info


def _optional(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


@functools.cache
def _kernels() -> dict:
    return {
        "decode_attention": _optional("flint_jax.pallas_kernels.decode_attention", "attention_block_decode"),
        "decode_mlp": _optional("flint_jax.pallas_kernels.moe_experts", "mlp_block"),
        "prefill_attention": _optional("flint_jax.prefill", "attention_block"),
        "prefill_mlp": _optional("flint_jax.prefill", "mlp_block"),
    }


def coverage() -> dict[str, str]:
    """For each block of the Pallas path: "pallas" or "reference (kernel missing)"."""
    return {k: "pallas" if v is not None else "reference (kernel missing)" for k, v in _kernels().items()}


def kernel_census(cfg, weights: str = "nvfp4", batch: int = 1, impl: str = "pallas", max_len: int = 4096,
                  stacked_params: bool = False, stacked_caches: bool = False) -> dict:
    """What one decode step launches on a GPU, found without one: the step is lowered for CUDA (abstract parameters,
    nothing allocated; the layers' parameters stacked with `stacked_params` (layer_stack), the caches with
    `stacked_caches` (state.StackedCaches)). Returns {"pallas_kernels": n, "by_kernel": {name: n},
    "other_hlo_ops": n, "other_by_op": {op: n}, "argument_buffers": n}; the other ops are XLA glue that the device
    compiler fuses into an unknown (smaller) number of kernels; the argument buffers are what the host hands over
    per call (parameters and state)."""
    import collections
    import re

    import jax.numpy as jnp

    from flint_jax import model as M
    from flint_jax.params import abstract_params
    from flint_jax.state import init_state

    params = abstract_params(cfg, weights)
    if stacked_params:
        from flint_jax.layer_stack import stack_layers
        params = jax.eval_shape(stack_layers, params)
    state = jax.eval_shape(lambda: init_state(cfg, batch, max_len, stacked=stacked_caches))

    def step(params, state, tokens):
        return M.model_step(params, state, tokens[:, None], jnp.ones_like(tokens), cfg, impl=impl)

    with lowering_for_gpu():
        text = jax.jit(step).trace(params, state, jax.ShapeDtypeStruct((batch,), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = collections.Counter(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))
    names = collections.Counter(re.findall(r'name = "(\w+)", num_stages', text))
    free = {"reshape", "bitcast_convert", "get_tuple_element", "tuple", "constant", "return", "optimization_barrier",
            "custom_call"}
    ops = collections.Counter(re.findall(r"= stablehlo\.(\w+)", text))
    return {"pallas_kernels": sum(n for c, n in calls.items() if "triton" in c or "mosaic" in c),
            "by_kernel": dict(names.most_common()),
            "other_hlo_ops": sum(n for op, n in ops.items() if op not in free),
            "other_by_op": {op: n for op, n in ops.most_common() if op not in free},
            "argument_buffers": len(jax.tree.leaves(params)) + len(jax.tree.leaves(state))}


def _decode_attention(h, layer, cache, positions, valid, lengths_after, cfg, sliding):
    fn = _kernels()["decode_attention"]
    out, cache = fn(h[:, 0], layer, cache, positions[:, 0], valid[:, 0], cfg, sliding, interpret=_interpret())
    return out[:, None], cache


def _decode_mlp(h, layer, cfg):
    return _kernels()["decode_mlp"](h[:, 0], layer, cfg, interpret=_interpret())[:, None]


# The LM head. An NVFP4 head tiled for the Mosaic GPU kernel (engine_layout) runs `mosaic_nvfp4.lm_head_logits`
# for every row count (8 rows per launch; the final norm is one XLA fusion before it): 59.6 us for Flint's head
# against 80.3 us for the Triton `gemv_logits` (run DA, docs/BENCHMARKS.md). Untiled NVFP4 heads run
# gemv.gemv_logits (final norm fused) at up to LM_HEAD_KERNEL_MAX_ROWS rows (FMA path) and from
# gemv.TABLE_DOT_MIN_ROWS rows on (tensor-core path), where it was measured ahead of XLA, which first writes a 620 MB
# BF16 copy of the 175 MB NVFP4 head: 2.75x faster than XLA at one row (run J); at 8 rows 120 us against XLA's
# 381 us (convert, concatenate, GEMM), served step 6.507 -> 6.250 ms at 8K (run BL); 5-7 rows run the same kernel
# on x padded to 8 rows (not timed). 3-4 rows were not measured and stay on XLA; so do BF16 heads (XLA's GEMM is as
# fast).
LM_HEAD_KERNEL_MAX_ROWS = 2


def lm_head_kernel_rows(rows: int) -> bool:
    """Whether an untiled NVFP4 LM head of `rows` rows runs the Triton kernel (the rule above)."""
    from flint_jax.pallas_kernels import gemv, weight_tiles
    dot_from = gemv.TABLE_DOT_MIN_ROWS  # compared, as gemv does, with the rows padded to a power of two
    return rows <= LM_HEAD_KERNEL_MAX_ROWS or (dot_from is not None and weight_tiles.pow2_rows(rows) >= dot_from)


def engine_layout(params, delete: bool = False, progress=None, tile_lm_head: bool | None = None):
    """The parameters as the Pallas decode path runs fastest on them: the layers stacked
    (`layer_stack.stack_layers`: ~190 buffers per decode call for Flint instead of ~1,930) and an NVFP4 LM head
    tiled for the Mosaic GPU kernel (`nvfp4_tiles.pack`, lossless; by default on a GPU backend, where the kernel
    is compiled; `model.lm_logits(impl="xla")` reads the tiles back). delete: free the arrays that were copied (the
    `params` passed in are unusable afterwards)."""
    from flint_jax.layer_stack import stack_layers
    sp = stack_layers(params, delete=delete, progress=progress)
    if not (jax.default_backend() == "gpu" if tile_lm_head is None else tile_lm_head):
        return sp
    head = sp.lm_head
    tiles = tiled_lm_head(head)
    if delete and tiles is not head:
        jax.block_until_ready(tiles)
        for a in (head.codes, head.scales):
            if isinstance(a, jax.Array) and not a.is_deleted():
                a.delete()
    return dataclasses.replace(sp, lm_head=tiles)


def tiled_lm_head(head):
    """An NVFP4 LM head whose shape tiles, packed for `mosaic_nvfp4.lm_head_logits`; any other head as it is."""
    from flint_jax import nvfp4_tiles
    from flint_jax.nvfp4 import NVFP4Weight
    if isinstance(head, NVFP4Weight) and nvfp4_tiles.supports(head.shape):
        return jax.jit(nvfp4_tiles.pack)(head)
    return head


def lm_logits(params, h, cfg):
    """`model.lm_logits` on the Pallas path: FP32 logits of h [..., H]."""
    from flint_jax.nvfp4 import NVFP4Weight
    from flint_jax.nvfp4_tiles import NVFP4Tiles
    lead = h.shape[:-1]
    rows = math.prod(lead)
    if isinstance(params.lm_head, NVFP4Tiles):
        from flint_jax.pallas_kernels import mosaic_nvfp4
        x = L.rmsnorm(h.reshape(rows, h.shape[-1]), params.final_norm, cfg.rms_norm_eps)
        return mosaic_nvfp4.lm_head_logits(x, params.lm_head, interpret=_interpret()).reshape(*lead, -1)
    if not isinstance(params.lm_head, NVFP4Weight) or not lm_head_kernel_rows(rows):
        return L.logits_from_hidden(h, params.final_norm, params.lm_head, cfg.rms_norm_eps)
    from flint_jax.pallas_kernels import gemv
    out = gemv.gemv_logits(h.reshape(rows, h.shape[-1]), params.lm_head, norm_weight=params.final_norm,
                           eps=cfg.rms_norm_eps, interpret=_interpret())
    return out.reshape(*lead, -1)


# Decode steps of the Pallas path sample with the top-k kernels (pallas_kernels/top_k_sampling.py) instead of sorting
# the vocabulary, when every row allows it (greedy, or 1 <= top_k <= K_MAX: Flint's default top_k is 20); the
# engine and the benchmarks choose per call (`engine.decode_sampler`). A knob so the whole step can time both
# (scripts/profile_decode.py variant `sort_sampling`).
TOP_K_SAMPLING = True


def sample_top_k(logits, keys, temperature, top_k, top_p):
    """`sampling.sample` for rows that `top_k_sampling.supports`, by the top-k kernels."""
    from flint_jax.pallas_kernels import top_k_sampling
    return top_k_sampling.sample_top_k(logits, keys, temperature, top_k, top_p, interpret=_interpret())


def _padded_rows(batch: int) -> int:
    """The decode kernels take 1, 2, 4 or 8 rows: at 3 or 5-7 sequences h carries padding rows through the whole
    step (model.run_layers pads it once), so no kernel pads its input or slices its output. Measured on the H200
    (scripts/profile_decode.py, batch 3 at 8K, docs/BENCHMARKS.md runs EB-EC): before, ~340 pad and copy kernels
    per step, ~370 us of a 3.65 ms step, slower than batch 4; with the padding rows 3.44 ms."""
    from flint_jax.pallas_kernels.weight_tiles import pow2_rows
    return pow2_rows(batch)


def blocks(T: int):
    """The (attention, mlp) halves for chunks of T tokens."""
    from flint_jax.model import Blocks, attention_block
    k = _kernels()
    if T == 1:
        both = bool(k["decode_attention"] and k["decode_mlp"])
        return Blocks(attention=_decode_attention if k["decode_attention"] else attention_block,
                      mlp=_decode_mlp if k["decode_mlp"] else L.mlp_block,
                      takes_layer_slices=both, rows=_padded_rows if both else None)
    attention = (functools.partial(k["prefill_attention"], interpret=_interpret()) if k["prefill_attention"]
                 else attention_block)
    mlp = functools.partial(k["prefill_mlp"], interpret=_interpret()) if k["prefill_mlp"] else L.mlp_block
    return Blocks(attention=attention, mlp=mlp)
