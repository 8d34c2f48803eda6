"""One-shot parsing of model output into an OpenAI assistant message (FLINT_SPEC section 5)."""

import json
import random
import re

import pytest

from flint_jax.chat import finish_reason, parse_assistant, render

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "note": {"type": ["string", "null"]}, "where": {"type": "object"}, "tags": {"type": "array"},
        "unit": {"enum": ["c", "f"]}, "any": {"anyOf": [{"type": "string"}, {"type": "number"}]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters schema at all
]


def args(message, i=0):
    return json.loads(message["tool_calls"][i]["function"]["arguments"])


def msg(content=None, reasoning=None, calls=()):
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": list(calls)}


def test_reasoning_then_content():
    assert parse_assistant("Let me think.</think>The answer is 4.") == msg("The answer is 4.", "Let me think.")
    assert parse_assistant("\n<think>\nhm\n</think>\n\nHi\n") == msg("Hi", "hm")  # leading <think> tolerated


def test_no_think_end_means_all_reasoning():
    assert parse_assistant("still thinking <tool_call>x") == msg(None, "still thinking <tool_call>x")
    assert parse_assistant("") == msg()
    assert parse_assistant("   \n") == msg()


def test_thinking_off():
    assert parse_assistant("Hello</think>x", enable_thinking=False) == msg("Hello</think>x")
    # A model that opens a think block anyway still gets it split off.
    assert parse_assistant("<think>r</think>Hi", enable_thinking=False) == msg("Hi", "r")
    assert parse_assistant(" <think> r", enable_thinking=False) == msg(None, "r")
    assert parse_assistant("a <think>r</think>", enable_thinking=False) == msg("a <think>r</think>")


def test_glm47_tool_call_exact():
    text = ("Need weather.</think>Checking now.<tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
    out = parse_assistant(text, TOOLS)
    assert out["content"] == "Checking now." and out["reasoning_content"] == "Need weather."
    (call,) = out["tool_calls"]
    assert call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    assert finish_reason(out) == "tool_calls"


def test_glm45_newline_form():
    text = ("r</think>\nOK.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
            "<tool_call>now\n</tool_call>\n")
    out = parse_assistant(text, TOOLS)
    assert out["content"] == "OK."
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_weather", "now"]
    assert args(out) == {"city": "Paris", "days": 2} and args(out, 1) == {}


def test_zero_args_and_several_calls_without_content():
    text = "</think><tool_call>now</tool_call><tool_call>now</tool_call><tool_call>get_weather</tool_call>"
    out = parse_assistant(text, TOOLS)
    assert out["content"] is None and out["reasoning_content"] is None
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == ["{}", "{}", "{}"]
    assert len({c["id"] for c in out["tool_calls"]}) == 3  # distinct within a message
    assert parse_assistant(text, TOOLS) == out  # and deterministic


def test_values_typed_by_schema():
    pairs = {
        "city": "  New York \n",  # string: raw, whitespace kept
        "days": " 7 ",
        "metric": "true",
        "note": "null",  # ["string", "null"]: still text
        "where": '{"lat": 1.5, "tags": ["a", {"b": null}]}',
        "tags": '["x", 2]',
        "unit": "c",  # string enum
        "any": "12",  # untyped (anyOf): JSON when it parses
    }
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs.items())
    out = parse_assistant(f"</think><tool_call>get_weather{body}</tool_call>", TOOLS)
    assert args(out) == {"city": "  New York \n", "days": 7, "metric": True, "note": "null",
                         "where": {"lat": 1.5, "tags": ["a", {"b": None}]}, "tags": ["x", 2], "unit": "c", "any": 12}


def test_values_that_do_not_match_their_type_stay_text():
    text = ("</think><tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value>"
            "<arg_key>metric</arg_key><arg_value>NaN</arg_value><arg_key>city</arg_key><arg_value>42</arg_value>"
            "</tool_call>")
    assert args(parse_assistant(text, TOOLS)) == {"days": "three", "metric": "NaN", "city": "42"}


def test_no_schema_json_when_it_parses():
    text = ("</think><tool_call>now<arg_key>tz</arg_key><arg_value>UTC</arg_value><arg_key>n</arg_key>"
            '<arg_value>5</arg_value><arg_key>o</arg_key><arg_value>{"a": [1, "两"]}</arg_value>'
            "<arg_key>s</arg_key><arg_value>\"quoted\"</arg_value><arg_key>e</arg_key><arg_value></arg_value>"
            "</tool_call>")
    assert args(parse_assistant(text, TOOLS)) == {"tz": "UTC", "n": 5, "o": {"a": [1, "两"]}, "s": "quoted", "e": ""}


def test_unknown_tools_are_dropped():
    text = ("</think>Hi<tool_call>rm_rf<arg_key>p</arg_key><arg_value>/</arg_value></tool_call>"
            "<tool_call>now</tool_call>")
    out = parse_assistant(text, TOOLS)
    assert out["content"] == "Hi" and [c["function"]["name"] for c in out["tool_calls"]] == ["now"]
    assert parse_assistant(text) == msg("Hi")  # no tools offered: every call is dropped
    assert finish_reason(parse_assistant(text)) == "stop"


