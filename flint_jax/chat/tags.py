"""Flint's chat markers (FLINT_SPEC section 5): the one place their spellings live."""

GMASK = "[gMASK]"
SOP = "<sop>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
OBSERVATION = "<|observation|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
ENDOFTEXT = "<|endoftext|>"

# Every marker the tokenizer must keep as a single id.
FLINT_SPECIAL_TOKENS: tuple[str, ...] = (
    GMASK, SOP, SYSTEM, USER, ASSISTANT, OBSERVATION,
    THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END,
    ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END,
    TOOL_RESPONSE_START, TOOL_RESPONSE_END, ENDOFTEXT,
)

# Generation ends at any of these: end of text, the user's turn, or a tool result the caller must supply.
STOP_TOKENS: tuple[str, ...] = (ENDOFTEXT, USER, OBSERVATION)
