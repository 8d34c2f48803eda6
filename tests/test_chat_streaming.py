"""StreamingParser: any chunking gives parse_assistant's message, and the deltas add up to it."""

import json
import random

import pytest

from flint_jax.chat import StreamingParser, parse_assistant
from test_chat_parser import FRAGMENTS, TOOLS, random_text

LONG = "".join(f"row {i}: <b>{{\"k\": [{i}]}}</b> 中文 😀\n" for i in range(200))[:4000]

CASES = [
    "",
    "Plain reasoning only, no end",
    "Let me think.</think>The answer is 4.",
    "\n<think>\nhm\n</think>\n\nHi\n",
    "r</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value> Paris </arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    "r</think>\nOK.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
    "<tool_call>now\n</tool_call>\n",
    "</think>A <tool_call>now junk</tool_call> B<tool_call>nope</tool_call> C<tool_call>now</tool_call>",
    "r</think>Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
    "r</think>Done.<|observation|><tool_response>x</tool_response>",
    "思考🤔</think>好的 😀<tool_call>write_file<arg_key>path</arg_key><arg_value>笔记.md</arg_value>"
    "<arg_key>content</arg_key><arg_value>Ünï 👩‍💻\n中文</arg_value></tool_call>",
    f"</think><tool_call>write_file<arg_key>content</arg_key><arg_value>{LONG}</arg_value></tool_call>",
    "</think><tool_call>get_weather<arg_key>where</arg_key><arg_value>{\"a\": {\"b\": [1, {\"c\": null}]}}"
    "</arg_value><arg_key>tags</arg_key><arg_value>[\"x\", [2]]</arg_value></tool_call>",
    "a < b and c <tool d <| e </think> f <tool_call",
    "<thin",
    "  <think",
]


def run(text: str, chunks: list[int], enable_thinking: bool = True):
    parser = StreamingParser(TOOLS, enable_thinking)
    deltas, pos = [], 0
    for size in chunks:
        deltas += parser.feed(text[pos:pos + size])
        pos += size
    deltas += parser.feed(text[pos:])
    deltas += parser.flush()
    return parser.finish(), deltas


def assemble(deltas):
    """What a streaming client builds from the deltas."""
    fields = {"content": "", "reasoning_content": ""}
    calls = []
    for delta in deltas:
        assert len(delta) == 1
        (key, value), = delta.items()
        if key == "tool_calls":
            for call in value:
                assert call["index"] == len(calls)
                calls.append({k: v for k, v in call.items() if k != "index"})
        else:
            assert value  # no empty deltas
            fields[key] += value
    return {"role": "assistant", "content": fields["content"] or None,
            "reasoning_content": fields["reasoning_content"] or None, "tool_calls": calls}


def check(text: str, chunks: list[int], enable_thinking: bool = True) -> None:
    final, deltas = run(text, chunks, enable_thinking)
    assert final == parse_assistant(text, TOOLS, enable_thinking)
    assert assemble(deltas) == final


@pytest.mark.parametrize("size", [1, 2, 3, 5, None])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("thinking", [True, False])
def test_fixed_chunk_sizes(case, size, thinking):
    text = CASES[case]
    check(text, [size] * (len(text) // size) if size else [], thinking)


def test_random_chunkings_of_random_texts():
    rng = random.Random(1)
    texts = CASES + [random_text(rng) for _ in range(300)]
    for text in texts:
        for _ in range(3):
            chunks = [rng.randint(1, 8) for _ in range(len(text) // 3 + 1)]
            check(text, chunks, enable_thinking=rng.random() < 0.7)


def test_text_that_may_start_a_tag_is_held_back():
    p = StreamingParser(TOOLS, enable_thinking=False)
    assert p.feed("Hello <tool") == [{"content": "Hello"}]  # trailing space held too: it may end the content
    assert p.feed("box> x <|us") == [{"content": " <toolbox> x"}]
    assert p.feed("er|>ignored") == []
    assert p.flush() == []
    assert p.finish()["content"] == "Hello <toolbox> x"


def test_leading_think_is_held_until_known():
    p = StreamingParser(TOOLS, enable_thinking=False)
    assert p.feed(" <thi") == []
    assert p.feed("nk>why") == [{"reasoning_content": "why"}]
    assert p.feed("</thi") == []
    assert p.feed("nk>ok") == [{"content": "ok"}]
    assert p.finish() == {"role": "assistant", "content": "ok", "reasoning_content": "why", "tool_calls": []}


def test_tool_call_delta_shape_and_end_of_stream():
    p = StreamingParser(TOOLS)
    deltas = p.feed("r</think>Hi")
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call><"
    for i, ch in enumerate(text):
        out = p.feed(ch)
        assert out == [] or i == len(text) - 2  # the call arrives whole, with its closing '>'
        deltas += out
    assert deltas[:2] == [{"reasoning_content": "r"}, {"content": "Hi"}]
    (call,) = deltas[2]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    assert len(deltas) == 3
    assert p.flush() == [{"content": "<"}]  # the held '<' was text after all
    assert p.finish()["tool_calls"][0]["id"] == call["id"]
    with pytest.raises(RuntimeError):
        p.feed("more")


def test_fragments_are_covered():
    # Every tag the parser knows appears in the random-text alphabet above.
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "<|user|>", "<|observation|>", "<|endoftext|>"):
        assert tag in FRAGMENTS
