"""Flint's tokenizer: byte-level BPE (GLM-4.x style) on the `tokenizers` library.

Built from a Hugging Face `tokenizer.json` or from GGUF `tokenizer.ggml.*` metadata, and written back to that
metadata for the GGUF writer. Every Flint chat marker is one special id, so rendered prompts encode exactly.
"""

import codecs
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from flint_jax.chat.tags import ENDOFTEXT, FLINT_SPECIAL_TOKENS, OBSERVATION, STOP_TOKENS, USER
from flint_jax.chat.template import FLINT_CHAT_TEMPLATE

# llama.cpp token types (gguf `tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits by llama.cpp `tokenizer.ggml.pre` name. GLM-4 uses the Llama-3 style split (digits in
# runs of up to 3); the `(?i:...)` spelling is the one GLM's tokenizer.json carries.
_GLM4_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GLM4_SPLIT_CPP = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _GLM4_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_BY_PRE = {"glm4": _GLM4_SPLIT, "chatglm-bpe": _GLM4_SPLIT, "llama-bpe": _GLM4_SPLIT, "qwen2": _QWEN2_SPLIT}
_PRE_BY_SPLIT = {_GLM4_SPLIT: "glm4", _GLM4_SPLIT_CPP: "glm4", _QWEN2_SPLIT: "qwen2"}
GPT2_PRE = "gpt-2"  # no split regex: ByteLevel's built-in GPT-2 pattern
SUPPORTED_PRE = (*_SPLIT_BY_PRE, GPT2_PRE)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table that byte-level BPE tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF_CHAR = _byte_decoder()


class FlintTokenizer:
    """A byte-level BPE tokenizer in which every Flint chat marker is a single special id."""

    def __init__(self, tokenizer: Tokenizer, pre: str | None = None,
                 token_types: Sequence[int] | None = None, chat_template: str | None = None) -> None:
        """Wrap a `tokenizers.Tokenizer` (byte-level BPE). `pre`, `token_types` and `chat_template` are what GGUF
        metadata carried; `chat_template` (None: Flint's own) is what `render(chat_template=...)` should use."""
        if not isinstance(tokenizer.model, models.BPE) or not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise ValueError("FlintTokenizer needs a byte-level BPE tokenizer (BPE model with a ByteLevel decoder)")
        missing = [t for t in FLINT_SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks Flint special tokens: {', '.join(missing)}")
        added = tokenizer.get_added_tokens_decoder()
        special = {a.content for a in added.values() if a.special}
        if not special.issuperset(FLINT_SPECIAL_TOKENS):
            # Markers that are plain vocab entries would be split by the pre-tokenizer; registering them keeps
            # their ids and makes them match whole. Copy first so the caller's object is left as it was.
            tokenizer = Tokenizer.from_str(tokenizer.to_str())
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FLINT_SPECIAL_TOKENS])
            added = tokenizer.get_added_tokens_decoder()
        self._tok = tokenizer
        self.chat_template = chat_template
        self._pre = pre
        self._token_types = list(token_types) if token_types is not None else None
        self._added = {i: (a.content.encode("utf-8"), a.special) for i, a in added.items()}
        self._bytes: dict[int, bytes] = {}
        self.special_token_ids: dict[str, int] = {t: tokenizer.token_to_id(t) for t in FLINT_SPECIAL_TOKENS}
        self.stop_token_ids: tuple[int, ...] = tuple(self.special_token_ids[t] for t in STOP_TOKENS)
        self.eos_token_id: int = self.special_token_ids[ENDOFTEXT]
        self.pad_token_id: int = self.eos_token_id  # GLM pads with <|endoftext|>
        self.vocab_size: int = 1 + max(tokenizer.get_vocab(with_added_tokens=True).values())

    # --- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(cls, source: str | os.PathLike[str]) -> "FlintTokenizer":
        """From a `tokenizer.json` path, or its JSON text (a string starting with '{')."""
        text = str(source)
        if text.lstrip().startswith("{"):
            return cls(Tokenizer.from_str(text))
        return cls(Tokenizer.from_file(os.fspath(source)))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "FlintTokenizer":
        """From GGUF tokenizer metadata: a dict of `tokenizer.ggml.*` keys (lists may be numpy arrays)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ValueError("tokenizer.ggml.model: missing")
        if _as_str(kind) != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: unsupported {_as_str(kind)!r}; only 'gpt2' (byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre")
        if pre is None or _as_str(pre) not in SUPPORTED_PRE:
            raise ValueError(f"tokenizer.ggml.pre: {'missing' if pre is None else repr(_as_str(pre))}; "
                             f"supported: {', '.join(SUPPORTED_PRE)}")
        pre = _as_str(pre)
        tokens = [_as_str(t) for t in _required_list(meta, "tokenizer.ggml.tokens")]
        merges = [_as_str(m) for m in _required_list(meta, "tokenizer.ggml.merges")]
        types = meta.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type: {len(types)} entries for {len(tokens)} tokens")

        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if tok in vocab:
                raise ValueError(f"tokenizer.ggml.tokens: {tok!r} appears at ids {vocab[tok]} and {i}")
            vocab[tok] = i
        pairs = []
        for i, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"tokenizer.ggml.merges[{i}]: expected 'left right', got {merge!r}")
            pairs.append((parts[0], parts[1]))
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs)
        except Exception as e:  # tokenizers raises a bare Exception naming the bad merge
            raise ValueError(f"tokenizer.ggml.merges: {e}") from None
        tok = Tokenizer(bpe)
        _set_byte_level(tok, pre)
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
        template = meta.get("tokenizer.chat_template")
        return cls(tok, pre=pre, token_types=types, chat_template=None if template is None else _as_str(template))

    # --- export ---------------------------------------------------------------------------------------------

    def to_gguf_metadata(self, pad_to: int | None = None) -> dict[str, Any]:
        """The `tokenizer.*` keys a GGUF writer embeds; `pad_to` fills unused ids up to the model's vocab.

        `tokenizer.chat_template` is the template this tokenizer came with, else Flint's own.
        """
        state = json.loads(self._tok.to_str())
        n = max(self.vocab_size, pad_to or 0)
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [UNUSED] * n
        for text, i in state["model"]["vocab"].items():
            tokens[i] = text
            known = self._token_types[i] if self._token_types and i < len(self._token_types) else NORMAL
            types[i] = known if known in (NORMAL, UNUSED, BYTE) else NORMAL
        for i, a in self._tok.get_added_tokens_decoder().items():
            tokens[i], types[i] = a.content, CONTROL if a.special else USER_DEFINED
        merges = []
        for m in state["model"]["merges"]:
            left, right = m.split(" ", 1) if isinstance(m, str) else m
            if " " in left or " " in right:
                raise ValueError(f"merge {m!r} contains a space and cannot be written as a GGUF merge")
            merges.append(f"{left} {right}")
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": self.gguf_pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": self.eos_token_id,
            "tokenizer.ggml.padding_token_id": self.pad_token_id,
            # llama.cpp also ends generation at these (<|user|>, <|observation|>): Flint's other stop tokens.
            "tokenizer.ggml.eot_token_id": self.special_token_ids[USER],
            "tokenizer.ggml.eom_token_id": self.special_token_ids[OBSERVATION],
            "tokenizer.ggml.add_bos_token": False,  # prompts start with [gMASK]<sop> from the template
            "tokenizer.ggml.add_eos_token": False,
            "tokenizer.chat_template": self.chat_template or FLINT_CHAT_TEMPLATE,
        }

    @property
    def gguf_pre(self) -> str:
        """llama.cpp's name for this tokenizer's pre-tokenizer (`tokenizer.ggml.pre`)."""
        if self._pre is None:
            self._pre = _pre_name(self._tok)
        return self._pre

    def to_json_str(self) -> str:
        """The Hugging Face `tokenizer.json` text."""
        return self._tok.to_str()

    def save(self, path: str | os.PathLike[str]) -> None:
        self._tok.save(os.fspath(path))

    # --- use ------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; Flint markers in it become their special ids, nothing is added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The UTF-8 bytes one token contributes to decoded text (possibly part of a character)."""
        if token_id in self._added:
            content, special = self._added[token_id]
            return b"" if special and skip_special_tokens else content
        cached = self._bytes.get(token_id)
        if cached is None:
            spelled = self._tok.id_to_token(token_id)
            if spelled is None:
                raise ValueError(f"token id {token_id} is out of range (vocab_size {self.vocab_size})")
            cached = bytes(_BYTE_OF_CHAR[c] for c in spelled if c in _BYTE_OF_CHAR)
            self._bytes[token_id] = cached
        return cached

    @property
    def hf_tokenizer(self) -> Tokenizer:
        return self._tok


