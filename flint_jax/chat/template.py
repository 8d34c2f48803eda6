"""Render a conversation into Flint's GLM-4.7-style prompt (FLINT_SPEC section 5).

Two renderers, one output: `render` prints the prompt in Python, and `FLINT_CHAT_TEMPLATE` is the same format as a
jinja string for GGUF files (`tokenizer.chat_template`). A caller-supplied template (e.g. the one a GGUF carries)
runs in jinja2's immutable sandbox with the filters and globals Hugging Face templates expect.
"""

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flint_jax.chat import tags
from flint_jax.chat.messages import normalize_messages
from flint_jax.chat.tools import validate_tool_choice, validate_tools

# The tool block's wording is part of what the model was trained on, so it follows GLM-4.7's prompt.
TOOLS_HEAD = (
    f"{tags.SYSTEM}\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_TAIL = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    f"{tags.TOOL_CALL_START}{{function-name}}"
    f"{tags.ARG_KEY_START}{{arg-key-1}}{tags.ARG_KEY_END}{tags.ARG_VALUE_START}{{arg-value-1}}{tags.ARG_VALUE_END}"
    f"{tags.ARG_KEY_START}{{arg-key-2}}{tags.ARG_KEY_END}{tags.ARG_VALUE_START}{{arg-value-2}}{tags.ARG_VALUE_END}"
    f"...{tags.TOOL_CALL_END}"
)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render."""


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] = "auto",
    enable_thinking: bool = True,
    clear_thinking: bool = True,
    exclude_tools_when_none: bool = True,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> str:
    """Render OpenAI-shaped `messages` (and `tools`) into the prompt text.

    With `chat_template` (a jinja string) the prompt comes from that template; otherwise from Flint's own format.
    Raises ValueError on malformed messages/tools (naming the field) and ChatTemplateError if a template fails.
    """
    tool_list = validate_tools(tools)
    validate_tool_choice(tool_choice, tool_list)
    msgs = normalize_messages(messages)
    if tool_choice == "none" and exclude_tools_when_none:
        tool_list = []  # as vLLM's --exclude-tools-when-tool-choice-none: the model never sees them
    if chat_template is None:
        return _render_flint(msgs, tool_list, enable_thinking, clear_thinking, add_generation_prompt)
    return render_jinja(
        chat_template,
        messages=msgs,
        tools=[dict(t) for t in tool_list] or None,
        tool_choice=tool_choice,
        enable_thinking=enable_thinking,
        clear_thinking=clear_thinking,
        add_generation_prompt=add_generation_prompt,
    )


def _render_flint(
    msgs: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    enable_thinking: bool,
    clear_thinking: bool,
    add_generation_prompt: bool,
) -> str:
    out = [tags.GMASK, tags.SOP]
    if tools:
        out.append(TOOLS_HEAD)
        out.extend(json.dumps(t, ensure_ascii=False) + "\n" for t in tools)
        out.append(TOOLS_TAIL)
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out += [tags.SYSTEM, m["content"]]
        elif role == "user":
            out += [tags.USER, m["content"]]
        elif role == "tool":
            if i == 0 or msgs[i - 1]["role"] != "tool":
                out.append(tags.OBSERVATION)  # one observation turn per run of tool results
            out += [tags.TOOL_RESPONSE_START, m["content"], tags.TOOL_RESPONSE_END]
        else:
            reasoning, content = _split_reasoning(m)
            out.append(tags.ASSISTANT)
            # Reasoning of turns before the last user message is dropped: the model never saw it there.
            if (not clear_thinking or i > last_user) and reasoning.strip():
                out += [tags.THINK_START, reasoning.strip(), tags.THINK_END]
            else:
                out.append(tags.THINK_END)
            out.append(content.strip())
            out.extend(format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
    if add_generation_prompt:
        out += [tags.ASSISTANT, tags.THINK_START if enable_thinking else tags.THINK_END]
    return "".join(out)


def _split_reasoning(m: Mapping[str, Any]) -> tuple[str, str]:
    """(reasoning, content) of an assistant turn; reasoning may also arrive inline as `<think>..</think>` content."""
    content = m["content"]
    if isinstance(m["reasoning_content"], str):
        return m["reasoning_content"], content
    if tags.THINK_END not in content:
        return "", content
    reasoning, content = content.split(tags.THINK_END, 1)
    reasoning = reasoning.strip()
    if reasoning.startswith(tags.THINK_START):
        reasoning = reasoning[len(tags.THINK_START):]
    return reasoning, content


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """`<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`: strings raw, the rest JSON."""
    parts = [tags.TOOL_CALL_START, name]
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parts += [tags.ARG_KEY_START, key, tags.ARG_KEY_END, tags.ARG_VALUE_START, text, tags.ARG_VALUE_END]
    parts.append(tags.TOOL_CALL_END)
    return "".join(parts)


# --- jinja ---------------------------------------------------------------------------------------------------

# Every tag strips the whitespace around it, so layout here never reaches the prompt; all text is printed from
# string literals. Variables absent in other engines (clear_thinking, enable_thinking) get Flint's defaults.
_FLINT_JINJA = """\
{#- Flint chat template (GLM-4.7 style). Renders exactly like flint_jax.chat.render. -#}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set clear = clear_thinking if clear_thinking is defined else true -%}
{{- @GMASK@ ~ @SOP@ -}}
{%- if tools -%}
  {{- @TOOLS_HEAD@ -}}
  {%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) ~ "\\n" -}}{%- endfor -%}
  {{- @TOOLS_TAIL@ -}}
{%- endif -%}
{%- for m in messages -%}
  {%- set content = m.content if m.content is string else '' -%}
  {%- if m.role == 'system' -%}
    {{- @SYSTEM@ ~ content -}}
  {%- elif m.role == 'user' -%}
    {{- @USER@ ~ content -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- @OBSERVATION@ -}}{%- endif -%}
    {{- @TOOL_RESPONSE_START@ ~ content ~ @TOOL_RESPONSE_END@ -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content -%}
    {%- if reasoning is not string -%}
      {%- set reasoning = '' -%}
      {%- if @THINK_END@ in content -%}
        {%- set halves = content.split(@THINK_END@, 1) -%}
        {%- set reasoning = halves[0].strip() -%}
        {%- if reasoning.startswith(@THINK_START@) -%}{%- set reasoning = reasoning[@THINK_START_LEN@:] -%}{%- endif -%}
        {%- set content = halves[1] -%}
      {%- endif -%}
    {%- endif -%}
    {{- @ASSISTANT@ -}}
    {%- if (not clear or loop.index0 > ns.last_user) and reasoning.strip() -%}
      {{- @THINK_START@ ~ reasoning.strip() ~ @THINK_END@ -}}
    {%- else -%}
      {{- @THINK_END@ -}}
    {%- endif -%}
    {{- content.strip() -}}
    {%- for tc in m.tool_calls or [] -%}
      {%- set f = tc.function if tc.function is defined else tc -%}
      {{- @TOOL_CALL_START@ ~ f.name -}}
      {%- if f.arguments is mapping -%}
        {%- for k, v in f.arguments.items() -%}
          {{- @ARG_KEY_START@ ~ k ~ @ARG_KEY_END@ ~ @ARG_VALUE_START@ -}}
          {{- v if v is string else v | tojson(ensure_ascii=False) -}}
          {{- @ARG_VALUE_END@ -}}
        {%- endfor -%}
      {%- endif -%}
      {{- @TOOL_CALL_END@ -}}
    {%- endfor -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- @ASSISTANT@ ~ (@THINK_END@ if enable_thinking is defined and not enable_thinking else @THINK_START@) -}}
{%- endif -%}
"""


def _fill(source: str) -> str:
    # Tag spellings and the tool block come from the Python constants, printed as jinja string literals
    # (JSON escapes are valid jinja escapes), so the two renderers cannot drift apart in wording.
    values: dict[str, str] = {name: getattr(tags, name) for name in dir(tags) if name.isupper()
                              and isinstance(getattr(tags, name), str)}
    values |= {"TOOLS_HEAD": TOOLS_HEAD, "TOOLS_TAIL": TOOLS_TAIL}
    for name, value in values.items():
        source = source.replace(f"@{name}@", json.dumps(value))
    return source.replace("@THINK_START_LEN@", str(len(tags.THINK_START)))


FLINT_CHAT_TEMPLATE: str = _fill(_FLINT_JINJA)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's semantics (no HTML escaping, key order kept), which GGUF templates are written against;
    # jinja's built-in tojson would escape '<' and sort keys.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_jinja(source: str, **variables: Any) -> str:
    """Render a jinja chat template in the sandbox; any failure becomes ChatTemplateError."""
    try:
        template = _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e
    try:
        return template.render(**variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e.message or e}") from e
    except Exception as e:  # a template can call methods that raise anything (TypeError, KeyError, ...)
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
