"""What the CLIs run: a model (config + params) with its tokenizer and stop tokens, from a path or 'default'."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from flint_jax.config import FlintConfig
from flint_jax.params import Params


class ByteTokenizer:
    """UTF-8 bytes as token ids: the tokenizer of the random-weight fallback model (vocab 256). It has the
    `token_bytes` method that flint_jax.chat.IncrementalDecoder streams from, but no chat special tokens."""

    vocab_size = 256
    stop_token_ids = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int, skip_special_tokens: bool = False) -> bytes:
        return bytes([token])


@dataclasses.dataclass
class Runtime:
    cfg: FlintConfig
    params: Params
    tokenizer: Any  # encode(text) -> ids, decode(ids) -> text, incremental_decoder()
    stop_token_ids: tuple[int, ...]
    description: str
    chat_template: str | None = None
    default_tools: list | None = None  # tools offered when the user names none (the demo model's own)


def random_tiny_runtime(seed: int = 0) -> Runtime:
    cfg = FlintConfig.tiny()
    from flint_jax.params import init_params
    return Runtime(cfg, init_params(cfg, jax.random.key(seed)), ByteTokenizer(), stop_token_ids=(),
                   description="FlintConfig.tiny() with RANDOM weights and a byte tokenizer: its output is noise, "
                               "not a trained model")


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
