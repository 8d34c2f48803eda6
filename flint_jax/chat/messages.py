"""Validate OpenAI-shaped chat messages and normalize them into one simple form for the renderers.

Normal form (plain dicts, never the caller's objects):
  system / user / tool: {"role", "content": str}  (tool also keeps "tool_call_id" when given)
  assistant: {"role", "content": str, "reasoning_content": str | None,
              "tool_calls": [{"id"?, "type": "function", "function": {"name": str, "arguments": dict}}]}
Both renderers (Python and jinja) see this form, so they only differ in how they print it.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return the normal form of `messages`; raise ValueError naming `messages[i].field` on bad input."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages: must be a list of message objects")
    if not messages:
        raise ValueError("messages: must contain at least one message")
    return [_normalize_one(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _normalize_one(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise ValueError(f"{where}: must be an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}; got {role!r}")
    if role != "assistant":
        for field in ("tool_calls", "reasoning_content"):
            if msg.get(field):  # an empty list or string is as good as absent
                raise ValueError(f"{where}.{field}: only assistant messages may have {field}")
        if msg.get("content") is None:
            raise ValueError(f"{where}.content: required for role {role!r}")
        out = {"role": role, "content": _text(msg["content"], f"{where}.content")}
        if role == "tool" and msg.get("tool_call_id") is not None:
            out["tool_call_id"] = str(msg["tool_call_id"])
        return out

    content = "" if msg.get("content") is None else _text(msg["content"], f"{where}.content")
    reasoning = msg.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}.reasoning_content: must be a string or null")
    calls = msg.get("tool_calls") or []
    if isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}.tool_calls: must be a list")
    return {
        "role": role,
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)],
    }


def _text(content: Any, where: str) -> str:
    """A string, or a list of OpenAI text parts (joined); images and other parts are not supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, Mapping)):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{j}]: only {{'type': 'text', 'text': str}} parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: must be an object")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}.type: must be 'function', got {call.get('type')!r}")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where}.function: missing or not an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name: must be a non-empty string")
    args = fn.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({e.msg})") from None
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments: must be a JSON object, got {type(args).__name__}")
    try:
        json.dumps(args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.function.arguments: not JSON-serializable ({e})") from None
    if not all(isinstance(k, str) for k in args):
        raise ValueError(f"{where}.function.arguments: keys must be strings")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": dict(args)}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out
