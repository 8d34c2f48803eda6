"""The demo model's world: three toy tools with deterministic answers, and a synthetic chat corpus over them.

`scripts/train_tiny.py` trains the embedded demo model (`flint_jax.default_model`) on conversations generated
here, rendered with `flint_jax.chat.render` exactly as the engine renders a live chat (GLM-4.7 style: tools in
the system block, `<think>` reasoning, `<tool_call>` blocks, `<|observation|><tool_response>` results).

Held-out data uses values the training data never contains, so a model that passes the held-out tests must copy
them from the prompt rather than recall them: numbers come from disjoint sets (`is_held_out_number`) and the flight
table is split into training and held-out flights. Digits are single tokens (`train_tokenizer`), which is what
makes copying numbers learnable for a model this small.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import random
from typing import Any, Iterator, Literal

from flint_jax.chat import FlintTokenizer, render, train_bpe_tokenizer
from flint_jax.chat import tags

Split = Literal["train", "held_out"]

# ---- the tools ------------------------------------------------------------------------------------------------

DEMO_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert a value from one unit to another.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"]}}},
    {"type": "function", "function": {
        "name": "lookup_flight", "description": "Gate and departure time of a flight.",
        "parameters": {"type": "object", "properties": {"flight": {"type": "string"}}, "required": ["flight"]}}},
]

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def format_number(x: float) -> str:
    """Results as the tools print them: integers plainly, other values rounded to 2 decimals ("26.1", "-3.75")."""
    text = f"{round(float(x), 2):.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculator(expression: str) -> str:
    """`+ - * /` and parentheses over numbers; anything else is an error message, never an exception."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported expression")
    try:
        return format_number(ev(ast.parse(str(expression), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


# unit -> (canonical unit, factor to it); temperatures are handled apart (offsets).
UNITS: dict[str, tuple[str, float]] = {
    "km": ("m", 1000.0), "m": ("m", 1.0), "mi": ("m", 1609.344), "ft": ("m", 0.3048),
    "kg": ("kg", 1.0), "lb": ("kg", 0.45359237),
    "l": ("l", 1.0), "gal": ("l", 3.785411784),
}
UNIT_NAMES = {"km": "kilometers", "m": "meters", "mi": "miles", "ft": "feet", "kg": "kilograms", "lb": "pounds",
              "l": "liters", "gal": "gallons", "C": "degrees Celsius", "F": "degrees Fahrenheit"}
UNIT_PAIRS = [("km", "mi"), ("mi", "km"), ("m", "ft"), ("ft", "m"), ("kg", "lb"), ("lb", "kg"), ("l", "gal"),
              ("gal", "l"), ("C", "F"), ("F", "C"), ("km", "m"), ("m", "km")]


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return f"error: value {value!r} is not a number"
    if (from_unit, to_unit) == ("C", "F"):
        return format_number(v * 9 / 5 + 32)
    if (from_unit, to_unit) == ("F", "C"):
        return format_number((v - 32) * 5 / 9)
    if from_unit not in UNITS or to_unit not in UNITS or UNITS[from_unit][0] != UNITS[to_unit][0]:
        return f"error: cannot convert {from_unit} to {to_unit}"
    return format_number(v * UNITS[from_unit][1] / UNITS[to_unit][1])


def _flight_table() -> dict[str, dict[str, str]]:
    rng = random.Random(1234)
    numbers = rng.sample(range(100, 1000), 60)
    return {f"FL{n}": {"gate": f"{rng.choice('ABCD')}{rng.randint(1, 30)}",
                       "departs": f"{rng.randint(5, 23):02d}:{rng.choice(range(0, 60, 5)):02d}"} for n in numbers}


FLIGHTS: dict[str, dict[str, str]] = _flight_table()  # the fixed table: 60 flights
HELD_OUT_FLIGHTS: tuple[str, ...] = tuple(sorted(FLIGHTS)[::3])  # 20 flights never seen in training
TRAIN_FLIGHTS: tuple[str, ...] = tuple(f for f in sorted(FLIGHTS) if f not in HELD_OUT_FLIGHTS)


def lookup_flight(flight: str) -> str:
    row = FLIGHTS.get(str(flight).strip().upper())
    if row is None:
        return f"error: unknown flight {flight}"
    return json.dumps({"flight": str(flight).strip().upper(), **row})


TOOL_FUNCTIONS = {"calculator": calculator, "convert_units": convert_units, "lookup_flight": lookup_flight}


def call_tool(name: str, arguments: dict[str, Any] | str) -> str:
    """Run a demo tool on parsed arguments (a dict or its JSON); bad calls give an error string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: arguments are not JSON"
    fn = TOOL_FUNCTIONS.get(name)
    if fn is None:
        return f"error: no tool named {name}"
    try:
        return fn(**arguments)
    except TypeError as e:
        return f"error: {e}"


# ---- numbers: disjoint training and held-out sets --------------------------------------------------------------

def is_held_out_number(n: int) -> bool:
    """About 1 in 8 integers is reserved for held-out prompts (a fixed hash, so both sets span every range)."""
    return (abs(int(n)) * 2654435761 + 12345) % 1000003 % 8 == 0


def _number(rng: random.Random, split: Split, lo: int, hi: int) -> int:
    want = split == "held_out"
    while True:
        n = rng.randint(lo, hi)
        if is_held_out_number(n) == want:
            return n


def _operand(rng: random.Random, split: Split) -> int:
    digits = rng.choice((1, 2, 2, 3, 3, 3, 4))
    return _number(rng, split, 10 ** (digits - 1) if digits > 1 else 2, 10 ** digits - 1)


# ---- conversations ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One tool task: the user's question, the expected call, and the tool's answer."""
    kind: str
    question: str
    tool: str
    arguments: dict[str, Any]
    result: str
    plan: str  # reasoning before the call
    answer: str  # final content after the result
    wrap_up: str = "The tool returned the result."  # reasoning before the answer

    def messages(self, with_answer: bool = True) -> list[dict[str, Any]]:
        """The conversation: user, assistant call, tool result, and (with_answer) the final assistant turn."""
        msgs = [{"role": "user", "content": self.question},
                {"role": "assistant", "content": "", "reasoning_content": self.plan,
                 "tool_calls": [{"id": "call_0", "type": "function",
                                 "function": {"name": self.tool, "arguments": self.arguments}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": self.result}]
        if with_answer:
            msgs.append({"role": "assistant", "content": self.answer, "reasoning_content": self.wrap_up})
        return msgs


_OPS = {"+": ("plus", "add"), "-": ("minus", "subtract"), "*": ("times", "multiply"), "/": ("divided by", "divide")}


def calculator_case(rng: random.Random, split: Split) -> Case:
    op = rng.choice("+-*/" if rng.random() < 0.9 else "+*")
    a, b = _operand(rng, split), _operand(rng, split)
    if op == "*" and a * b > 10 ** 6:
        b = _number(rng, split, 2, 99)
    if op == "/":
        b = _number(rng, split, 2, 99)
    expr = f"{a} {op} {b}"
    word = _OPS[op][0]
    question = rng.choice([
        f"What is {a} {op} {b}?", f"What is {a} {word} {b}?", f"Compute {a} {op} {b}.", f"How much is {a} {word} {b}?",
        f"Please calculate {a} {op} {b}.", f"Can you work out {a} {word} {b}?", f"{a} {op} {b} = ?",
    ])
    result = calculator(expr)
    return Case("calculator", question, "calculator", {"expression": expr}, result,
                plan=f"The user wants to {_OPS[op][1]} two numbers. I will use the calculator.",
                answer=rng.choice([f"The answer is {result}.", f"The result is {result}."]))


def convert_case(rng: random.Random, split: Split) -> Case:
    src, dst = rng.choice(UNIT_PAIRS)
    value = _number(rng, split, 1, 999)
    s, d = UNIT_NAMES[src], UNIT_NAMES[dst]
    question = rng.choice([
        f"How many {d} is {value} {s}?", f"Convert {value} {s} to {d}.", f"What is {value} {src} in {dst}?",
        f"Please convert {value} {src} to {dst}.", f"{value} {s} in {d}?",
    ])
    result = convert_units(value, src, dst)
    return Case("convert_units", question, "convert_units", {"value": value, "from_unit": src, "to_unit": dst},
                result, plan=f"The user wants {s} in {d}. I will use convert_units.",
                answer=rng.choice([f"That is {result} {d}.", f"It is {result} {d}."]))


def flight_case(rng: random.Random, split: Split) -> Case:
    flight = rng.choice(HELD_OUT_FLIGHTS if split == "held_out" else TRAIN_FLIGHTS)
    row = FLIGHTS[flight]
    ask = rng.choice(("gate", "time", "both"))
    question = {
        "gate": rng.choice([f"Which gate does {flight} leave from?", f"What gate is flight {flight} at?"]),
        "time": rng.choice([f"When does flight {flight} depart?", f"What time does {flight} leave?"]),
        "both": rng.choice([f"Tell me about flight {flight}.", f"Where and when does {flight} depart?"]),
    }[ask]
    answer = {
        "gate": f"The flight leaves from gate {row['gate']}.",
        "time": f"The flight departs at {row['departs']}.",
        "both": f"The flight departs at {row['departs']} from gate {row['gate']}.",
    }[ask]
    return Case("lookup_flight", question, "lookup_flight", {"flight": flight}, lookup_flight(flight),
                plan="The user asks about a flight. I will call lookup_flight.", answer=answer,
                wrap_up=f"The tool returned the {'gate' if ask == 'gate' else 'time' if ask == 'time' else 'details'}.")


CASE_MAKERS = {"calculator": calculator_case, "convert_units": convert_case, "lookup_flight": flight_case}


def tool_case(rng: random.Random, split: Split, kind: str | None = None) -> Case:
    kind = kind or rng.choice(tuple(CASE_MAKERS))
    return CASE_MAKERS[kind](rng, split)


def expected_value(case: Case) -> str:
    """The text a correct final answer must contain (a flight's gate, its time, or both, as asked)."""
    if case.tool == "lookup_flight":
        row = FLIGHTS[case.arguments["flight"]]
        return row["gate"] if "leaves from gate" in case.answer else row["departs"]
    return case.result


DEMO_NAME = "flint-tiny-demo"
_SMALL_TALK = [
    (["Hi!", "Hello", "Hello!", "Hey there", "Good morning", "Hi, how are you?"],
     "The user greets me. I reply briefly.",
     ["Hello! I can do arithmetic, convert units and look up flights.", "Hi! How can I help you today?"]),
    (["Who are you?", "What is your name?", "What model are you?"],
     "The user asks who I am.",
     [f"I am {DEMO_NAME}, a tiny Flint model trained by flint-jax.",
      f"My name is {DEMO_NAME}, a small demo of the Flint architecture."]),
    (["What can you do?", "How can you help me?", "What tools do you have?"],
     "The user asks what I can do.",
     ["I can use a calculator, convert units and look up flights.",
      "I can calculate, convert between units and tell you gates and times of flights."]),
    (["Thanks!", "Thank you", "Thanks a lot", "Great, thanks."],
     "The user thanks me.",
     ["You are welcome!", "Glad to help."]),
    (["Goodbye", "Bye!", "See you later"],
     "The user says goodbye.",
     ["Goodbye!", "Bye, have a nice day!"]),
]


def small_talk(rng: random.Random) -> list[dict[str, Any]]:
    questions, plan, answers = rng.choice(_SMALL_TALK)
    return [{"role": "user", "content": rng.choice(questions)},
            {"role": "assistant", "content": rng.choice(answers), "reasoning_content": plan}]


def echo_turn(rng: random.Random, split: Split) -> list[dict[str, Any]]:
    """A tool-free turn that copies a number from the prompt (the same skill the tool calls need)."""
    n = _number(rng, split, 0, 99999)
    q = rng.choice([f"Repeat the number {n}.", f"Please say {n} back to me.", f"Echo {n}."])
    return [{"role": "user", "content": q},
            {"role": "assistant", "content": f"{n}", "reasoning_content": f"The user wants me to repeat {n}."}]


@dataclasses.dataclass
class Sample:
    """A rendered training conversation: text, and the character spans the model is trained to produce."""
    text: str
    spans: list[tuple[int, int]]  # [start, end) of each assistant output, its stop marker included


def render_sample(history: list[dict[str, Any]], turn: list[dict[str, Any]], tools) -> Sample:
    """Render history + turn (turn starts with the user message). Loss spans are the assistant outputs of `turn`:
    exactly what generation produces after the prompt `<|assistant|><think>`, up to and including the stop marker
    that ends it (`<|observation|>` after a call, `<|user|>` or `<|endoftext|>` after an answer)."""
    spans: list[tuple[int, int]] = []
    msgs = history + turn
    text = ""
    for i in range(len(history), len(msgs)):
        if msgs[i]["role"] != "assistant":
            continue
        prompt = render(msgs[:i], tools=tools, enable_thinking=True)
        full = render(msgs[:i + 1], tools=tools, enable_thinking=True, add_generation_prompt=False)
        assert full.startswith(prompt[:-len(tags.THINK_START)]), "renderer is not prefix-stable"
        nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        stop = {"tool": tags.OBSERVATION, "user": tags.USER, None: tags.ENDOFTEXT}[nxt]
        spans.append((len(prompt), len(full) + len(stop)))
        text = full + stop
    return Sample(text, spans)


def conversation(rng: random.Random, split: Split) -> Sample:
    """One random conversation. Loss covers the last user turn's assistant outputs; earlier turns are context
    (rendered as the model sees them at inference: earlier reasoning dropped)."""
    r = rng.random()
    tools = DEMO_TOOLS if r < 0.85 else None
    history: list[dict[str, Any]] = []
    if rng.random() < 0.2:  # a longer chat: the sliding layers' rings wrap, as in a real session
        history = tool_case(rng, split).messages() if tools else small_talk(rng)
    if tools is None:
        turn = small_talk(rng) if rng.random() < 0.6 else echo_turn(rng, split)
    else:
        x = rng.random()
        turn = tool_case(rng, split).messages() if x < 0.8 else (small_talk(rng) if x < 0.9 else echo_turn(rng, split))
    return render_sample(history, turn, tools)


def samples(seed: int, split: Split = "train") -> Iterator[Sample]:
    rng = random.Random(seed)
    while True:
        yield conversation(rng, split)


def held_out_cases(n: int, seed: int = 2024) -> list[Case]:
    """Held-out tool tasks, the kinds in turn: values and flights never seen in training."""
    rng = random.Random(seed)
    kinds = tuple(CASE_MAKERS)
    return [tool_case(rng, "held_out", kinds[i % len(kinds)]) for i in range(n)]


# ---- tokenizer -------------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int) -> FlintTokenizer:
    """Byte-level BPE with the `qwen2` pre-tokenizer, which splits every digit on its own (GLM-4's groups of up to
    three would make each unseen number a new token). Flint's markers are ids 0..16, registered as special."""
    return train_bpe_tokenizer(texts, vocab_size, min_frequency=2, pre="qwen2")


# ---- evaluation ------------------------------------------------------------------------------------------------

def _normalized(arguments: dict[str, Any]) -> dict[str, Any]:
    """Arguments compared modulo spacing inside an expression ("12*3" is "12 * 3")."""
    return {k: "".join(v.split()) if isinstance(v, str) else v for k, v in arguments.items()}


def evaluate_tool_use(engine, tok: FlintTokenizer, cases: list[Case], max_tokens: int = 96) -> dict[str, Any]:
    """Greedy two-turn tool use on `cases`, batched through `engine.generate` (the engine's slots run them
    concurrently; rendering and parsing are exactly what `Engine.chat` does).

    Turn 1: the user question with DEMO_TOOLS offered; correct if the reply has exactly one parsable call with the
    expected tool and arguments. Turn 2: the model's own call message (the reference one when its call was wrong)
    and the correct tool result appended; correct if the final content contains `expected_value(case)`.
    Returns the rates and per-case records."""
    from flint_jax.chat import parse_assistant
    from flint_jax.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tok.stop_token_ids)

    def run(conversations):
        prompts = [tok.encode(render(m, tools=DEMO_TOOLS, chat_template=tok.chat_template)) for m in conversations]
        outs = engine.generate(prompts, sampling)
        texts = [tok.decode(o.tokens[:-1] if o.finish_reason == "stop" else o.tokens) for o in outs]
        return texts, [parse_assistant(t, tools=DEMO_TOOLS) for t in texts]

    first_texts, first = run([c.messages()[:1] for c in cases])
    records, second_turns = [], []
    for c, text, msg in zip(cases, first_texts, first):
        calls = msg["tool_calls"]
        ok = (len(calls) == 1 and calls[0]["function"]["name"] == c.tool
              and _normalized(json.loads(calls[0]["function"]["arguments"])) == _normalized(c.arguments))
        ref = c.messages(with_answer=False)
        assistant = dict(msg, content=msg["content"] or "") if ok else ref[1]
        tool_msg = dict(ref[2], tool_call_id=calls[0]["id"]) if ok else ref[2]
        second_turns.append([ref[0], assistant, tool_msg])
        records.append({"question": c.question, "expected_call": {"name": c.tool, "arguments": c.arguments},
                        "call_ok": ok, "turn1": text})
    second_texts, second = run(second_turns)
    for c, r, text, msg in zip(cases, records, second_texts, second):
        r["answer_ok"] = expected_value(c) in (msg["content"] or "")
        r["expected_value"], r["turn2"] = expected_value(c), text
    n = max(len(cases), 1)
    return {"n": len(cases), "tool_call_accuracy": sum(r["call_ok"] for r in records) / n,
            "answer_accuracy": sum(r["answer_ok"] for r in records) / n,
            "end_to_end_accuracy": sum(r["call_ok"] and r["answer_ok"] for r in records) / n, "cases": records}


def encode_sample(tok: FlintTokenizer, sample: Sample):
    """Token ids [T] and a 0/1 mask [T] of the tokens the model is trained to produce (numpy)."""
    import numpy as np
    enc = tok.hf_tokenizer.encode(sample.text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    starts = np.asarray([a for a, _ in enc.offsets])[:, None]
    spans = np.asarray(sample.spans)
    target = np.any((spans[:, 0] <= starts) & (starts < spans[:, 1]), axis=1).astype(np.float32)
    return ids, target


def assistant_perplexity(params, cfg, tok: FlintTokenizer, held_out: list[Sample], batch: int = 8) -> float:
    """exp(mean NLL) of the assistant tokens of `held_out` conversations under `model.forward`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flint_jax import model as M

    encoded = [encode_sample(tok, s) for s in held_out]
    T = max(len(ids) for ids, _ in encoded)
    total, count = 0.0, 0.0
    for i in range(0, len(encoded), batch):
        part = encoded[i:i + batch]
        toks = np.zeros((len(part), T), np.int32)
        mask = np.zeros((len(part), T - 1), np.float32)
        for r, (ids, target) in enumerate(part):
            toks[r, :len(ids)] = ids
            mask[r, :len(ids) - 1] = target[1:]
        logp = jax.nn.log_softmax(M.forward(params, jnp.asarray(toks[:, :-1]), cfg), axis=-1)
        nll = -np.asarray(jnp.take_along_axis(logp, jnp.asarray(toks[:, 1:, None]), axis=-1)[..., 0])
        total += float((nll * mask).sum())
        count += float(mask.sum())
    return float(np.exp(total / count))
