"""Turn what the model wrote into an OpenAI Chat Completions assistant message (FLINT_SPEC section 5).

Rules, in order:
1. Text from the first stop marker (`<|endoftext|>`, `<|user|>`, `<|observation|>`) on is ignored.
2. Reasoning: a leading `<think>` (after whitespace) is tolerated and always opens reasoning; otherwise reasoning is
   open iff `enable_thinking` (the prompt already ended in `<think>`). Open reasoning runs to the first `</think>`,
   or to the end if there is none.
3. The rest is content, except `<tool_call>` blocks: `name` then `<arg_key>k</arg_key><arg_value>v</arg_value>`
   pairs, whitespace allowed between tags (GLM-4.5's newline form), zero pairs allowed. A well-formed call to an
   offered tool becomes a tool call; to any other name it is dropped. A call with no `</tool_call>` is content;
   so is a malformed one (bad name, stray text between tags), up to its `</tool_call>`.
   A key or value ends at the first closing tag of its own kind or `</tool_call>`, whichever comes first.
4. Argument values: a parameter whose schema type is string keeps its raw text (whitespace included); any other
   value is JSON-decoded when it parses (else kept as text). `arguments` is JSON with ensure_ascii=False.
5. Content and reasoning are stripped of surrounding whitespace; empty becomes None.

Tool-call ids are `call_` + 24 hex digits of sha256(text before the call's `<tool_call>` + name): the same output
gives the same ids (one-shot or streamed), and different turns almost surely differ.
"""

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flint_jax.chat import tags
from flint_jax.chat.tools import string_params, validate_tools

Message = dict[str, Any]


def parse_assistant(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool = True
) -> Message:
    """Parse generated `text` into `{"role", "content", "reasoning_content", "tool_calls"}`; never raises on text."""
    kinds = string_params(validate_tools(tools))
    text = text or ""
    stop = find_first(text, 0, tags.STOP_TOKENS)[0]
    body = text if stop < 0 else text[:stop]

    pos, thinking = 0, enable_thinking
    lead = len(body) - len(body.lstrip())
    if body.startswith(tags.THINK_START, lead):
        pos, thinking = lead + len(tags.THINK_START), True
    reasoning = ""
    if thinking:
        end = body.find(tags.THINK_END, pos)
        end = len(body) if end < 0 else end
        reasoning, pos = body[pos:end], min(len(body), end + len(tags.THINK_END))

    content: list[str] = []
    calls: list[dict[str, Any]] = []
    while True:
        start = body.find(tags.TOOL_CALL_START, pos)
        if start < 0:
            content.append(body[pos:])
            break
        content.append(body[pos:start])
        scan = scan_call(body, start)
        if scan.status == "incomplete":
            content.append(body[start:])
            break
        if scan.status == "malformed":
            content.append(body[start:scan.end])
        elif scan.name in kinds:
            calls.append(make_tool_call(body, start, scan, kinds[scan.name]))
        pos = scan.end
    return make_message("".join(content).strip(), reasoning.strip(), calls)


def finish_reason(message: Mapping[str, Any], length_limited: bool = False) -> str:
    """OpenAI finish_reason: "length" if generation hit max_tokens, else "tool_calls" if any, else "stop"."""
    if length_limited:
        return "length"
    return "tool_calls" if message.get("tool_calls") else "stop"


def make_message(content: str, reasoning: str, calls: list[dict[str, Any]]) -> Message:
    return {"role": "assistant", "content": content or None, "reasoning_content": reasoning or None,
            "tool_calls": calls}


@dataclass
class CallScan:
    """Result of scanning one `<tool_call>` block: `end` is just past its `</tool_call>` (ok / malformed)."""

    status: Literal["ok", "malformed", "incomplete"]
    end: int = -1
    name: str = ""
    args: list[tuple[str, str]] = field(default_factory=list)