def test_unterminated_call_is_content():
    text = "r</think>Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"
    out = parse_assistant(text, TOOLS)
    assert out == msg("Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", "r")
    assert finish_reason(out, length_limited=True) == "length"
    done = "</think><tool_call>now</tool_call>then <tool_call>now"
    assert parse_assistant(done, TOOLS)["content"] == "then <tool_call>now"


@pytest.mark.parametrize("bad", [
    "<tool_call>now junk</tool_call>",  # name with a space
    "<tool_call></tool_call>",  # no name
    "<tool_call>now<arg_key>a</arg_key>oops<arg_value>1</arg_value></tool_call>",  # text between tags
    "<tool_call>now<arg_key>a</arg_key></tool_call>",  # key without a value
    "<tool_call>now<arg_key> </arg_key><arg_value>1</arg_value></tool_call>",  # empty key
    "<tool_call>now<arg_key>a</arg_key><arg_value>1</tool_call>",  # value cut by </tool_call>
    "<tool_call>now<arg_key>a</tool_call>",
    "<tool_call>now trailing<arg_value>1</arg_value></tool_call>",
])
def test_malformed_call_is_content_and_parsing_continues(bad):
    out = parse_assistant(f"</think>A {bad} B<tool_call>now</tool_call>", TOOLS)
    assert out["content"] == f"A {bad} B"
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["now"]


def test_stop_markers_end_the_message():
    text = "r</think>Done.<|observation|><tool_response>x</tool_response>"
    assert parse_assistant(text) == msg("Done.", "r")
    assert parse_assistant("r<|user|></think>x") == msg(None, "r")
    assert parse_assistant("</think>a<tool_call>now<|endoftext|></tool_call>", TOOLS) == msg("a<tool_call>now")


def test_unicode_passes_through_unescaped():
    text = ("思考中🤔</think>好的 😀<tool_call>write_file<arg_key>path</arg_key><arg_value>笔记/日本語.md"
            "</arg_value><arg_key>content</arg_key><arg_value>Ünïcödé ✓ 👩‍💻\n中文</arg_value></tool_call>")
    out = parse_assistant(text, TOOLS)
    assert out["reasoning_content"] == "思考中🤔" and out["content"] == "好的 😀"
    raw = out["tool_calls"][0]["function"]["arguments"]
    assert "笔记/日本語.md" in raw and "👩‍💻" in raw and "\\u" not in raw
    assert args(out) == {"path": "笔记/日本語.md", "content": "Ünïcödé ✓ 👩‍💻\n中文"}


def test_long_argument_kept_exactly():
    code = "".join(f"line {i}: {{'k': [1, 2]}} <b>&amp; \"q\" \\ 中\n" for i in range(120))[:4000]
    assert len(code) == 4000
    text = f"</think><tool_call>write_file<arg_key>path</arg_key><arg_value>a.py</arg_value>" \
           f"<arg_key>content</arg_key><arg_value>{code}</arg_value></tool_call>"
    assert args(parse_assistant(text, TOOLS)) == {"path": "a.py", "content": code}


def test_render_then_parse_round_trip():
    arguments = {"city": " 北京 ", "days": 3, "where": {"a": [1, None, {"b": "c"}]}, "metric": False}
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "why", "content": "ok",
              "tool_calls": [{"function": {"name": "get_weather", "arguments": arguments}}]}]
    prompt = render(convo, TOOLS, add_generation_prompt=False)
    generated = prompt.split("<|assistant|><think>", 1)[1]
    out = parse_assistant(generated, TOOLS)
    assert out["content"] == "ok" and out["reasoning_content"] == "why" and args(out) == arguments


def test_finish_reason():
    assert finish_reason(msg("x")) == "stop"
    assert finish_reason(msg(calls=[{"id": "c"}])) == "tool_calls"
    assert finish_reason(msg(calls=[{"id": "c"}]), length_limited=True) == "length"


def test_bad_tools_are_value_errors():
    with pytest.raises(ValueError, match=r"tools\[0\]\.function"):
        parse_assistant("x", [{"type": "function"}])


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<|user|>", "<|observation|>", "<|endoftext|>", "<", "</", "<tool", "now", "city",
             "get_weather", "write_file", "nope", " ", "\n", "x", "42", '{"a": 1}', "中文", "😀", ">", "<|"]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))


def test_malformed_output_never_raises():
    rng = random.Random(0)
    for _ in range(1500):
        text = random_text(rng)
        for thinking in (True, False):
            out = parse_assistant(text, TOOLS, enable_thinking=thinking)
            assert set(out) == {"role", "content", "reasoning_content", "tool_calls"}
            for call in out["tool_calls"]:
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert parse_assistant(None) == msg()  # type: ignore[arg-type]
