"""The `flint` command line: `flint generate` (and `flint chat`, see flint_jax/chat_cli.py).

Exit codes: 0 success, 1 a runtime error (bad model file, bad prompt), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time

from flint_jax.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 = greedy (default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help=f"nucleus mass (default: {DEFAULT_TOP_P})")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"0 = off (default: {DEFAULT_TOP_K})")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="a Flint GGUF file, a Hugging Face directory, a converted checkpoint, or 'default' "
                        "(the model shipped with flint-jax)")
    p.add_argument("--impl", choices=("xla", "pallas"), default=None,
                   help="decode path: the XLA reference or the fused Pallas kernels, which run on the layers' "
                        "parameters stacked into a few buffers: the fast path on a GPU (on a CPU they run in "
                        "Pallas interpret mode, for tests) (default: pallas on a GPU, xla elsewhere)")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest sequence a request may reach (default: min(2048, the model's context))")
    p.add_argument("--steps-per-dispatch", type=steps_per_dispatch_arg, default=1,
                   help="decode steps per device call; tokens then print in bursts of this many. Each call is "
                        "dispatched while the previous one runs; on the H200 (Flint, Pallas, batch 1, 100K prompt) "
                        "4 steps ran at 2.448 ms/token against 2.500 at 1 (docs/BENCHMARKS.md runs DJ, DM), for a "
                        "longer compile of the unrolled steps (default: 1)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="element type of the full-context layers' KV caches: bf16 (the model's own numerics) or "
                        "fp8 (E4M3, saturating, no scale: half the cache memory and half the bytes a long-context "
                        "decode step reads; the sliding layers stay bf16) (default: bf16)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens per prefill call (one compiled program per size); on a GPU with long "
                        "prompts use thousands, e.g. 8192 (default: 256)")


def steps_per_dispatch_arg(text: str) -> int:
    """argparse type of --steps-per-dispatch: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def resolve_impl(args) -> str:
    """--impl; when not given, the fused Pallas kernels on a GPU (compiled there; on the H200 the demo model gives
    the reference's greedy tokens, docs/BENCHMARKS.md run DN) and the XLA reference elsewhere (Pallas' interpret mode
    on a CPU is for tests, ~5x slower)."""
    if args.impl is not None:
        return args.impl
    import jax
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_max_len(args, rt) -> int:
    return args.max_len if args.max_len is not None else min(2048, rt.cfg.max_position_embeddings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flint", description="Run Flint with JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="complete a prompt", description="Complete a raw text prompt.")
    add_model_args(gen)
    gen.add_argument("--prompt", default="Hello", help="prompt text (default: 'Hello')")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as one user turn in the model's chat template (with the model's own tools, "
                          "if it ships any) and print the raw completion, tags included")
    add_sampling_args(gen)
    from flint_jax import chat_cli
    chat_cli.add_parser(sub)
    return parser


def run_generate(args) -> int:
    from flint_jax.chat import IncrementalDecoder
    from flint_jax.engine import Engine
    from flint_jax.runtime import engine_params, load_runtime
    from flint_jax.sampling import SamplingParams

    rt = load_runtime(args.model, announce=lambda m: print(m, file=sys.stderr))
    text = args.prompt
    if args.chat:
        from flint_jax.chat import render
        text = render([{"role": "user", "content": args.prompt}], tools=rt.default_tools,
                      chat_template=rt.chat_template)
    prompt_ids = rt.tokenizer.encode(text)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens, seed=args.seed, stop_token_ids=rt.stop_token_ids)
    impl = resolve_impl(args)
    engine = Engine(rt.cfg, engine_params(rt, impl), max_batch=1, max_len=resolve_max_len(args, rt),
                    impl=impl, steps_per_dispatch=args.steps_per_dispatch, chunk_size=args.prefill_chunk,
                    kv_dtype=args.kv_dtype)
    decoder = IncrementalDecoder(rt.tokenizer)
    sys.stdout.write(args.prompt if not args.chat else "")
    t0 = time.perf_counter()
    result = engine.generate([prompt_ids], sampling,
                             on_token=lambda ev: sys.stdout.write(decoder.feed(ev.token)) and sys.stdout.flush())[0]
    sys.stdout.write(decoder.flush() + "\n")
    dt = time.perf_counter() - t0
    print(f"[{len(result.tokens)} tokens, finish: {result.finish_reason}, TTFT {result.ttft_s * 1e3:.0f} ms, "
          f"{result.decode_ms_per_token:.1f} ms/token, total {dt:.2f} s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "generate":
            return run_generate(args)
        from flint_jax import chat_cli
        return chat_cli.run(args)
    except (ValueError, OSError) as e:
        print(f"flint {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
