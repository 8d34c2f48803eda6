"""Chat completions on the engine: render the conversation, generate, parse reasoning and tool calls.

`chat_completion` returns an OpenAI-shaped choice: {"message": {...}, "finish_reason": ..., "usage": {...}};
`stream_chat_completion` yields parser deltas as tokens arrive and ends with that same choice.
"""

from __future__ import annotations

from typing import Any, Iterator

from flint_jax.chat.parser import finish_reason, parse_assistant
from flint_jax.chat.streaming import StreamingParser
from flint_jax.chat.template import render
from flint_jax.chat.tokenizer import FlintTokenizer, IncrementalDecoder
from flint_jax.sampling import SamplingParams


def _prepare(tokenizer: FlintTokenizer, messages, tools, tool_choice, enable_thinking, clear_thinking,
             exclude_tools_when_none, chat_template, sampling: SamplingParams | None):
    if not isinstance(tokenizer, FlintTokenizer):
        raise ValueError("chat needs a model with a Flint chat tokenizer (special tokens such as <|user|>)")
    prompt = render(messages, tools=tools, tool_choice=tool_choice, enable_thinking=enable_thinking,
                    clear_thinking=clear_thinking, exclude_tools_when_none=exclude_tools_when_none,
                    chat_template=chat_template)
    sampling = sampling or SamplingParams()
    stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *tokenizer.stop_token_ids)))
    import dataclasses
    sampling = dataclasses.replace(sampling, stop_token_ids=stops)
    parse_tools = None if tool_choice == "none" else tools
    return tokenizer.encode(prompt), sampling, parse_tools


def _choice(message: dict, completion) -> dict[str, Any]:
    return {"message": message,
            "finish_reason": finish_reason(message, length_limited=completion.finish_reason == "length"),
            "usage": {"prompt_tokens": len(completion.prompt_tokens), "completion_tokens": len(completion.tokens)},
            "timings": {"ttft_s": completion.ttft_s, "decode_ms_per_token": completion.decode_ms_per_token}}


def chat_completion(engine, tokenizer: FlintTokenizer, messages, tools=None, tool_choice="auto",
                    enable_thinking=True, clear_thinking=True, exclude_tools_when_none=True, chat_template=None,
                    sampling: SamplingParams | None = None) -> dict[str, Any]:
    """One assistant turn. Reasoning tokens count toward `sampling.max_tokens`."""
    ids, sampling, parse_tools = _prepare(tokenizer, messages, tools, tool_choice, enable_thinking, clear_thinking,
                                          exclude_tools_when_none, chat_template, sampling)
    done = engine.generate([ids], sampling)[0]
    out = done.tokens[:-1] if done.finish_reason == "stop" else done.tokens
    message = parse_assistant(tokenizer.decode(out), tools=parse_tools, enable_thinking=enable_thinking)
    return _choice(message, done)


def stream_chat_completion(engine, tokenizer: FlintTokenizer, messages, tools=None, tool_choice="auto",
                           enable_thinking=True, clear_thinking=True, exclude_tools_when_none=True,
                           chat_template=None, sampling: SamplingParams | None = None) -> Iterator[dict[str, Any]]:
    """Yield {"delta": {...}} as text arrives, then one {"choice": <as chat_completion returns>}."""
    ids, sampling, parse_tools = _prepare(tokenizer, messages, tools, tool_choice, enable_thinking, clear_thinking,
                                          exclude_tools_when_none, chat_template, sampling)
    decoder = IncrementalDecoder(tokenizer)
    parser = StreamingParser(parse_tools, enable_thinking)
    results = {}
    for event in engine._run([ids], [sampling], results):
        if event.finish_reason == "stop":
            continue  # the stop token itself is not text of the message
        for delta in parser.feed(decoder.feed(event.token)):
            yield {"delta": delta}
    for delta in parser.feed(decoder.flush()) + parser.flush():
        yield {"delta": delta}
    yield {"choice": _choice(parser.finish(), results[0])}
