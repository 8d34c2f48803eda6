"""`flint-convert SRC DST`: convert a Flint GGUF file or HF BF16 directory into a checkpoint that
`flint_jax.load` reads straight into the kernel layout. Exit codes: 0 done, 1 error (one line naming the file and
tensor), 2 usage."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flint-convert",
        description="Convert a Flint checkpoint (GGUF file with NVFP4/BF16/F16/F32 tensors, or Hugging Face BF16 "
                    "directory) into a converted checkpoint (Orbax, kernel layout, with config and a manifest of "
                    "tensor names, dtypes, shapes and source sha256). NVFP4 is repacked losslessly. Streams one "
                    "tensor at a time; DST appears only when the conversion succeeded.",
        epilog="exit codes: 0 success, 1 error (a one-line message naming the file and tensor), 2 usage")
    p.add_argument("src", metavar="SRC", help="a .gguf file or a Hugging Face directory (config.json + safetensors)")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="config.json that overrides the checkpoint's (GGUF metadata contradicting it is an error)")
    p.add_argument("--quantize", choices=["nvfp4"],
                   help="quantize BF16 linear weights to NVFP4 (ggml's reference rounding, power-of-two global "
                        "scales); NVFP4 weights are always kept as they are")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--no-checksums", action="store_true", help="skip the sha256 of source tensors")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # usage errors exit 2
    import flint_jax  # noqa: F401  (sets XLA flags before JAX starts)
    from flint_jax.convert.errors import CheckpointError
    from flint_jax.convert.to_orbax import convert
    try:
        summary = convert(args.src, args.dst, config=args.config, quantize=args.quantize, overwrite=args.overwrite,
                          progress=not args.quiet, checksums=not args.no_checksums)
    except CheckpointError as e:
        print(f"flint-convert: error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"flint-convert: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flint-convert: interrupted; nothing written", file=sys.stderr)
        return 130
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
