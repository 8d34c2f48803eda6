"""A generation engine for up to 8 concurrent requests over one hybrid KV state.

Each request owns a slot (a row of the state). New requests are prefilled in chunks (several new requests share a
chunk call), then all active slots decode together one token per step. A finished request frees its slot for the
next one in the queue. Two jitted programs do all device work: `prefill_chunk` and `decode`, each over the donated
state; sampling runs inside them so a step returns token ids, not logits.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flint_jax import model as M
from flint_jax.config import FlintConfig
from flint_jax.params import Params
from flint_jax.sampling import SamplingParams, sample
from flint_jax.state import MAX_BATCH, KVState, init_state, reset_slots


@dataclasses.dataclass
class Completion:
    """The result of one request."""
    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token, included in tokens) or "length"
    ttft_s: float  # submit -> first token
    decode_ms_per_token: float  # mean time per output token after the first (nan with one token)


@dataclasses.dataclass
class TokenEvent:
    """A streamed token: request index, the token, and the finish reason once the request ends."""
    request: int
    token: int
    finish_reason: str | None = None


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def prefill_chunk(params: Params, state: KVState, tokens: jax.Array, n_new: jax.Array, keys: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, cfg: FlintConfig,
                  impl: str = "xla"):
    """One prefill chunk for every row (n_new[b] = 0 leaves row b untouched). Returns (next token per row, sampled
    from the logits at the row's last real token, and the new state)."""
    h, state = M.model_step(params, state, tokens, n_new, cfg, impl=impl)
    logits = M.lm_logits(params, M.last_hidden(h, n_new), cfg)
    return sample(logits, keys, temperature, top_k, top_p), state


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def decode(params: Params, state: KVState, tokens: jax.Array, active: jax.Array, keys: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, cfg: FlintConfig, impl: str = "xla"):
    """One decode step: tokens [B] at each row's next position (inactive rows are left untouched). Returns (next
    token per row, new state)."""
    h, state = M.model_step(params, state, tokens[:, None], active.astype(jnp.int32), cfg, impl=impl)
    logits = M.lm_logits(params, h[:, 0], cfg)
    return sample(logits, keys, temperature, top_k, top_p), state


@dataclasses.dataclass
class _Slot:
    request: int
    prompt: list[int]
    sampling: SamplingParams
    key: jax.Array
    submitted: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_at: float = 0.0
    prefilled: int = 0


class Engine:
    """Batched generation over a model's `cfg` and `params`.

    max_batch: concurrent requests (<= 8). max_len: longest sequence (prompt + output) a slot can hold.
    chunk_size: prompt tokens per prefill call. impl: "xla" (reference) or "pallas" (fused decode kernels).
    tokenizer / chat_template: needed only by `chat` (a FlintTokenizer; a GGUF's template, else the project's).
    """

    def __init__(self, cfg: FlintConfig, params: Params, *, max_batch: int = MAX_BATCH, max_len: int = 2048,
                 chunk_size: int = 256, impl: str = "xla", tokenizer=None, chat_template: str | None = None):
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in [1, {MAX_BATCH}] (the low-latency path serves at most "
                             f"{MAX_BATCH} concurrent requests), got {max_batch}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if impl not in ("xla", "pallas"):
            raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
        self.cfg, self.params = cfg, params
        self.max_batch, self.max_len, self.chunk_size, self.impl = max_batch, max_len, chunk_size, impl
        self.state = init_state(cfg, max_batch, max_len)
        self.tokenizer, self.chat_template = tokenizer, chat_template
        if impl == "pallas":
            from flint_jax import pallas_path
            missing = [k for k, v in pallas_path.coverage().items() if v != "pallas"]
            if missing:
                warnings.warn(f"impl='pallas': no kernel yet for {', '.join(missing)}; the reference runs there")

    # ---- public API -------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] = None,
                 on_token: Callable[[TokenEvent], None] | None = None) -> list[Completion]:
        """Generate for every prompt (token id lists); more prompts than slots wait in a queue."""
        results: dict[int, Completion] = {}
        for event in self._run(prompts, sampling, results):
            if on_token is not None:
                on_token(event)
        return [results[i] for i in range(len(prompts))]

    def stream(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams] = None) -> Iterator[TokenEvent]:
        """Yield tokens as they are produced, across all requests."""
        yield from self._run(prompts, sampling, {})

    def chat(self, messages, tools=None, tool_choice: str = "auto", enable_thinking: bool = True,
             sampling: SamplingParams | None = None, stream: bool = False, **render_options):
        """One assistant turn in OpenAI shape: {"message", "finish_reason", "usage", "timings"}; with stream=True an
        iterator of {"delta": ...} ending with {"choice": ...}. Reasoning counts toward sampling.max_tokens.
        render_options: clear_thinking, exclude_tools_when_none (see flint_jax.chat.render)."""
        from flint_jax.chat import completion
        fn = completion.stream_chat_completion if stream else completion.chat_completion
        return fn(self, self.tokenizer, messages, tools=tools, tool_choice=tool_choice,
                  enable_thinking=enable_thinking, chat_template=self.chat_template, sampling=sampling,
                  **render_options)

    # ---- scheduling -------------------------------------------------------------------------------------
    def _validate(self, prompts, sampling) -> list[SamplingParams]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of token-id lists")
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
        for i, (p, s) in enumerate(zip(prompts, sampling)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            try:
                M.check_tokens(np.asarray(p, dtype=np.int64), self.cfg)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            if len(p) + s.max_tokens > self.max_len:
                raise ValueError(f"prompt {i}: {len(p)} prompt tokens + max_tokens {s.max_tokens} exceed the "
                                 f"engine's max_len {self.max_len}")
        return list(sampling)

    def _run(self, prompts, sampling, results: dict) -> Iterator[TokenEvent]:
        sampling = self._validate(prompts, sampling)
        queue = list(range(len(prompts)))
        slots: list[_Slot | None] = [None] * self.max_batch
        self.state = reset_slots(self.state, jnp.ones((self.max_batch,), bool))
        while queue or any(slots):
            fresh = []
            for b in range(self.max_batch):
                if slots[b] is None and queue:
                    r = queue.pop(0)
                    s = sampling[r]
                    slots[b] = _Slot(r, [int(t) for t in prompts[r]], s, jax.random.key(s.seed), time.perf_counter())
                    fresh.append(b)
            if fresh:
                mask = np.zeros(self.max_batch, bool)
                mask[fresh] = True
                self.state = reset_slots(self.state, jnp.asarray(mask))
                yield from self._prefill(slots, fresh, results)
            active = [b for b in range(self.max_batch) if slots[b] is not None]
            if active:
                yield from self._decode(slots, active, results)

    def _settings(self, slots, rows):
        B = self.max_batch
        temp, top_k, top_p = np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32)
        keys = [jax.random.key(0)] * B
        for b in rows:
            s = slots[b]
            temp[b], top_k[b], top_p[b] = s.sampling.temperature, s.sampling.top_k, s.sampling.top_p
            keys[b] = jax.random.fold_in(s.key, len(s.tokens))
        return jnp.stack(keys), jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p)

    def _prefill(self, slots, rows, results):
        C, B = self.chunk_size, self.max_batch
        while True:
            pending = [b for b in rows if slots[b].prefilled < len(slots[b].prompt)]
            if not pending:
                return
            tokens, n_new = np.zeros((B, C), np.int32), np.zeros(B, np.int32)
            for b in pending:
                s = slots[b]
                part = s.prompt[s.prefilled:s.prefilled + C]
                tokens[b, :len(part)], n_new[b] = part, len(part)
                s.prefilled += len(part)
            nxt, self.state = prefill_chunk(self.params, self.state, jnp.asarray(tokens), jnp.asarray(n_new),
                                            *self._settings(slots, pending), cfg=self.cfg, impl=self.impl)
            nxt = np.asarray(nxt)
            for b in pending:
                if slots[b].prefilled == len(slots[b].prompt):
                    slots[b].first_token_at = time.perf_counter()
                    yield from self._emit(slots, b, int(nxt[b]), results)

    def _decode(self, slots, rows, results):
        B = self.max_batch
        tokens, active = np.zeros(B, np.int32), np.zeros(B, bool)
        for b in rows:
            tokens[b], active[b] = slots[b].tokens[-1], True
        nxt, self.state = decode(self.params, self.state, jnp.asarray(tokens), jnp.asarray(active),
                                 *self._settings(slots, rows), cfg=self.cfg, impl=self.impl)
        nxt = np.asarray(nxt)
        for b in rows:
            yield from self._emit(slots, b, int(nxt[b]), results)

    def _emit(self, slots, b, token, results):
        s = slots[b]
        s.tokens.append(token)
        reason = None
        if token in s.sampling.stop_token_ids:
            reason = "stop"
        elif len(s.tokens) >= s.sampling.max_tokens:
            reason = "length"
        yield TokenEvent(s.request, token, reason)
        if reason is not None:
            now = time.perf_counter()
            n = len(s.tokens)
            results[s.request] = Completion(
                prompt_tokens=s.prompt, tokens=s.tokens, finish_reason=reason, ttft_s=s.first_token_at - s.submitted,
                decode_ms_per_token=(now - s.first_token_at) * 1e3 / (n - 1) if n > 1 else float("nan"))
            slots[b] = None
