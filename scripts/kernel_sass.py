"""What a weight-streaming kernel compiles to, without a GPU: its Triton IR, and with Triton installed its SASS.

The kernel (`gemv.gemv` or `gemv.gemv_logits` at the given shape, rows and block) is lowered for CUDA on this machine
with an H200 described (`pallas_path.lowering_for_gpu`), and the Triton module Pallas hands to XLA is written to
OUT/NAME.ttir. If the `triton` package is importable (it is not a project dependency: `pip install triton==3.6.0`,
the version on the GPU machine, ~190 MB), the module is compiled for sm_90 with its ptxas and OUT/NAME.sass,
OUT/NAME.ptx and a summary are written: SASS instructions by opcode, registers and spills (cuobjdump). XLA compiles
the same IR with its own Triton build, so details may differ; instruction mixes and spills have matched so far
(docs/KERNELS.md). Counts are static (a loop body counts once); instructions per weight value divide them by the
values a thread takes per K step.

    python scripts/kernel_sass.py --out /tmp/sass --n 2048 --k 4096 --rows 1              # O projection, NVFP4
    python scripts/kernel_sass.py --out /tmp/sass --n 2048 --k 4096 --rows 8 --block 32,256,2,3,1
    python scripts/kernel_sass.py --out /tmp/sass --mode logits --n 151552 --k 2048 --norm
    python scripts/kernel_sass.py --out /tmp/sass --moe three               # every kernel of the MoE block
    python scripts/kernel_sass.py --out /tmp/sass --attention fp8           # a full layer's attention block
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flint_jax  # noqa: E402,F401  (XLA flags before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


@contextlib.contextmanager
def capturing_triton_ir():
    """Within the block, every Pallas Triton kernel lowered appends its Triton IR (text) to the yielded list."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    original = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield captured
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original


@contextlib.contextmanager
def knobs_set(module, knobs: dict):
    """Within the block, the module's attributes set as `knobs` says; restored on exit."""
    saved = {k: getattr(module, k) for k in knobs}
    try:
        for k, v in knobs.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def capture_ttir(mode: str, n: int, k: int, rows: int, weights: str, block, norm: bool) -> tuple[str, object]:
    """(Triton IR text of the kernel, its Blocks), from a CUDA lowering on this machine."""
    from flint_jax import nvfp4
    from flint_jax.pallas_kernels import gemv
    from flint_jax.pallas_kernels import weight_tiles as wt
    from flint_jax.pallas_path import lowering_for_gpu

    if weights == "nvfp4":
        w = jax.eval_shape(lambda: nvfp4.random(jax.random.key(0), (n, k)))
    else:
        w = jax.ShapeDtypeStruct((n, k), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    nw = jax.ShapeDtypeStruct((k,), jnp.bfloat16)
    fn = gemv.gemv_logits if mode == "logits" else gemv.gemv
    with capturing_triton_ir() as captured, lowering_for_gpu():
        jax.jit(lambda x, w, nw: fn(x, w, norm_weight=nw if norm else None, block=block)).trace(
            x, w, nw).lower(lowering_platforms=("cuda",))
    if len(captured) != 1:
        raise SystemExit(f"kernel_sass: expected one Triton kernel, the lowering produced {len(captured)}")
    blocks = gemv.resolve_blocks(wt.WeightSpec(weights, 1, n, k), wt.pow2_rows(rows), 1, block)
    return captured[0], blocks


MOE_VARIANTS = {"three": {}, "persistent": {"PERSISTENT": True}}


def capture_moe_ttirs(variant: str, weights: str, rows: int) -> list[tuple[str, str, int, int]]:
    """(kernel name, Triton IR, num_warps, num_stages) of every kernel of Flint's MoE block (moe_experts.mlp_block
    on one MoE layer at the full shape, abstract parameters) with the knobs of MOE_VARIANTS[variant]."""
    from flint_jax.config import FlintConfig
    from flint_jax.params import init_params
    from flint_jax.pallas_kernels import moe_experts
    from flint_jax.pallas_path import lowering_for_gpu

    cfg = FlintConfig.flint(num_hidden_layers=3)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), weights))
    layer = params.layers[cfg.first_k_dense_replace]
    h = jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.bfloat16)

    def block(h, layer):
        return moe_experts.mlp_block(h, layer, cfg)
    with knobs_set(moe_experts, MOE_VARIANTS[variant]), capturing_triton_ir() as captured, lowering_for_gpu():
        text = jax.jit(block).trace(h, layer).lower(lowering_platforms=("cuda",)).as_text()
    return lowered_calls(text, captured)


