"""A generation engine for up to 8 concurrent requests over one hybrid KV state.

Each request owns a slot (a row of the state). New requests are prefilled in chunks (several new requests share a
chunk call), then all active slots decode together. A finished request frees its slot for the next one in the queue.
Jitted programs do all device work: the prefill chunks (`prefill_pipeline.prefill`: each chunk in a few programs
cut at layer boundaries, so the host's dispatch overlaps the device; `prefill_chunk` is the same chunk as one
program), and `decode_steps` (`steps_per_dispatch` decode steps in one program, each step's sampled token feeding
the next on the device), each over the donated state; sampling runs inside them so a call returns token ids, not
logits. `decode` is the single step with caller-supplied keys (what scripts/bench_decode.py times as the served
step).

Why several steps per dispatch: on the GPU the host needs about as long to dispatch one step (~2,000 argument
buffers and a CUDA-graph update) as the device needs to run it (docs/BENCHMARKS.md, "Host overhead"), so one step
per call makes served tokens/s host-bound. The host stops each request at its first stop token or `max_tokens`
and discards the rest of the burst; the device only guarantees that no row writes past its length limit.
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
from flint_jax import prefill_pipeline
from flint_jax.config import FlintConfig
from flint_jax.params import Params
from flint_jax.sampling import SamplingParams, sample, token_keys
from flint_jax.state import MAX_BATCH, KVState, init_state, kv_dtype_of, reset_slots


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


# Emptying slots in place (donated): the state keeps its buffers, so the command buffers (CUDA graphs) XLA recorded
# for the prefill and decode programs stay valid. A fresh state cost 35-43 ms per 8K prefill on the H200 (run Y,
# docs/BENCHMARKS.md).
reset_slots_in_place = jax.jit(reset_slots, donate_argnums=0)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def prefill_chunk(params: Params, state: KVState, tokens: jax.Array, n_new: jax.Array, keys: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, cfg: FlintConfig,
                  impl: str = "xla"):
    """One prefill chunk for every row (n_new[b] = 0 leaves row b untouched). keys [B]: each request's own key (its
    first token uses `token_keys(keys, 0)`). Returns (next token per row, sampled from the logits at the row's last
    real token, and the new state)."""
    h, state = M.model_step(params, state, tokens, n_new, cfg, impl=impl)
    return prefill_pipeline.sample_first_token(params, h, n_new, keys, temperature, top_k, top_p, cfg, impl), state


SAMPLERS = ("sort", "top_k")


def decode_sampler(impl: str, settings: Sequence[tuple[float, int]]) -> str:
    """How decode steps sample rows with these (temperature, top_k) settings: "top_k" (the top-k kernels,
    `pallas_path.sample_top_k`) on the Pallas path when every row allows it, else "sort" (`sampling.sample`)."""
    if impl != "pallas":
        return "sort"
    from flint_jax import pallas_path
    from flint_jax.pallas_kernels.top_k_sampling import supports
    ok = pallas_path.TOP_K_SAMPLING and all(supports(k, t) for t, k in settings)
    return "top_k" if ok else "sort"


def _decode_step(params, state, tokens, active, keys, temperature, top_k, top_p, cfg, impl, sampler):
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    h, state = M.model_step(params, state, tokens[:, None], active.astype(jnp.int32), cfg, impl=impl)
    logits = M.lm_logits(params, h[:, 0], cfg, impl=impl)
    if sampler == "top_k":
        from flint_jax import pallas_path
        return pallas_path.sample_top_k(logits, keys, temperature, top_k, top_p), state
    return sample(logits, keys, temperature, top_k, top_p), state


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "sampler"), donate_argnames=("state",))
def decode(params: Params, state: KVState, tokens: jax.Array, active: jax.Array, keys: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, cfg: FlintConfig, impl: str = "xla",
           sampler: str = "sort"):
    """One decode step: tokens [B] at each row's next position (inactive rows are left untouched), sampled with
    the given keys [B]. sampler: "sort" (`sampling.sample`) or "top_k" (the top-k kernels; every row must be greedy
    or have 1 <= top_k <= top_k_sampling.K_MAX: see `decode_sampler`). Returns (next token per row, new state)."""
    return _decode_step(params, state, tokens, active, keys, temperature, top_k, top_p, cfg, impl, sampler)


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "num_steps", "sampler"), donate_argnames=("state",))
def decode_steps(params: Params, state: KVState, tokens: jax.Array, active: jax.Array, limits: jax.Array,
                 keys: jax.Array, generated: jax.Array, temperature: jax.Array, top_k: jax.Array,
                 top_p: jax.Array, cfg: FlintConfig, impl: str = "xla", num_steps: int = 1, sampler: str = "sort"):
    """`num_steps` decode steps in one program; each step's sampled token is the next step's input.

    tokens [B]: each row's last token (not yet in the state; -1, as a row that did not run returns, reads as 0).
    active [B] bool. limits [B] int: row b runs a step
    only while lengths[b] < limits[b] (clamped to the state's max_len), so it never writes at or past limits[b];
    after that it is left untouched like an inactive row. keys [B]: each request's own key; generated [B]: tokens
    it has produced so far, so step i samples with `token_keys(keys, generated + i)`, as one step per call would.
    Returns (tokens [num_steps, B] int32, -1 where a row did not run, new state). The host applies stop tokens.

    The steps are an unrolled Python loop, not `lax.scan`: XLA on the GPU captures only straight-line programs in
    a CUDA graph, and the whole burst then costs one dispatch."""
    if state.max_len:
        limits = jnp.minimum(limits, state.max_len)
    tokens = jnp.maximum(tokens, 0)
    out = []
    for i in range(num_steps):
        with jax.named_scope(f"step{i}"):
            live = active & (state.lengths < limits)
            nxt, state = _decode_step(params, state, tokens, live, token_keys(keys, generated + i), temperature,
                                      top_k, top_p, cfg, impl, sampler)
        out.append(jnp.where(live, nxt, -1))
        tokens = nxt
    return jnp.stack(out), state


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "num_steps", "sampler"),
                   donate_argnames=("state", "out"), keep_unused=True)  # keep `out`: jit prunes unused arguments
def decode_burst(params: Params, state: KVState, out: jax.Array, last: jax.Array, active: jax.Array,
                 limits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                 cfg: FlintConfig, impl: str = "xla", num_steps: int = 1, sampler: str = "sort"):
    """`decode_steps` with its per-burst inputs and its output in two device buffers of shape [num_steps + 1, B]
    int32 that take turns, so that a decode loop's bursts keep their arguments at fixed device addresses.

    last: the previous burst's buffer, read: row num_steps - 1 holds each row's last token, row num_steps the
    tokens it has generated so far. out: the other buffer, donated: the result is written in its place, rows
    0..num_steps-1 this burst's tokens (-1 where a row did not run), row num_steps the generated count plus
    num_steps. Returns (buffer, new state).

    Why: XLA replays a program's recorded command buffer (CUDA graph) while its buffers keep their addresses and
    re-records it when one moves. With the last burst's output still alive at the next dispatch, the re-recording
    cost ~1 ms per dispatch on the H200 (XLA's log: ~60 ms of updates per 64 one-step bursts, against ~2 ms when
    that output was dropped first); with these buffers ~6 ms per 64 bursts, only the commands that touch them
    (runs CB-CC, docs/BENCHMARKS.md)."""
    del out  # donated so that the result takes its place
    tokens, generated = last[num_steps - 1], last[num_steps]
    burst, state = decode_steps(params, state, tokens, active, limits, keys, generated, temperature, top_k, top_p,
                                cfg=cfg, impl=impl, num_steps=num_steps, sampler=sampler)
    return jnp.concatenate([burst, (generated + num_steps)[None]]), state


def burst_buffer(tokens: np.ndarray, generated: np.ndarray, num_steps: int) -> np.ndarray:
    """The host-side `last` buffer of a decode loop's first burst (see `decode_burst`)."""
    buf = np.zeros((num_steps + 1, len(tokens)), np.int32)
    buf[num_steps - 1], buf[num_steps] = tokens, generated
    return buf


@dataclasses.dataclass
class _Slot:
    request: int
    prompt: list[int]
    sampling: SamplingParams
    submitted: float
    tokens: list[int] = dataclasses.field(default_factory=list)
    first_token_at: float = 0.0
    prefilled: int = 0


class Engine:
    """Batched generation over a model's `cfg` and `params` (`Params`, or `layer_stack.StackedParams`: with
    impl="pallas" pass stacked parameters, `stack_layers(params, delete=True)`, so each call hands the device ~190
    buffers instead of ~1,930: 3.64 instead of 5.66-6.27 ms/token at one step per dispatch, runs BN-BO).

    max_batch: concurrent requests (<= 8). max_len: longest sequence (prompt + output) a slot can hold.
    chunk_size: prompt tokens per prefill call. impl: "xla" (reference) or "pallas" (fused decode kernels).
    steps_per_dispatch: decode steps per device call (one compiled program); tokens then stream in bursts of this
    many, and a request's tokens are the same for any value (see `decode_steps`). A request that stops mid-burst
    wastes the rest of that burst's compute on its row. With overlap_dispatch on the H200 (Flint, NVFP4, Pallas,
    batch 1, 100K prompt; docs/BENCHMARKS.md): 2.500 ms/token at 1 (the default), 2.448 at 4 (runs DJ, DM); 4 was
    slower until the 4-step program stopped copying 35 buffers per step (2.65 and 2.72 in run CG). The n-step
    program takes longer to compile (4 steps: ~114 s in run F; one step: 25-57 s in runs DI-DL, GPU machine).
    overlap_dispatch: dispatch each burst before the host reads the previous one's tokens (the next burst reads the
    last burst's tokens on the device), so the host's work runs while the device works instead of after it; a
    request's tokens are the same either way. A request that stops costs its row the burst already in flight, whose
    tokens for it are discarded. On by default: one step per dispatch at a 100K prompt, 3.63 ms/token without it,
    2.71 with it (run CD).
    stacked_caches: hold the KV caches as two stacks (state.StackedCaches: 5 buffers per call instead of 134 for
    Flint), which the Pallas decode kernels write in place; the XLA reference would copy a layer's cache out of the
    stack and back on every step. None (default): on for impl="pallas", off for "xla". Measured on one H200 (run
    BS, docs/BENCHMARKS.md; Flint, NVFP4, stacked parameters, 8K prompt, one step per dispatch): 3.44 -> 3.24
    ms/token; the device step is unchanged and its outputs are bit-identical.
    tokenizer / chat_template: needed only by `chat` (a FlintTokenizer; a GGUF's template, else the project's).
    prefill_cuts: layer indices where each prefill chunk is cut into separately dispatched programs, so the host's
    dispatch overlaps the device's work (flint_jax.prefill_pipeline; () runs each chunk as one program).
    kv_dtype: the full-context layers' KV cache element type, "bf16" (default, the model's own numerics) or "fp8"
    (E4M3, no scale, saturating: half the memory and half the bytes a long-context step reads; state.KV_DTYPES).
    The sliding layers' rings stay BF16. With impl="pallas" an FP8 cache's scores are FP16 dots: a model whose
    q_norm weights could push q past FP16's range is refused (decode_attention.check_fp16_scores).
    """

    def __init__(self, cfg: FlintConfig, params: Params, *, max_batch: int = MAX_BATCH, max_len: int = 2048,
                 chunk_size: int = 256, impl: str = "xla", steps_per_dispatch: int = 1,
                 overlap_dispatch: bool = True, stacked_caches: bool | None = None,
                 tokenizer=None, chat_template: str | None = None,
                 prefill_cuts: Sequence[int] = prefill_pipeline.DEFAULT_CUTS, kv_dtype: str = "bf16"):
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in [1, {MAX_BATCH}] (the low-latency path serves at most "
                             f"{MAX_BATCH} concurrent requests), got {max_batch}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if isinstance(steps_per_dispatch, bool) or not isinstance(steps_per_dispatch, (int, np.integer)) \
                or steps_per_dispatch < 1:
            raise ValueError(f"steps_per_dispatch must be an integer >= 1, got {steps_per_dispatch!r}")
        if impl not in ("xla", "pallas"):
            raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
        self.cfg, self.params = cfg, params
        self.max_batch, self.max_len, self.chunk_size, self.impl = max_batch, max_len, chunk_size, impl
        self.steps_per_dispatch = int(steps_per_dispatch)
        self.overlap_dispatch = bool(overlap_dispatch)
        prefill_pipeline.segments(cfg.num_hidden_layers, prefill_cuts)  # refuses cuts that are not layer indices
        self.prefill_cuts = tuple(prefill_cuts)
        if stacked_caches is None:
            stacked_caches = impl == "pallas"
        self.kv_dtype = kv_dtype
        self.state = init_state(cfg, max_batch, max_len, stacked=bool(stacked_caches), kv_dtype=kv_dtype)
        self.keys = jax.random.split(jax.random.key(0), max_batch)  # [B] each slot's request key, set at its start
        self.tokenizer, self.chat_template = tokenizer, chat_template
        if impl == "pallas":
            from flint_jax import pallas_path
            if kv_dtype_of(kv_dtype) != jnp.bfloat16:
                from flint_jax.pallas_kernels import decode_attention
                decode_attention.check_fp16_scores(params, cfg)  # the FP8 caches' scores are FP16 dots
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
        self.state = reset_slots_in_place(self.state, jnp.ones((self.max_batch,), bool))
        while queue or any(slots):
            fresh = []
            for b in range(self.max_batch):
                if slots[b] is None and queue:
                    r = queue.pop(0)
                    s = sampling[r]
                    slots[b] = _Slot(r, [int(t) for t in prompts[r]], s, time.perf_counter())
                    self.keys = self.keys.at[b].set(jax.random.key(s.seed))
                    fresh.append(b)
            if fresh:
                mask = np.zeros(self.max_batch, bool)
                mask[fresh] = True
                yield from self._prefill(slots, fresh, results, reset=mask)
            active = [b for b in range(self.max_batch) if slots[b] is not None]
            if active:  # a request finished at its prefill may have left a slot for the queue: one burst, then admit
                yield from self._decode(slots, active, results, admit_after_one=bool(queue) and None in slots)

    def _settings(self, slots, rows):
        """(temperature, top_k, top_p) per row, as numpy: host prep stays free of eager device ops."""
        B = self.max_batch
        temp, top_k, top_p = np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32)
        for b in rows:
            s = slots[b].sampling
            temp[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
        return temp, top_k, top_p

    def _prefill(self, slots, rows, results, reset):
        """Prefill `rows` chunk by chunk (their slots emptied first: `reset`, folded into the first chunk). Chunks
        are dispatched back to back; the host waits for a chunk's tokens only where a prompt ends in it."""
        C, B = self.chunk_size, self.max_batch
        while True:
            # A request whose first token ends it (max_tokens 1, or a stop token) has already freed its slot.
            pending = [b for b in rows if slots[b] is not None and slots[b].prefilled < len(slots[b].prompt)]
            if not pending:
                return
            tokens, n_new = np.zeros((B, C), np.int32), np.zeros(B, np.int32)
            for b in pending:
                s = slots[b]
                part = s.prompt[s.prefilled:s.prefilled + C]
                tokens[b, :len(part)], n_new[b] = part, len(part)
                s.prefilled += len(part)
            nxt, self.state = prefill_pipeline.prefill(self.params, self.state, tokens, n_new, self.keys,
                                                       *self._settings(slots, pending), reset=reset, cfg=self.cfg,
                                                       impl=self.impl, cuts=self.prefill_cuts)
            reset = None
            done = [b for b in pending if slots[b].prefilled == len(slots[b].prompt)]
            if done:
                nxt = np.asarray(nxt)
            for b in done:
                slots[b].first_token_at = time.perf_counter()
                yield from self._emit(slots, b, int(nxt[b]), results)

    def _decode(self, slots, rows, results, admit_after_one: bool = False):
        """`decode_burst` bursts for `rows`, their tokens in step order, until a row finishes (or after one burst
        with admit_after_one: a free slot waits for a queued request, which `_run` then admits). A request that
        finishes mid-burst frees its slot and the rest of its row is discarded. With overlap_dispatch each burst
        is dispatched before the host reads the previous one, and the burst in flight when a row finishes is read
        too (its tokens for the other rows are theirs).

        Every input of the loop's bursts keeps its device address for the whole loop: the settings are uploaded
        once, and each burst reads its tokens from the previous burst's buffer on the device, the two buffers taking
        turns (`decode_burst`). So XLA replays the program's recorded command buffer instead of updating most of it
        on every dispatch."""
        B, n = self.max_batch, self.steps_per_dispatch
        tokens, active = np.zeros(B, np.int32), np.zeros(B, bool)
        limits, generated = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for b in rows:
            s = slots[b]
            tokens[b], active[b], generated[b] = s.tokens[-1], True, len(s.tokens)
            # The state holds prompt + generated - 1 tokens; the request's last token is its max_tokens-th, sampled
            # by the step that writes position prompt + max_tokens - 2, so no step may start at this length.
            limits[b] = len(s.prompt) + s.sampling.max_tokens - 1
        settings = self._settings(slots, rows)
        sampler = decode_sampler(self.impl, [(settings[0][b], settings[1][b]) for b in rows])
        fixed = [jnp.asarray(a) for a in (active, limits, *settings)]
        buffers = [jnp.zeros((n + 1, B), jnp.int32), jnp.asarray(burst_buffer(tokens, generated, n))]
        turn = 0

        def dispatch():
            nonlocal turn
            p = turn % 2
            buffers[p], self.state = decode_burst(self.params, self.state, buffers[p], buffers[1 - p], fixed[0],
                                                  fixed[1], self.keys, *fixed[2:], cfg=self.cfg, impl=self.impl,
                                                  num_steps=n, sampler=sampler)
            turn += 1
            return buffers[p]

        def emit(out):  # -> whether a row finished
            finished = False
            for step in np.asarray(out)[:n]:
                for b in rows:
                    if slots[b] is not None:
                        yield from self._emit(slots, b, int(step[b]), results)
                        finished |= slots[b] is None
            return finished

        out = dispatch()
        while True:
            ahead = dispatch() if self.overlap_dispatch and not admit_after_one else None
            finished = yield from emit(out)
            if finished or admit_after_one:
                if ahead is not None:
                    yield from emit(ahead)
                return
            out = ahead if ahead is not None else dispatch()

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