class IncrementalDecoder:
    """Streaming detokenizer: `feed(id)` returns the new text, never half a UTF-8 character; `flush()` at the end.

    Works on token bytes with an incremental UTF-8 decoder, so the concatenated deltas equal `decode(ids)`.
    """

    def __init__(self, tokenizer: FlintTokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        # A model's vocabulary is often padded past the tokenizer's; like `decode`, such ids add no text.
        if not 0 <= int(token_id) < self._tok.vocab_size:
            return ""
        return self._utf8.decode(self._tok.token_bytes(int(token_id), self._skip))

    def flush(self) -> str:
        """Text still held (an incomplete character at the end becomes U+FFFD); resets the decoder."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                        pre: str = "glm4") -> FlintTokenizer:
    """Train a small byte-level BPE tokenizer on `texts`; ids 0..16 are the Flint markers. `pre` names the
    pre-tokenizer split (GLM-4's by default; "qwen2" splits every digit on its own)."""
    floor = 256 + len(FLINT_SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be at least {floor} (256 bytes + {len(FLINT_SPECIAL_TOKENS)} markers)")
    tok = Tokenizer(models.BPE())
    _set_byte_level(tok, pre)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in FLINT_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return FlintTokenizer(tok, pre=pre)


def _set_byte_level(tok: Tokenizer, pre: str) -> None:
    if pre == GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()


def _pre_name(tok: Tokenizer) -> str:
    """Recognize the pre-tokenizer of a tokenizer.json as one of llama.cpp's `tokenizer.ggml.pre` names."""
    state = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer is not None else None
    if state and state.get("type") == "ByteLevel" and state.get("use_regex"):
        return GPT2_PRE
    steps = state.get("pretokenizers", []) if state else []
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex") and not steps[0].get("invert")):
        name = _PRE_BY_SPLIT.get(steps[0].get("pattern", {}).get("Regex"))
        if name:
            return name
    raise ValueError(f"pre-tokenizer has no tokenizer.ggml.pre equivalent: {json.dumps(state)[:200]}")


def _as_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def _required_list(meta: Mapping[str, Any], key: str) -> list[Any]:
    value = meta.get(key)
    if value is None:
        raise ValueError(f"{key}: missing")
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{key}: must be a list, got a string")
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"{key}: must be a list, got {type(value).__name__}") from None
