"""The model `flint generate` and `flint chat` run when no --model is given: flint-tiny-demo, shipped with the package.

A 6-layer Flint (hidden 128, every architectural feature) trained by `scripts/train_tiny.py` on the project's own
synthetic chat corpus (`flint_jax.corpus`): it reasons in `<think>`, calls three toy tools (calculator,
convert_units, lookup_flight; their definitions are `demo_tools()` and `flint_jax/data/demo_tools.json`) and
answers from their results. The default is the GGUF NVFP4 file, quantized by the project's quantizer; the BF16 GGUF
beside it is the reference. docs/DEMO_MODEL.md has its measured accuracy.
"""

from __future__ import annotations

import functools
import json
import os

from flint_jax.runtime import Runtime

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
NAME = "flint-tiny-demo"
GGUF_FILES = {fmt: os.path.join(DATA_DIR, f"{NAME}-{fmt}.gguf") for fmt in ("nvfp4", "bf16")}
TOOLS_FILE = os.path.join(DATA_DIR, "demo_tools.json")


def runtime(weights: str = "nvfp4") -> Runtime:
    """The embedded demo model (`weights`: "nvfp4", the default, or "bf16") with its tokenizer and stop tokens."""
    if weights not in GGUF_FILES:
        raise ValueError(f"weights must be one of {', '.join(GGUF_FILES)}, got {weights!r}")
    path = GGUF_FILES[weights]
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: the embedded demo model is missing (run scripts/train_tiny.py)")
    cfg, params, tok = _load(path)
    return Runtime(cfg, params, tok, stop_token_ids=tuple(tok.stop_token_ids),
                   description=f"{NAME} {weights.upper()} (embedded, trained by scripts/train_tiny.py; "
                               f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}; its tools: {TOOLS_FILE})",
                   chat_template=tok.chat_template, default_tools=demo_tools(), params_shared=True)


@functools.lru_cache(maxsize=2)
def _load(path: str):
    from flint_jax.chat import FlintTokenizer
    from flint_jax.convert import load
    model = load(path)
    return model.cfg, model.params, FlintTokenizer.from_gguf_metadata(model.tokenizer_metadata)


def demo_tools() -> list[dict]:
    """The tool definitions the demo model was trained with (OpenAI `tools` shape)."""
    with open(TOOLS_FILE, encoding="utf-8") as f:
        return json.load(f)