def scan_call(text: str, start: int) -> CallScan:
    """Scan the call whose `<tool_call>` tag begins at `start`.

    "incomplete" means `text` ends before the call's fate is known, so a streaming caller can wait for more; every
    other answer depends only on text already seen. That holds because each tag starts with '<' and has no other
    '<', so tags never overlap and a tag found complete cannot be preceded by a still-partial one.
    """
    pos = start + len(tags.TOOL_CALL_START)
    k, tag = find_first(text, pos, (tags.ARG_KEY_START, tags.TOOL_CALL_END))
    if k < 0:
        return CallScan("incomplete")
    name = text[pos:k].strip()
    if not name or any(c.isspace() or c in "<>" for c in name):
        return _malformed(text, k)
    args: list[tuple[str, str]] = []
    pos = k
    while True:
        pos = _skip_space(text, pos)
        if text.startswith(tags.TOOL_CALL_END, pos):
            return CallScan("ok", pos + len(tags.TOOL_CALL_END), name, args)
        if not text.startswith(tags.ARG_KEY_START, pos):
            return _expect_failed(text, pos, (tags.ARG_KEY_START, tags.TOOL_CALL_END))
        key, pos = _element(text, pos + len(tags.ARG_KEY_START), tags.ARG_KEY_END)
        if key is None:
            return _malformed(text, pos) if pos >= 0 else CallScan("incomplete")
        key = key.strip()
        if not key:
            return _malformed(text, pos)
        pos = _skip_space(text, pos)
        if not text.startswith(tags.ARG_VALUE_START, pos):
            return _expect_failed(text, pos, (tags.ARG_VALUE_START,))
        value, pos = _element(text, pos + len(tags.ARG_VALUE_START), tags.ARG_VALUE_END)
        if value is None:
            return _malformed(text, pos) if pos >= 0 else CallScan("incomplete")
        args.append((key, value))


def _element(text: str, pos: int, closer: str) -> tuple[str | None, int]:
    """(inner text, position after `closer`); (None, where `</tool_call>` cut it short); (None, -1) if unseen."""
    k, tag = find_first(text, pos, (closer, tags.TOOL_CALL_END))
    if k < 0:
        return None, -1
    if tag == tags.TOOL_CALL_END:
        return None, k
    return text[pos:k], k + len(closer)


def _expect_failed(text: str, pos: int, expected: tuple[str, ...]) -> CallScan:
    rest = text[pos:]
    if not rest or any(e.startswith(rest) for e in expected):
        return CallScan("incomplete")  # the expected tag may still be arriving
    return _malformed(text, pos)


def _malformed(text: str, pos: int) -> CallScan:
    end = text.find(tags.TOOL_CALL_END, pos)
    return CallScan("incomplete") if end < 0 else CallScan("malformed", end + len(tags.TOOL_CALL_END))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def find_first(text: str, pos: int, needles: Sequence[str]) -> tuple[int, str]:
    """Earliest occurrence at or after `pos` of any needle: (index, needle), or (-1, "")."""
    best, found = -1, ""
    for needle in needles:
        k = text.find(needle, pos, len(text) if best < 0 else best + len(needle))
        if k >= 0 and (best < 0 or k < best):
            best, found = k, needle
    return best, found


def make_tool_call(text: str, start: int, scan: CallScan, kinds: Mapping[str, bool | None]) -> dict[str, Any]:
    """An OpenAI tool call for a scanned, offered call starting at `start` in `text`."""
    args = {key: type_value(raw, kinds.get(key)) for key, raw in scan.args}
    digest = hashlib.sha256((text[:start] + scan.name).encode("utf-8", "surrogatepass")).hexdigest()
    return {"id": f"call_{digest[:24]}", "type": "function",
            "function": {"name": scan.name, "arguments": json.dumps(args, ensure_ascii=False)}}


def type_value(raw: str, is_string: bool | None) -> Any:
    """Raw text for string-typed parameters; otherwise the JSON value if `raw` parses, else the text."""
    if is_string:
        return raw
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would make `arguments` invalid JSON
