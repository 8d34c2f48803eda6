"""Peak memory of `flint-convert` on a multi-GB synthetic checkpoint (a benchmark, not a test).

Writes a full-width Flint with a few layers (FlintConfig.flint(num_hidden_layers=N): the real embedding, LM head and
256-expert stacks) as an HF BF16 directory and as an NVFP4 GGUF, then converts each in a fresh process:

    hf         HF BF16 -> Orbax BF16
    hf-nvfp4   HF BF16 -> Orbax NVFP4 (--quantize nvfp4)
    gguf       GGUF NVFP4 (embedding BF16) -> Orbax NVFP4 (lossless repack)

and prints each conversion's summary (tensors, bytes, time, peak RSS from getrusage) next to the largest single
tensor. Usage: .venv/bin/python scripts/convert_peak_rss.py [--layers 4] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/flint_convert_rss")
    ap.add_argument("--cases", default="hf,hf-nvfp4,gguf")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints and outputs")
    args = ap.parse_args()

    import flint_jax  # noqa: F401
    from flint_jax.config import FlintConfig
    from flint_jax.convert import names, write_gguf, write_hf
    from flint_jax.convert.synthetic import synthetic_values

    cfg = FlintConfig.flint(num_hidden_layers=args.layers)
    os.makedirs(args.workdir, exist_ok=True)
    hf, gg = os.path.join(args.workdir, "hf"), os.path.join(args.workdir, "model-nvfp4.gguf")
    import numpy as np
    biggest = max((int(np.prod(e.shape)) * 2, e.path) for e in names.entries(cfg))
    print(f"config: flint(num_hidden_layers={args.layers}); largest tensor {biggest[1]} = {biggest[0] / 2**20:.0f} "
          f"MiB in BF16", flush=True)
    t = time.time()
    if not os.path.isdir(hf):
        write_hf(hf, cfg, synthetic_values(cfg, "bf16"), max_shard_bytes=2 << 30, progress=True)
    if not os.path.isfile(gg):
        write_gguf(gg, cfg, synthetic_values(cfg, "nvfp4"), weights="nvfp4", progress=True)
    du = lambda p: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs) \
        if os.path.isdir(p) else os.path.getsize(p)  # noqa: E731
    print(f"sources: HF {du(hf) / 2**30:.2f} GiB, GGUF {du(gg) / 2**30:.2f} GiB ({time.time() - t:.0f} s)", flush=True)

    cases = {"hf": (hf, []), "hf-nvfp4": (hf, ["--quantize", "nvfp4"]), "gguf": (gg, [])}
    rows = []
    for name in args.cases.split(","):
        src, extra = cases[name]
        dst = os.path.join(args.workdir, f"out-{name}")
        cmd = [sys.executable, "-m", "flint_jax.convert.cli", src, dst, "--overwrite", "--quiet", *extra]
        print("$", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        print(r.stdout.strip(), flush=True)
        rows.append((name, r.stdout.strip()))
        if not args.keep:
            shutil.rmtree(dst)
    if not args.keep:
        shutil.rmtree(hf)
        os.remove(gg)
    print("\n| case | summary |\n|---|---|")
    for name, s in rows:
        print(f"| {name} | {s} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