# A full layer's attention block (qkv_projection, the fused decode attention, combine, output projection) on a full
# cache of this KV dtype, with these decode_attention knobs.
# name: (cache dtype, decode_attention knobs, state knobs)
ATTENTION_VARIANTS = {
    "bf16": ("bf16", {}, {}),
    # the defaults: FP16 dots, 128-key blocks (runs EQ-ER), V key-major like K (runs EQ-EU's kernel)
    "fp8": ("fp8", {}, {}),
    # V stored transposed: the keys on the dots' M dimension (run EU's first default), or the query heads on M (V^T
    # by trans_b); the first in 256-key blocks (64 KB of K/V per block)
    "fp8_v_transposed": ("fp8", {}, {"FP8_V_TRANSPOSED": True}),
    "fp8_heads_on_m": ("fp8", {"KEYS_AS_M": False}, {"FP8_V_TRANSPOSED": True}),
    "fp8_bk256": ("fp8", {"FP8_BLOCK_K": 256}, {"FP8_V_TRANSPOSED": True}),
    # fewer warps per program (fewer cross-warp reductions and barriers per key block), more splits
    "fp8_w2": ("fp8", {"FP8_NUM_WARPS": 2, "FP8_TARGET_PROGRAMS": 528, "FP8_BLOCK_K": 64}, {}),
    "fp8_w2_bk128": ("fp8", {"FP8_NUM_WARPS": 2, "FP8_TARGET_PROGRAMS": 528, "FP8_BLOCK_K": 128, "NUM_STAGES": 2}, {}),
    "fp8_w1": ("fp8", {"FP8_NUM_WARPS": 1, "FP8_TARGET_PROGRAMS": 1056, "MAX_SPLITS": 256, "FP8_BLOCK_K": 64,
                       "NUM_STAGES": 2}, {}),
    "fp8_as_ep": ("fp8", {"FP8_HALF_SCORES": False, "FP8_HALF_VALUES": False, "FP8_BLOCK_K": 64},
                  {"FP8_V_TRANSPOSED": False}),
}


def lowered_calls(text: str, captured: list) -> list[tuple[str, str, int, int]]:
    """(kernel name, Triton IR, num_warps, num_stages) per Triton kernel of a lowering's text, in program order."""
    calls = re.findall(r'name = "([^"]+)".*?num_stages = (\d+) : i32, num_warps = (\d+) : i32', text, re.S)
    if len(calls) != len(captured):
        raise SystemExit(f"kernel_sass: {len(captured)} Triton modules but {len(calls)} calls in the lowering")
    return [(name, ir, int(warps), int(stages)) for (name, stages, warps), ir in zip(calls, captured)]


