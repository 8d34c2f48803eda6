"""What the CLIs run: a model (config + params) with its tokenizer and stop tokens, from a path or 'default'."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flint_jax.config import FlintConfig
from flint_jax.params import Params


@dataclasses.dataclass
class Runtime:
    cfg: FlintConfig
    params: Params
    tokenizer: Any  # a FlintTokenizer: encode, decode, token_bytes (for IncrementalDecoder), stop_token_ids
    stop_token_ids: tuple[int, ...]
    description: str
    chat_template: str | None = None
    params_shared: bool = False  # params are also held elsewhere (a cache): never consume them
    default_tools: list | None = None  # tools offered when the user names none (the demo model's own)


def load_runtime(spec: str, announce: Callable[[str], None] = lambda m: None) -> Runtime:
    """'default' -> the model shipped with flint-jax; otherwise a path that `flint_jax.load` accepts."""
    if spec == "default":
        from flint_jax import default_model
        rt = default_model.runtime()
    else:
        rt = runtime_from_path(spec)
    announce(f"model: {rt.description}")
    return rt


def runtime_from_path(path: str) -> Runtime:
    """A checkpoint on disk (GGUF, Hugging Face directory or converted Orbax) with the tokenizer it carries."""
    import flint_jax
    model = flint_jax.load(path)
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{path}: the checkpoint carries no tokenizer (GGUF tokenizer.ggml.* keys or a "
                         f"tokenizer.json next to config.json)")
    return Runtime(model.cfg, model.params, tok, stop_token_ids=tuple(tok.stop_token_ids),
                   description=f"{path} ({model.cfg.num_hidden_layers} layers)",
                   chat_template=model.chat_template)


def engine_params(rt: Runtime, impl: str):
    """The parameters an Engine with `impl` runs on: for "pallas" `pallas_path.engine_layout`, the layers stacked
    into a few buffers (flint_jax.layer_stack: ~190 buffers per decode call for Flint instead of ~1,930, which the
    host hands over on every step) and an NVFP4 LM head tiled for its Mosaic GPU kernel on a GPU, consuming the
    runtime's per-layer arrays unless they are shared, so a model that fills the device is not held twice; the XLA
    reference keeps the per-layer arrays (slices of stacks would be copies there)."""
    if impl != "pallas":
        return rt.params
    from flint_jax.pallas_path import engine_layout
    rt.params = engine_layout(rt.params, delete=not rt.params_shared)
    return rt.params
