"""GPT-OSS's harmony output, parsed as it streams: reasoning, content and tool calls in one pass.

The output is a run of messages, each a header and a body (OpenAI's harmony format)::

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

(the first ``<|start|>assistant`` is the prompt's). ``analysis`` is reasoning, ``final`` and
``commentary`` without a recipient (a preamble) are content, a message ``to=functions.NAME`` is
a call of NAME whose body is its JSON arguments; a message to any other recipient (the built-in
``browser`` and ``python`` tools, which this server does not run) is reasoning. The recipient
may come before or after the channel. ``<|return|>`` and ``<|call|>`` are end-of-output tokens
the engine keeps out of the text, so the output's end also ends the open message.
"""

from __future__ import annotations

import json
import re

from atom_anyio.parse.call_body import ToolCall, ToolCallDelta, new_call_id
from atom_anyio.parse.reasoning import partial_tag_len

MESSAGE = "<|message|>"
START = "<|start|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
END_TAGS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
MAX_HEADER_CHARS = 256  # a longer run without <|message|> is not a header: the output is plain text
_HEADER_STARTS = (CHANNEL, " to=", "to=", "assistant")  # what a header begins with, after any <|start|>
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")

Parsed = tuple[str, str, list[ToolCallDelta]]  # (reasoning, content, call deltas)


class HarmonyParser:
    """One choice's harmony output; ``parse_tools`` False reads a function call's body as content.

    Text that might still be a tag is held back, so tags reach no channel even split across
    deltas. Output that is not harmony (a line or ``MAX_HEADER_CHARS`` before any
    ``<|message|>``) is content as it is.
    """

    def __init__(self, *, parse_tools: bool):
        self.calls: list[ToolCall] = []  # complete, well-formed calls
        self._parse_tools = parse_tools
        self._buf = ""
        self._state = "header"  # header -> body -> header ...; or plain (not harmony)
        self._kind = ""  # the open message's channel here: reasoning, content or call
        self._is_first_piece = False  # nothing of the open message sent yet
        self._has_text = {"reasoning": False, "content": False}
        self._call: ToolCall | None = None  # the open call, its arguments text so far
        self._call_index = -1
        self._num_announced = 0
        self._has_ended_call = False
        self._is_final = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._run()

    def finish(self) -> Parsed:
        self._is_final = True
        return self._run()

    def _run(self) -> Parsed:
        """Steps until one must wait for more text, or a call has ended (what follows it waits,
        so that within one result the text order holds: reasoning, content, then the calls)."""
        reasoning, content, deltas = [], [], []
        while (step := self._step()) is not None:
            reasoning.append(step[0])
            content.append(step[1])
            deltas += step[2]
            if self._has_ended_call and not self._is_final:
                break
        self._has_ended_call = False
        return "".join(reasoning), "".join(content), deltas

    def _step(self) -> Parsed | None:
        if self._state == "plain":
            piece, self._buf = self._buf, ""
            return ("", piece, []) if piece else None
        return self._header_step() if self._state == "header" else self._body_step()

    def _header_step(self) -> Parsed | None:
        at = self._buf.find(MESSAGE)
        if at < 0:
            if not _may_be_header(self._buf):
                self._state = "plain"
                return "", "", []
            if self._is_final:
                self._buf = ""  # a header cut off by the end of the output: no message to show
            return None
        header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE) :]
        return self._open(header)

    def _open(self, header: str) -> Parsed:
        """A message begins: its channel and recipient decide where its body goes."""
        recipient = m.group(1) if (m := _RECIPIENT.search(header)) else None
        channel = m.group(1) if (m := _CHANNEL_NAME.search(header)) else "final"
        self._state, self._is_first_piece = "body", True
        if recipient is not None and recipient.startswith(FUNCTIONS) and self._parse_tools:
            name = recipient.removeprefix(FUNCTIONS)
            self._kind, self._call, self._call_index = "call", ToolCall(new_call_id(), name, ""), self._num_announced
            self._num_announced += 1
            return "", "", [ToolCallDelta(self._call_index, id=self._call.id, name=name)]
        is_reasoning = channel == "analysis" or (recipient is not None and not recipient.startswith(FUNCTIONS))
        self._kind = "reasoning" if is_reasoning else "content"
        return "", "", []

    def _body_step(self) -> Parsed | None:
        buf = self._buf
        ends = [(at, tag) for tag in END_TAGS if (at := buf.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self._buf = buf[at + len(tag) :]
            return self._add(self._emit(buf[:at]), self._close())
        if self._is_final:
            self._buf = ""
            return self._add(self._emit(buf), self._close())
        held = max(partial_tag_len(buf, tag) for tag in END_TAGS)
        piece, self._buf = buf[: len(buf) - held], buf[len(buf) - held :]
        return self._emit(piece) if piece else None

    def _emit(self, piece: str) -> Parsed:
        if not piece:
            return "", "", []
        if self._kind == "call":
            self._call.arguments += piece
            return "", "", [ToolCallDelta(self._call_index, arguments=piece)]
        if self._is_first_piece and self._has_text[self._kind]:
            piece = "\n" + piece  # a new message in a channel that already has text
        self._is_first_piece, self._has_text[self._kind] = False, True
        return (piece, "", []) if self._kind == "reasoning" else ("", piece, [])

    def _close(self) -> Parsed:
        """The open message ends; a call whose body is not a JSON object comes back as content."""
        self._state = "header"
        if self._kind != "call":
            return "", "", []
        call, self._call, self._has_ended_call = self._call, None, True
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return "", call.arguments, []
        self.calls.append(call)
        return "", "", []

    @staticmethod
    def _add(a: Parsed, b: Parsed) -> Parsed:
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _may_be_header(text: str) -> bool:
    """Whether ``text`` (no ``<|message|>`` yet) can still be, or become, a message header."""
    if len(text) > MAX_HEADER_CHARS or "\n" in text:
        return False
    if START.startswith(text):
        return True
    text = text.removeprefix(START)
    return any(text.startswith(start) or start.startswith(text) for start in _HEADER_STARTS)
