"""`flint chat`: interactive or one-shot chat that shows reasoning and tool calls as they stream."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    from flint_jax.cli import add_model_args, add_sampling_args
    p = sub.add_parser("chat", help="chat with the model (reasoning and tool calls)",
                       description="Chat with Flint: interactive, or one-shot with --message. Tool calls are shown; "
                                   "in interactive mode you type each tool's result.")
    add_model_args(p)
    p.add_argument("--message", help="send one user message, print the reply and exit")
    p.add_argument("--system", help="a system message")
    p.add_argument("--tools", help="a JSON file holding a list of OpenAI-style tool definitions (default: the "
                                   "model's own tools, if it ships any, as the embedded demo model does)")
    p.add_argument("--no-thinking", action="store_true", help="turn reasoning off")
    p.add_argument("--json", action="store_true", help="print the final OpenAI-shaped choice as JSON")
    add_sampling_args(p)
    p.set_defaults(max_tokens=256)
    return p


def _load_tools(path: str | None):
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(tools, list):
        raise ValueError(f"{path}: expected a JSON list of tool definitions")
    return tools


def _turn(engine, messages, tools, args, out) -> dict:
    """Stream one assistant turn to `out`; return its final choice."""
    from flint_jax.sampling import SamplingParams
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens, seed=args.seed)
    section = None
    for item in engine.chat(messages, tools=tools, enable_thinking=not args.no_thinking, sampling=sampling,
                            stream=True):
        if "choice" in item:
            choice = item["choice"]
            break
        delta = item["delta"]
        for key, label in (("reasoning_content", "[thinking] "), ("content", "")):
            if delta.get(key):
                if section != key:
                    out.write(("\n" if section else "") + label)
                    section = key
                out.write(delta[key])
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            out.write(f"\n[tool call] {fn['name']}({fn['arguments']})")
            section = "tool"
        out.flush()
    out.write(f"\n[{choice['finish_reason']}; {choice['usage']['completion_tokens']} tokens, "
              f"{choice['timings']['decode_ms_per_token']:.1f} ms/token]\n")
    return choice


def run(args) -> int:
    from flint_jax.cli import resolve_impl, resolve_max_len
    from flint_jax.engine import Engine
    from flint_jax.runtime import engine_params, load_runtime

    tools = _load_tools(args.tools)
    rt = load_runtime(args.model, announce=lambda m: print(m, file=sys.stderr))
    if tools is None:
        tools = rt.default_tools
    impl = resolve_impl(args)
    engine = Engine(rt.cfg, engine_params(rt, impl), max_batch=1, max_len=resolve_max_len(args, rt),
                    impl=impl, steps_per_dispatch=args.steps_per_dispatch,
                    chunk_size=args.prefill_chunk, kv_dtype=args.kv_dtype,
                    tokenizer=rt.tokenizer, chat_template=rt.chat_template)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        messages.append({"role": "user", "content": args.message})
        choice = _turn(engine, messages, tools, args, sys.stdout)
        if args.json:
            print(json.dumps(choice, ensure_ascii=False, indent=2))
        return 0
    print("Type a message (empty line or Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            text = input("you> ")
        except EOFError:
            return 0
        if not text.strip():
            return 0
        messages.append({"role": "user", "content": text})
        while True:
            choice = _turn(engine, messages, tools, args, sys.stdout)
            messages.append(choice["message"])
            if choice["finish_reason"] != "tool_calls":
                break
            for call in choice["message"]["tool_calls"]:
                result = input(f"result of {call['function']['name']}> ")
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
