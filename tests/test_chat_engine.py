"""engine.chat on a random tiny model with a trained chat tokenizer: plumbing, streaming and limits."""
import jax
import pytest

from flint_jax.chat import train_bpe_tokenizer
from flint_jax.config import FlintConfig
from flint_jax.engine import Engine
from flint_jax.params import init_params
from flint_jax.sampling import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def chat_engine():
    tok = train_bpe_tokenizer(["hello world, what is 2 + 3? the answer is 5."] * 20, vocab_size=300)
    cfg = FlintConfig.tiny(vocab_size=320, max_position_embeddings=1024)
    params = init_params(cfg, jax.random.key(0))
    return Engine(cfg, params, max_batch=1, max_len=1024, chunk_size=256, tokenizer=tok), tok


def test_chat_returns_an_openai_choice_and_reasoning_counts_toward_max_tokens(chat_engine):
    engine, tok = chat_engine
    messages = [{"role": "user", "content": "what is 2 + 3?"}]
    choice = engine.chat(messages, tools=TOOLS, sampling=SamplingParams(temperature=0.0, max_tokens=12))
    msg = choice["message"]
    assert msg["role"] == "assistant" and set(msg) >= {"content", "reasoning_content", "tool_calls"}
    assert choice["usage"]["completion_tokens"] <= 12
    if choice["finish_reason"] == "length":
        assert choice["usage"]["completion_tokens"] == 12


def test_streamed_deltas_add_up_to_the_one_shot_message(chat_engine):
    engine, tok = chat_engine
    messages = [{"role": "user", "content": "hello"}]
    s = SamplingParams(temperature=0.8, max_tokens=20, seed=3)
    one_shot = engine.chat(messages, sampling=s)
    items = list(engine.chat(messages, sampling=s, stream=True))
    assert "choice" in items[-1]
    streamed = items[-1]["choice"]
    assert streamed["message"] == one_shot["message"]
    reasoning = "".join(i["delta"].get("reasoning_content", "") for i in items[:-1])
    content = "".join(i["delta"].get("content", "") for i in items[:-1])
    assert (reasoning.strip() or None) == one_shot["message"]["reasoning_content"]
    assert (content.strip() or None) == one_shot["message"]["content"]


def test_chat_needs_a_chat_tokenizer(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="chat tokenizer"):
        Engine(tiny_cfg, tiny_params, max_len=64).chat([{"role": "user", "content": "hi"}])
