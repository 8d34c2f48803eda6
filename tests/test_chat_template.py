"""Prompt rendering (FLINT_SPEC section 5): exact strings, the jinja twin, sandboxed templates, bad input."""

import json

import pytest

from flint_jax.chat import FLINT_CHAT_TEMPLATE, ChatTemplateError, render

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}},
    },
}
TOOLS = [WEATHER, SEARCH]

# Written out by hand (not built from the module's constants) so a change of wording fails here.
TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": '
    '{"q": {"type": "string"}, "filters": {"type": "object"}}}}}\n'
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)

# A full agent loop: question, reasoning + two tool calls, two results, answer, follow-up, another call and result.
AGENT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in 北京 and Paris? 😀"},
    {
        "role": "assistant",
        "reasoning_content": "Two cities, two calls.",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "北京", "days": 2}}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": " Paris ", "days": 1}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 30}'},
    {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    {"role": "assistant", "reasoning_content": "Summarize.", "content": "Hot in 北京, sunny in Paris."},
    {"role": "user", "content": "Search news."},
    {
        "role": "assistant",
        "reasoning_content": "Search it.",
        "content": None,
        "tool_calls": [{"type": "function", "function": {
            "name": "search", "arguments": {"q": "news", "filters": {"lang": ["zh", "en"], "recent": True}}}}],
    },
    {"role": "tool", "content": "no news"},
]

AGENT_TAIL = (
    "<|system|>Be brief."
    "<|user|>Weather in 北京 and Paris? 😀"
    "<|assistant|></think>Checking."
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value>"
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value> Paris </arg_value>"
    "<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>"
    '<|observation|><tool_response>{"temp": 30}</tool_response><tool_response>sunny</tool_response>'
    "<|assistant|></think>Hot in 北京, sunny in Paris."
    "<|user|>Search news."
    "<|assistant|><think>Search it.</think>"
    '<tool_call>search<arg_key>q</arg_key><arg_value>news</arg_value>'
    '<arg_key>filters</arg_key><arg_value>{"lang": ["zh", "en"], "recent": true}</arg_value></tool_call>'
    "<|observation|><tool_response>no news</tool_response>"
)


def test_single_turn_thinking_on_and_off():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render(msgs) == "[gMASK]<sop><|user|>Hi<|assistant|><think>"
    assert render(msgs, enable_thinking=False) == "[gMASK]<sop><|user|>Hi<|assistant|></think>"
    assert render(msgs, add_generation_prompt=False) == "[gMASK]<sop><|user|>Hi"


def test_tools_block_then_user_system_message():
    msgs = [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"}]
    assert render(msgs, TOOLS) == f"[gMASK]<sop>{TOOLS_BLOCK}<|system|>Sys<|user|>Hi<|assistant|><think>"


def test_multi_turn_agent_loop_exact():
    assert render(AGENT, TOOLS) == f"[gMASK]<sop>{TOOLS_BLOCK}{AGENT_TAIL}<|assistant|><think>"
    assert render(AGENT, TOOLS, enable_thinking=False).endswith("no news</tool_response><|assistant|></think>")


def test_clear_thinking_false_keeps_all_reasoning():
    out = render(AGENT, TOOLS, clear_thinking=False)
    assert "<|assistant|><think>Two cities, two calls.</think>Checking.<tool_call>" in out
    assert "<|assistant|><think>Summarize.</think>Hot in" in out
    assert "<|assistant|><think>Search it.</think><tool_call>search" in out


def test_reasoning_after_last_user_is_kept_even_without_tools():
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": " old ", "content": " A "},
        {"role": "user", "content": "b"},
        {"role": "assistant", "reasoning_content": "new", "content": "B"},
        {"role": "assistant", "reasoning_content": "   ", "content": "C"},
    ]
    assert render(msgs, add_generation_prompt=False) == (
        "[gMASK]<sop><|user|>a<|assistant|></think>A<|user|>b<|assistant|><think>new</think>B"
        "<|assistant|></think>C"
    )
    assert render(msgs, clear_thinking=False, add_generation_prompt=False) == (
        "[gMASK]<sop><|user|>a<|assistant|><think>old</think>A<|user|>b<|assistant|><think>new</think>B"
        "<|assistant|></think>C"
    )


def test_inline_think_in_assistant_content():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\nbecause"}]
    assert render(msgs, add_generation_prompt=False) == (
        "[gMASK]<sop><|user|>q<|assistant|><think>why</think>because"
    )


def test_tool_choice_none_excludes_tools_by_default():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render(msgs, TOOLS, tool_choice="none") == "[gMASK]<sop><|user|>Hi<|assistant|><think>"
    with_tools = render(msgs, TOOLS, tool_choice="none", exclude_tools_when_none=False)
    assert with_tools == f"[gMASK]<sop>{TOOLS_BLOCK}<|user|>Hi<|assistant|><think>"
    assert render(msgs, TOOLS, tool_choice="required") == with_tools
    named = {"type": "function", "function": {"name": "search"}}
    assert render(msgs, TOOLS, tool_choice=named) == with_tools
    assert render(msgs, []) == render(msgs)


