"""Acceptance of the embedded demo model (issue 9), on the CPU: the shipped GGUF NVFP4 file, loaded the way
`flint generate` / `flint chat` load it, calls the right tool with the right arguments on held-out prompts, answers
from the tool's result, and stays within 5% of the BF16 file's held-out perplexity."""

import importlib.util
import itertools
import json
import os

import jax
import numpy as np
import pytest

from flint_jax import corpus as C
from flint_jax import default_model
from flint_jax.config import FULL, SLIDING
from flint_jax.engine import Engine
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.sampling import SamplingParams

N_CASES = 24  # 8 per tool, three engine batches of 8 per turn


@pytest.fixture(scope="module")
def rt():
    return default_model.runtime()


@pytest.fixture(scope="module")
def engine(rt):
    return Engine(rt.cfg, rt.params, max_batch=8, max_len=768, chunk_size=128, tokenizer=rt.tokenizer,
                  chat_template=rt.chat_template)


def test_default_runtime_is_the_embedded_nvfp4_model(rt):
    assert rt.description.startswith("flint-tiny-demo NVFP4 (embedded, trained by scripts/train_tiny.py")
    assert rt.stop_token_ids == rt.tokenizer.stop_token_ids
    cfg = rt.cfg
    # Every architectural feature: both layer types, dense and MoE layers, sigmoid top-k, a shared expert.
    assert {SLIDING, FULL} <= set(cfg.layer_types)
    assert 0 < cfg.first_k_dense_replace < cfg.num_hidden_layers
    assert cfg.scoring_func == "sigmoid" and 1 < cfg.num_experts_per_tok < cfg.n_routed_experts
    assert cfg.n_shared_experts == 1
    linears = [rt.params.lm_head] + [x for layer in rt.params.layers for x in (layer.attn.q, layer.mlp.down)]
    assert all(isinstance(w, NVFP4Weight) for w in linears)
    for path in default_model.GGUF_FILES.values():
        assert os.path.getsize(path) < 8e6
    assert default_model.demo_tools() == C.DEMO_TOOLS


def test_held_out_tool_calls_and_answers(rt, engine):
    """Greedy decoding on held-out values: >= 90% right calls, >= 90% answers with the right value."""
    cases = C.held_out_cases(N_CASES)
    prompt = rt.tokenizer.encode(C.render(cases[0].messages()[:1], tools=C.DEMO_TOOLS))
    assert len(prompt) > 2 * rt.cfg.sliding_window  # the sliding layers' rings wrap during every test
    res = C.evaluate_tool_use(engine, rt.tokenizer, cases)
    misses = [r for r in res["cases"] if not (r["call_ok"] and r["answer_ok"])]
    print(f"\ntool call {res['tool_call_accuracy']:.1%}, answer {res['answer_accuracy']:.1%}, both "
          f"{res['end_to_end_accuracy']:.1%} on {res['n']} held-out cases; misses: {json.dumps(misses, indent=1)}")
    assert res["tool_call_accuracy"] >= 0.9
    assert res["answer_accuracy"] >= 0.9


def test_engine_chat_round_trip(rt, engine):
    """The public API: Engine.chat with tools, the tool's result appended, then the final answer."""
    greedy = SamplingParams(temperature=0.0, max_tokens=96)
    case = C.held_out_cases(3, seed=7)[0]
    messages = [{"role": "user", "content": case.question}]
    first = engine.chat(messages, tools=C.DEMO_TOOLS, sampling=greedy)
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["reasoning_content"]
    call = first["message"]["tool_calls"][0]
    assert call["function"]["name"] == case.tool
    messages += [first["message"], {"role": "tool", "tool_call_id": call["id"],
                                    "content": C.call_tool(call["function"]["name"], call["function"]["arguments"])}]
    second = engine.chat(messages, tools=C.DEMO_TOOLS, sampling=greedy)
    assert second["finish_reason"] == "stop"
    assert C.expected_value(case) in second["message"]["content"]
    hello = engine.chat([{"role": "user", "content": "Who are you?"}], sampling=greedy)
    assert "flint-tiny-demo" in hello["message"]["content"]


def test_nvfp4_perplexity_within_5_percent_of_bf16(rt):
    bf16 = default_model.runtime("bf16")
    held = list(itertools.islice(C.samples(1, "held_out"), 16))
    ppl_nvfp4 = C.assistant_perplexity(rt.params, rt.cfg, rt.tokenizer, held)
    ppl_bf16 = C.assistant_perplexity(bf16.params, bf16.cfg, bf16.tokenizer, held)
    print(f"\nheld-out assistant perplexity: NVFP4 {ppl_nvfp4:.4f}, BF16 {ppl_bf16:.4f}")
    assert ppl_bf16 < 1.5  # the model has learned the held-out conversations, not just their format
    assert abs(ppl_nvfp4 / ppl_bf16 - 1) <= 0.05


def _train_script():
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "train_tiny.py")
    spec = importlib.util.spec_from_file_location("train_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_forward_is_model_forward():
    """The training script's shared-prefix forward (dense-expert MoE) computes `model.forward`'s logits."""
    tt = _train_script()
    cfg = tt.demo_config(256, (0,), 0, layers=2, hidden=64)
    params = tt.model_params(tt.init_master(cfg, jax.random.key(1)), cfg)
    rng = np.random.default_rng(0)
    tt.check_train_forward(cfg, params, rng.integers(0, 256, 40).astype(np.int32),
                           rng.integers(0, 256, (2, 30)).astype(np.int32))
