"""The demo corpus: deterministic toy tools, disjoint held-out values, rendering and loss spans, the tokenizer."""

import itertools
import json
import random
import re

import pytest

from flint_jax import corpus as C
from flint_jax.chat import FlintTokenizer, parse_assistant, render, tags


def test_tools_are_deterministic():
    assert C.calculator("12 * 3") == "36"
    assert C.calculator("7 / 2") == "3.5"
    assert C.calculator("10 / 3") == "3.33"
    assert C.calculator("(2 + 3) * -4") == "-20"
    assert C.calculator("2 ** 10").startswith("error")
    assert C.calculator("__import__('os')").startswith("error")
    assert C.calculator("1 / 0").startswith("error")
    assert C.convert_units(100, "C", "F") == "212"
    assert C.convert_units(10, "km", "mi") == "6.21"
    assert C.convert_units(1, "kg", "km").startswith("error")
    flight = C.TRAIN_FLIGHTS[0]
    row = json.loads(C.lookup_flight(flight))
    assert row == {"flight": flight, **C.FLIGHTS[flight]}
    assert C.lookup_flight("XX1").startswith("error")
    assert C.call_tool("calculator", '{"expression": "1 + 2"}') == "3"
    assert C.call_tool("nope", {}).startswith("error")
    assert C.call_tool("calculator", {"x": 1}).startswith("error")


def test_flight_table_is_fixed_and_split():
    assert len(C.FLIGHTS) == 60 and len(C.HELD_OUT_FLIGHTS) == 20
    assert set(C.HELD_OUT_FLIGHTS).isdisjoint(C.TRAIN_FLIGHTS)
    assert C._flight_table() == C.FLIGHTS


def _user_numbers(messages):
    return [int(n) for m in messages if m["role"] == "user" for n in re.findall(r"\d+", m["content"])]


def test_held_out_values_never_appear_in_training():
    rng = random.Random(0)
    for _ in range(500):
        case = C.tool_case(rng, "train")
        if case.tool == "lookup_flight":  # flights are split by table row, numbers by value
            assert case.arguments["flight"] in C.TRAIN_FLIGHTS
        else:
            assert not any(C.is_held_out_number(n) for n in _user_numbers(case.messages())), case.question
    for case in C.held_out_cases(60):
        if case.tool == "lookup_flight":
            assert case.arguments["flight"] in C.HELD_OUT_FLIGHTS
        else:
            assert all(C.is_held_out_number(n) for n in _user_numbers(case.messages())), case.question
    texts = "".join(s.text for s in itertools.islice(C.samples(0), 2000))
    assert not any(f in texts for f in C.HELD_OUT_FLIGHTS)


def test_held_out_cases_are_reproducible_and_mixed():
    a, b = C.held_out_cases(9), C.held_out_cases(9)
    assert [c.question for c in a] == [c.question for c in b]
    assert [c.tool for c in a] == ["calculator", "convert_units", "lookup_flight"] * 3
    for c in a:
        assert C.call_tool(c.tool, c.arguments) == c.result
        assert C.expected_value(c) in c.answer


def test_samples_render_like_the_engine_and_spans_are_generations():
    for s in itertools.islice(C.samples(1), 200):
        assert s.text.startswith(tags.GMASK + tags.SOP)
        assert s.spans
        for start, end in s.spans:
            # Each span follows the generation prompt and ends with the stop marker generation stops at.
            assert s.text[:start].endswith(tags.ASSISTANT + tags.THINK_START)
            assert s.text[:end].endswith((tags.OBSERVATION, tags.USER, tags.ENDOFTEXT))
            assert tags.USER not in s.text[start:end - len(tags.USER)]
    case = C.held_out_cases(1)[0]
    sample = C.render_sample([], case.messages(), C.DEMO_TOOLS)
    assert sample.text == render(case.messages(), tools=C.DEMO_TOOLS, add_generation_prompt=False) + tags.ENDOFTEXT
    first = sample.text[sample.spans[0][0]:sample.spans[0][1]]
    msg = parse_assistant(first, tools=C.DEMO_TOOLS)
    assert msg["tool_calls"][0]["function"]["name"] == case.tool
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == case.arguments


@pytest.fixture(scope="module")
def tokenizer():
    return C.train_tokenizer([s.text for s in itertools.islice(C.samples(0), 1500)], 768)


def test_tokenizer_digits_are_single_tokens_and_markers_single_ids(tokenizer):
    ids = tokenizer.encode("4821")
    assert [tokenizer.decode([i]) for i in ids] == ["4", "8", "2", "1"]
    for t in tags.FLINT_SPECIAL_TOKENS:
        assert len(tokenizer.encode(t)) == 1
    assert tokenizer.vocab_size == 768
    assert tokenizer.gguf_pre == "qwen2"


def test_tokenizer_round_trips_through_gguf_metadata(tokenizer):
    again = FlintTokenizer.from_gguf_metadata(tokenizer.to_gguf_metadata())
    s = next(C.samples(5))
    assert again.encode(s.text) == tokenizer.encode(s.text)
    assert again.decode(tokenizer.encode(s.text)) == s.text


def test_encode_sample_marks_exactly_the_spans(tokenizer):
    s = next(C.samples(2))
    ids, target = C.encode_sample(tokenizer, s)
    marked = tokenizer.decode([int(i) for i, t in zip(ids, target) if t])
    assert marked == "".join(s.text[a:b] for a, b in s.spans)