def test_text_parts_and_non_ascii_tool_schema():
    tool = {"type": "function", "function": {"name": "翻译", "description": "把文字翻成英文 ✨"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "你好"}, {"type": "text", "text": "!"}]}]
    out = render(msgs, [tool])
    assert '{"type": "function", "function": {"name": "翻译", "description": "把文字翻成英文 ✨"}}\n' in out
    assert out.endswith("<|user|>你好!<|assistant|><think>")


def test_observation_per_run_of_tool_messages():
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "3"},
    ]
    assert render(msgs, add_generation_prompt=False) == (
        "[gMASK]<sop><|user|>u<|observation|><tool_response>1</tool_response><tool_response>2</tool_response>"
        "<|assistant|></think>a<|observation|><tool_response>3</tool_response>"
    )


def test_messages_are_not_modified():
    before = json.dumps(AGENT)
    render(AGENT, TOOLS, chat_template=FLINT_CHAT_TEMPLATE)
    render(AGENT, TOOLS)
    assert json.dumps(AGENT) == before


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
    AGENT,
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": " x <think>r2</think> b "}],
    [{"role": "tool", "content": "t"}, {"role": "assistant", "content": None,
                                        "tool_calls": [{"function": {"name": "search", "arguments": "{}"}}]}],
    [{"role": "user", "content": "<tool_call>not a call</tool_call> {{ 1 }} {% raw %}"}],
]
OPTIONS = [
    {},
    {"enable_thinking": False},
    {"clear_thinking": False},
    {"tool_choice": "none"},
    {"tool_choice": "none", "exclude_tools_when_none": False, "add_generation_prompt": False},
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_jinja_template_matches_python_renderer(conversation, options, tools):
    msgs = CONVERSATIONS[conversation]
    assert render(msgs, tools, chat_template=FLINT_CHAT_TEMPLATE, **options) == render(msgs, tools, **options)


def test_custom_template_gets_hf_tojson_and_options():
    template = (
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
        "{{ tools | tojson }}|{{ enable_thinking }}|{{ clear_thinking }}|{{ add_generation_prompt }}"
    )
    out = render([{"role": "user", "content": "<b>&"}], [SEARCH], chat_template=template, enable_thinking=False)
    # No HTML escaping and no key sorting, unlike jinja's built-in tojson.
    assert out == f"[user:<b>&]{json.dumps([SEARCH])}|False|True|True"
    out = render([{"role": "user", "content": "x"}], TOOLS, tool_choice="none", chat_template="{{ tools }}")
    assert out == "None"


def test_template_failures_are_chat_template_errors():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="no system role"):
        render(msgs, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render(msgs, chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError):
        render(msgs, chat_template="{{ messages.append(1) }}")  # immutable sandbox
    with pytest.raises(ChatTemplateError):
        render(msgs, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render(msgs, chat_template="{{ 1 // 0 }}")
    assert isinstance(ChatTemplateError("x"), ValueError)


BAD_INPUT = [
    ({"messages": "hi"}, "messages: must be a list"),
    ({"messages": []}, "at least one message"),
    ({"messages": ["hi"]}, r"messages\[0\]: must be an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]}, r"messages\[1\]\.content: required"),
    ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content: must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     r"messages\[0\]\.content\[0\]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, ]}, None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, r"messages\[0\]\.tool_calls: only"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]},
     r"messages\[0\]\.reasoning_content"),
    ({"messages": [{"role": "assistant", "tool_calls": {"function": {}}}]}, r"messages\[0\]\.tool_calls: must be"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: must be a JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     r"messages\[0\]\.tool_calls\[0\]\.function\.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}]},
     r"messages\[0\]\.tool_calls\[0\]\.type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"x": {1, 2}}}}]}]},
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: not JSON-serializable"),
    ({"tools": {"type": "function"}}, "tools: must be a list"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\]\.function: missing"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, r"tools\[0\]\.type"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name"}}]}, r"tools\[1\]\.function\.name"),
    ({"tools": [WEATHER, WEATHER]}, r"tools\[1\]\.function\.name: duplicate"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     r"tools\[0\]\.function\.parameters\.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]},
     r"tools\[0\]\.function\.parameters\.properties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}]},
     r"tools\[0\]\.function\.parameters\.required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     r"tools\[0\]\.function\.description"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice: expected"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     r"tool_choice\.function\.name: 'nope'"),
]


@pytest.mark.parametrize("kwargs,error", BAD_INPUT)
def test_bad_input_raises_value_error_naming_the_field(kwargs, error):
    kwargs = {"messages": [{"role": "user", "content": "x"}], **kwargs}
    if error is None:  # an empty tool_calls list on a user message is harmless
        render(**kwargs)
        return
    with pytest.raises(ValueError, match=error):
        render(**kwargs)