def capture_attention_ttirs(variant: str, weights: str, rows: int, context: int) -> list[tuple[str, str, int, int]]:
    """Every kernel of a full layer's decode attention block at the Flint shape (abstract parameters, a full cache
    of `context` tokens) with the cache dtype and knobs of ATTENTION_VARIANTS[variant]."""
    from flint_jax.config import FlintConfig
    from flint_jax.params import init_params
    from flint_jax.pallas_kernels import decode_attention
    from flint_jax.pallas_path import lowering_for_gpu
    from flint_jax import state
    from flint_jax.state import FullCache, kv_dtype_of

    kv_dtype, knobs, state_knobs = ATTENTION_VARIANTS[variant]
    cfg = FlintConfig.flint(num_hidden_layers=7)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), weights))
    layer = params.layers[cfg.full_layers[0]]
    kv = jax.ShapeDtypeStruct((rows, cfg.num_key_value_heads, context, cfg.head_dim), kv_dtype_of(kv_dtype))
    with knobs_set(state, state_knobs):
        transposed = state.values_transposed(kv.dtype)
    vt = jax.ShapeDtypeStruct(kv.shape[:2] + kv.shape[:1:-1], kv.dtype) if transposed else kv
    h = jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((rows,), jnp.int32)
    act = jax.ShapeDtypeStruct((rows,), jnp.bool_)

    def block(h, layer, k, v, pos, act):
        return decode_attention.attention_block_decode(h, layer, FullCache(k=k, v=v), pos, act, cfg, False)
    with knobs_set(decode_attention, knobs), knobs_set(state, state_knobs), capturing_triton_ir() as captured, \
            lowering_for_gpu():
        text = jax.jit(block).trace(h, layer, kv, vt, pos, act).lower(lowering_platforms=("cuda",)).as_text()
    return lowered_calls(text, captured)


def opcode_counts(sass: str) -> collections.Counter:
    """SASS opcodes (predicates and modifiers dropped) of a cuobjdump/Triton listing."""
    counts = collections.Counter()
    for line in sass.splitlines():
        if line.startswith("Function"):
            continue
        m = re.match(r"\S+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", line)  # control codes, predicate, opcode
        if m:
            counts[m.group(1)] += 1
    return counts


def largest_loop(sass: str) -> list[str]:
    """The instructions (full opcodes, modifiers kept, predicates dropped) of the longest loop body of a Triton SASS
    listing: from a label to the last branch back to it. Static: one pass over the body."""
    labels, ops = {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.?\w+):\s*$", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = re.match(r"\S+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)  # control codes, predicate, opcode
        if m and not line.startswith("Function"):
            ops.append((m.group(1), m.group(2)))
    best = (0, -1)
    for i, (op, rest) in enumerate(ops):
        target = re.match(r"\s+`?\(?(\.?\w+)", rest) if op == "BRA" else None
        start = labels.get(target.group(1), i + 1) if target else i + 1
        if start <= i and i - start > best[1] - best[0]:
            best = (start, i)
    return [op for op, _ in ops[best[0]:best[1] + 1]]


