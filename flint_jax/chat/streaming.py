"""Incremental version of `parse_assistant`: feed text deltas, get reasoning / content / tool-call deltas.

Any chunking of the same text yields the same final message as `parse_assistant`, and the deltas add up to it:
text that may be the start of a tag is held back, and a tool call is emitted whole once its `</tool_call>`
arrives, because until then it may still turn out to be content (unterminated or malformed) or be dropped.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from flint_jax.chat import tags
from flint_jax.chat.parser import Message, find_first, make_message, make_tool_call, scan_call
from flint_jax.chat.tools import string_params, validate_tools

Delta = dict[str, Any]

_REASONING_ENDS = (tags.THINK_END, *tags.STOP_TOKENS)
_CONTENT_ENDS = (tags.TOOL_CALL_START, *tags.STOP_TOKENS)


class _Stripped:
    """Accumulates a text field whose final value is stripped: leading space is dropped, trailing space is held
    until more text follows it."""

    def __init__(self) -> None:
        self.text = ""
        self._pending = ""

    def push(self, piece: str) -> str:
        if not self.text:
            piece = piece.lstrip()
        body = self._pending + piece
        emit = body.rstrip()
        self._pending = body[len(emit):]
        self.text += emit
        return emit


class StreamingParser:
    """`feed(delta)` -> deltas; `flush()` -> the deltas held back at the end; `finish()` -> the final message.

    Deltas are `{"reasoning_content": str}`, `{"content": str}` or
    `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments"}}]}`.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool = True) -> None:
        self._kinds = string_params(validate_tools(tools))
        self._thinking = enable_thinking
        self._text = ""
        self._pos = 0  # everything before this is decided
        self._phase = "start"  # start -> reasoning -> content <-> call, any -> done
        self._reasoning = _Stripped()
        self._content = _Stripped()
        self._calls: list[dict[str, Any]] = []
        self._closed = False

    def feed(self, delta: str) -> list[Delta]:
        if self._closed:
            raise RuntimeError("StreamingParser.feed after flush/finish")
        self._text += delta or ""
        return self._advance(final=False)

    def flush(self) -> list[Delta]:
        """End of generation: decide everything still held back."""
        if self._closed:
            return []
        out = self._advance(final=True)
        self._closed = True
        return out

    def finish(self) -> Message:
        """The final message (flushing first if needed); equal to `parse_assistant` on all text fed."""
        self.flush()
        return make_message(self._content.text, self._reasoning.text, list(self._calls))

    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._step(final, out):
            pass
        return out

    def _step(self, final: bool, out: list[Delta]) -> bool:
        """Make one decision; False when nothing more can be decided yet."""
        text, pos = self._text, self._pos
        if self._phase == "start":
            rest = text[pos:].lstrip()
            if not final and (not rest or (len(rest) < len(tags.THINK_START) and tags.THINK_START.startswith(rest))):
                return False  # might still become a leading <think>
            if rest.startswith(tags.THINK_START):
                self._pos = len(text) - len(rest) + len(tags.THINK_START)
                self._phase = "reasoning"
            else:
                self._phase = "reasoning" if self._thinking else "content"
            return True
        if self._phase in ("reasoning", "content"):
            reasoning = self._phase == "reasoning"
            ends = _REASONING_ENDS if reasoning else _CONTENT_ENDS
            k, tag = find_first(text, pos, ends)
            if k < 0:
                k = len(text) if final else len(text) - _partial_tag_len(text, pos, ends)
            self._emit_text(reasoning, text[pos:k], out)
            self._pos = k
            if not tag:
                return False
            self._pos = k + len(tag)
            if tag in tags.STOP_TOKENS:
                self._phase = "done"
            elif tag == tags.THINK_END:
                self._phase = "content"
            else:
                self._phase, self._pos = "call", k  # the call is scanned from its opening tag
            return True
        if self._phase == "call":
            stop = find_first(text, pos, tags.STOP_TOKENS)[0]
            view = text if stop < 0 else text[:stop]  # the one-shot parser never sees past a stop marker
            scan = scan_call(view, pos)
            if scan.status == "incomplete":
                if stop < 0 and not final:
                    return False
                self._emit_text(False, view[pos:], out)  # unterminated: it was content after all
                self._pos, self._phase = len(view), "done"
                return True
            if scan.status == "malformed":
                self._emit_text(False, view[pos:scan.end], out)
            elif scan.name in self._kinds:
                call = make_tool_call(view, pos, scan, self._kinds[scan.name])
                self._calls.append(call)
                out.append({"tool_calls": [{"index": len(self._calls) - 1, **call}]})
            self._pos, self._phase = scan.end, "content"
            return True
        return False  # done: text after a stop marker is ignored

    def _emit_text(self, reasoning: bool, piece: str, out: list[Delta]) -> None:
        emitted = (self._reasoning if reasoning else self._content).push(piece)
        if not emitted:
            return
        key = "reasoning_content" if reasoning else "content"
        if out and key in out[-1]:
            out[-1][key] += emitted  # one delta per run of the same field keeps streams compact
        else:
            out.append({key: emitted})


def _partial_tag_len(text: str, pos: int, tag_set: Sequence[str]) -> int:
    """Length of the longest tail of text[pos:] that is a proper prefix of some tag (held back for now)."""
    longest = max(len(t) for t in tag_set) - 1
    for n in range(min(longest, len(text) - pos), 0, -1):
        tail = text[len(text) - n:]
        if any(t.startswith(tail) for t in tag_set):
            return n
    return 0
