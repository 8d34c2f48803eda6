"""Flint chat: tokenizer, GLM-4.7-style prompt rendering, and parsing of reasoning and tool calls.

See docs/CHAT.md for the format and the parsing rules.
"""

from flint_jax.chat.parser import finish_reason, parse_assistant
from flint_jax.chat.streaming import StreamingParser
from flint_jax.chat.tags import FLINT_SPECIAL_TOKENS, STOP_TOKENS
from flint_jax.chat.template import FLINT_CHAT_TEMPLATE, ChatTemplateError, render
from flint_jax.chat.tokenizer import FlintTokenizer, IncrementalDecoder, train_bpe_tokenizer

__all__ = [
    "FLINT_CHAT_TEMPLATE",
    "FLINT_SPECIAL_TOKENS",
    "STOP_TOKENS",
    "ChatTemplateError",
    "FlintTokenizer",
    "IncrementalDecoder",
    "StreamingParser",
    "finish_reason",
    "parse_assistant",
    "render",
    "train_bpe_tokenizer",
]
