"""Tool definitions (OpenAI `tools` shape): validation and the per-argument typing the parser needs."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

ToolList = Sequence[Mapping[str, Any]]


def validate_tools(tools: ToolList | None) -> list[Mapping[str, Any]]:
    """Check `tools` is a list of `{"type": "function", "function": {name, description?, parameters?}}`.

    Returns the list (empty for None). Raises ValueError naming the offending field.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError("tools: must be a list of tool definitions")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where}: must be an object, got {type(tool).__name__}")
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: not JSON-serializable ({e})") from None
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function: missing or not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c.isspace() or c in "<>" for c in name):
            raise ValueError(f"{where}.function.name: must be a non-empty string without spaces or '<>'")
        if name in seen:
            raise ValueError(f"{where}.function.name: duplicate tool name {name!r}")
        seen.add(name)
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description: must be a string")
        params = fn.get("parameters")
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters.type: must be 'object', got {params.get('type')!r}")
        props = params.get("properties", {})
        if not isinstance(props, Mapping) or not all(isinstance(p, Mapping) for p in props.values()):
            raise ValueError(f"{where}.function.parameters.properties: must map names to schema objects")
        required = params.get("required", [])
        if not isinstance(required, Sequence) or isinstance(required, str) or not all(
            isinstance(r, str) for r in required
        ):
            raise ValueError(f"{where}.function.parameters.required: must be a list of names")
    return list(tools)


def validate_tool_choice(tool_choice: Any, tools: ToolList) -> None:
    """Accept "auto", "none", "required" or `{"type": "function", "function": {"name": <offered tool>}}`."""
    if tool_choice in ("auto", "none", "required"):
        return
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type", "function") == "function" and isinstance(name, str):
            if name not in tool_names(tools):
                raise ValueError(f"tool_choice.function.name: {name!r} is not one of the offered tools")
            return
    raise ValueError(f"tool_choice: expected 'auto', 'none', 'required' or a named function, got {tool_choice!r}")


def tool_names(tools: ToolList) -> set[str]:
    return {t["function"]["name"] for t in tools}


def string_params(tools: ToolList) -> dict[str, dict[str, bool | None]]:
    """Map tool name -> {argument: True if the schema says string, False if another type, None if unknown}.

    An argument typed only as string (alone, or with null) keeps its raw text; anything else is JSON.
    """
    out: dict[str, dict[str, bool | None]] = {}
    for tool in tools:
        fn = tool["function"]
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {key: _is_string_schema(schema) for key, schema in props.items()}
    return out


def _is_string_schema(schema: Mapping[str, Any]) -> bool | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind == "string"
    if isinstance(kind, Sequence) and kind:
        non_null = [k for k in kind if k != "null"]
        return bool(non_null) and all(k == "string" for k in non_null)
    enum = schema.get("enum")
    if isinstance(enum, Sequence) and enum and not isinstance(enum, str):
        return all(isinstance(v, str) for v in enum)
    return None  # anyOf, $ref, ... : no usable type, so the parser guesses from the text