def compile_sass(ttir_path: str, num_warps: int, num_stages: int) -> dict:
    """Compile the IR with the installed Triton for sm_90: {"sass", "ptx", "resources"}."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(ttir_path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    sass = kernel.asm.get("sass")
    if sass is None:
        from triton.tools.disasm import get_sass
        sass = get_sass(kernel.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    resources = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), "")
    return {"sass": sass, "ptx": kernel.asm["ptx"], "resources": resources}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for NAME.ttir (and NAME.sass, NAME.ptx)")
    ap.add_argument("--mode", default="linear", choices=("linear", "logits"), help="gemv.gemv or gemv.gemv_logits")
    ap.add_argument("--n", type=int, help="output rows of the weight (required without --moe)")
    ap.add_argument("--k", type=int, help="input features (required without --moe)")
    ap.add_argument("--rows", type=int, default=1, help="activation rows M (1-8)")
    ap.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    ap.add_argument("--block", default=None,
                    help="bn,bk,warps,stages[,dot]: override the block table (dot: 1 for the tensor-core path)")
    ap.add_argument("--norm", action="store_true", help="with the fused RMSNorm prologue")
    ap.add_argument("--name", default=None, help="file name stem (default from the arguments)")
    ap.add_argument("--ttir-only", action="store_true", help="write the IR only, even where Triton is installed")
    ap.add_argument("--moe", default=None, choices=tuple(MOE_VARIANTS),
                    help="instead of one GEMV: every kernel of the MoE block at the Flint shape (three kernels, or "
                         "the fused forms), with registers and spills")
    ap.add_argument("--attention", default=None, choices=tuple(ATTENTION_VARIANTS),
                    help="instead of one GEMV: every kernel of a full layer's decode attention block at the Flint "
                         "shape, on a full cache of this variant's KV dtype and knobs (--rows sequences)")
    ap.add_argument("--context", type=int, default=100_000, help="--attention: the full cache's length")
    args = ap.parse_args(argv)
    if args.moe:
        return block_main(args, f"moe_{args.moe}", capture_moe_ttirs(args.moe, args.weights, args.rows))
    if args.attention:
        return block_main(args, f"attention_{args.attention}",
                          capture_attention_ttirs(args.attention, args.weights, args.rows, args.context))
    if args.n is None or args.k is None:
        ap.error("--n and --k are required (or --moe)")
    block = None
    if args.block:
        parts = [int(v) for v in args.block.split(",")]
        if len(parts) not in (4, 5):
            raise SystemExit("kernel_sass: --block wants bn,bk,warps,stages[,dot]")
        block = tuple(parts[:4]) + ((bool(parts[4]),) if len(parts) == 5 else ())
    name = args.name or f"{args.mode}_{args.weights}_{args.n}x{args.k}_m{args.rows}" + (
        "_b" + "-".join(args.block.split(",")) if args.block else "") + ("_norm" if args.norm else "")
    os.makedirs(args.out, exist_ok=True)
    ttir, blocks = capture_ttir(args.mode, args.n, args.k, args.rows, args.weights, block, args.norm)
    ttir_path = os.path.join(args.out, name + ".ttir")
    with open(ttir_path, "w") as f:
        f.write(ttir)
    print(f"{name}: {blocks}, grid {args.n // blocks.bn}; Triton IR -> {ttir_path}")
    if args.ttir_only:
        return 0
    if importlib.util.find_spec("triton") is None:
        print("triton is not installed here: `pip install triton==3.6.0` (the GPU machine's version) for the SASS")
        return 0
    result = compile_sass(ttir_path, blocks.num_warps, blocks.num_stages)
    for ext in ("sass", "ptx"):
        with open(os.path.join(args.out, f"{name}.{ext}"), "w") as f:
            f.write(result[ext])
    counts = opcode_counts(result["sass"])
    print(f"  resources: {result['resources']}")
    total = sum(counts.values())
    per_thread = blocks.bn * blocks.bk / (blocks.num_warps * 32)  # weight values a thread takes per K step
    print(f"  SASS instructions: {total}; by opcode: " + ", ".join(f"{op} {c}" for op, c in counts.most_common(16)))
    print(f"  {per_thread:g} weight values per thread per K step ({blocks.bn} rows x {blocks.bk} values / "
          f"{blocks.num_warps * 32} threads): {total / per_thread:.1f} static instructions per value (all "
          f"{args.rows} activation rows; a K loop's body counts once)")
    return 0


def block_main(args, prefix: str, kernels) -> int:
    """Write (and with Triton, compile) every kernel of a block: IR, SASS, registers and instruction count."""
    os.makedirs(args.out, exist_ok=True)
    have_triton = importlib.util.find_spec("triton") is not None and not args.ttir_only
    for i, (name, ttir, warps, stages) in enumerate(kernels):
        stem = f"{prefix}_{args.weights}_m{args.rows}_{i}_{name}"
        path = os.path.join(args.out, stem + ".ttir")
        with open(path, "w") as f:
            f.write(ttir)
        line = f"{name}: {warps} warps, {stages} stages; Triton IR -> {path}"
        if have_triton:
            result = compile_sass(path, warps, stages)
            with open(os.path.join(args.out, stem + ".sass"), "w") as f:
                f.write(result["sass"])
            line += f"; {result['resources']}; {sum(opcode_counts(result['sass']).values())} SASS instructions"
            loop = largest_loop(result["sass"])
            if loop:
                top = collections.Counter(loop).most_common(12)
                line += (f"\n  longest loop body: {len(loop)} instructions; by opcode: "
                         + ", ".join(f"{op} {c}" for op, c in top))
        print(line)
    if not have_triton:
        print("triton is not installed here: `pip install triton==3.6.0` (the GPU machine's version) for the SASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
