"""Tool calls parsed out of the visible output as it streams, one parser per model family.

Every parser announces a call with its name first, then streams its arguments as JSON text
fragments that join to the call's arguments object. A call that turns out malformed (invalid
JSON when it closes, unclosed at the end) comes back as content, never as an exception. A call
the output's token budget cut is no markup to show: announced, it is a call whose arguments are
the text so far (``ToolCall.is_cut``), as OpenAI reports one; cut before its name, it is dropped.
"""

from __future__ import annotations

from atom_anyio.parse.call_body import JsonCall, ToolCall, ToolCallDelta, XmlCall
from atom_anyio.parse.reasoning import partial_tag_len

__all__ = ["ToolCall", "ToolCallDelta", "ToolParser", "detect_tool_format", "TOOL_CALL_PARSERS"]

# The tool-call format the prompt layer teaches a template that reads no tools (``prompt.render.default_tools``)
DEFAULT_TOOL_FORMAT = "hermes"


def detect_tool_format(template: str) -> str | None:
    """The tool-call format a chat template's prompt teaches, or None."""
    if "<function=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


# call bodies


class ToolParser:
    """Content outside calls passes through; a subclass per format recognises the calls.

    ``_step`` consumes what it can decide from ``_buf`` and returns (content, deltas), or None
    when it must wait for more text. A feed stops once a call has ended, so that content after
    it waits for the next feed and the text order (content, then calls) holds within one result,
    but for a call that proves malformed: its text comes back as content after the deltas that
    announced it, and ``finish`` runs to the end. ``feed_pieces`` / ``finish_pieces`` keep that
    order: (content, deltas) pieces, each piece's content before its deltas.
    """

    start_marks_a_call = True  # a start tag makes text a call; a cut one is markup, not content

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []  # well-formed calls, and the call a cut output ended in
        self._buf = ""
        self._call: JsonCall | XmlCall | None = None
        self._raw = ""  # the text of the call being parsed: content again if it is malformed
        self._num_announced = 0
        self._after_call = False  # whitespace right after a call is dropped unless text follows
        self._is_final = False
        self._is_cut = False  # the output ended at its token budget
        self._content_after = ""  # a malformed call's text: content after the step's deltas

    @classmethod
    def for_format(cls, name: str) -> ToolParser:
        return TOOL_CALL_PARSERS[name]()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return joined(self.feed_pieces(text))

    def finish(self, *, is_cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output; ``is_cut``: it ran out of tokens (finish reason ``length``)."""
        return joined(self.finish_pieces(is_cut=is_cut))

    def feed_pieces(self, text: str) -> list[tuple[str, list[ToolCallDelta]]]:
        self._buf += text
        return self._run()

    def finish_pieces(self, *, is_cut: bool = False) -> list[tuple[str, list[ToolCallDelta]]]:
        self._is_final, self._is_cut = True, is_cut
        return self._run()

    def _run(self) -> list[tuple[str, list[ToolCallDelta]]]:
        pieces: list[tuple[str, list[ToolCallDelta]]] = []
        has_deltas = False
        while not (has_deltas and self._call is None and not self._is_final):
            step = self._step()
            if step is None:
                break
            add_piece(pieces, *step)
            if self._content_after:
                add_piece(pieces, self._content_after, [])
                self._content_after = ""
            has_deltas = has_deltas or bool(step[1])
        return pieces

    def _step(self) -> tuple[str, list[ToolCallDelta]] | None:
        raise NotImplementedError

    def _end_call(self, deltas: list[ToolCallDelta], *, is_closed: bool = True) -> tuple[str, list[ToolCallDelta]]:
        """The current call is over: keep it, or hand its text back as content if it is malformed."""
        assert self._call is not None
        if self._is_cut and not is_closed and (self._call.is_announced or self.start_marks_a_call):
            return self._cut_call(deltas)
        more, call = self._call.close() if is_closed else ([], None)
        if call is not None or self._call.is_announced:
            self._num_announced += 1
        self._call = None
        raw, self._raw = self._raw, ""
        if call is None:  # its text is content again, after the deltas that announced it
            self._content_after = raw
            return "", deltas
        self.calls.append(call)
        self._after_call = True
        return "", deltas + more

    def _cut_call(self, deltas: list[ToolCallDelta]) -> tuple[str, list[ToolCallDelta]]:
        call, self._call, self._raw = self._call, None, ""
        if call.is_announced:
            self._num_announced += 1
            self.calls.append(ToolCall(call.id, call.name, call.arguments_so_far, is_cut=True))
        return "", deltas

    def _json_call_step(self) -> tuple[str, list[ToolCallDelta]] | None:
        """A JSON call that ends where its object closes (no close tag)."""
        assert isinstance(self._call, JsonCall)
        buf, self._buf = self._buf, ""
        deltas = self._call.push(buf)
        self._raw += buf[: len(buf) - len(self._call.rest)]
        self._buf, self._call.rest = self._call.rest, ""
        if self._call.is_complete or self._is_final:
            return self._end_call(deltas, is_closed=self._call.is_complete)
        return ("", deltas) if buf else None


def add_piece(pieces: list[tuple[str, list[ToolCallDelta]]], content: str, deltas: list[ToolCallDelta]) -> None:
    """Append a step's (content, deltas), content first, to ordered pieces: content continues the last
    piece while it has no deltas; deltas alone follow the last piece's."""
    if content and pieces and not pieces[-1][1]:
        pieces[-1] = (pieces[-1][0] + content, list(deltas))
    elif content or not pieces:
        pieces.append((content, list(deltas)))
    else:
        pieces[-1][1].extend(deltas)


def joined(pieces: list[tuple[str, list[ToolCallDelta]]]) -> tuple[str, list[ToolCallDelta]]:
    """The pieces' content and deltas, each joined in order."""
    return "".join(c for c, _ in pieces), [d for _, deltas in pieces for d in deltas]


class _TaggedParser(ToolParser):
    """Calls open with ``start_tag``; text outside them is content."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def _step(self) -> tuple[str, list[ToolCallDelta]] | None:
        return self._text_step() if self._call is None else self._call_step()

    def _open(self) -> None:
        raise NotImplementedError

    def _text_step(self) -> tuple[str, list[ToolCallDelta]] | None:
        tag = self.start_tag
        if self._after_call:
            rest = self._buf.lstrip()
            if not self._is_final and tag.startswith(rest):
                return None  # whitespace or part of a tag: wait to see what follows
            if rest.startswith(tag) or not rest or (self._is_cut and tag.startswith(rest)):
                self._buf = rest  # another call or the end follows: the whitespace goes
            self._after_call = False
        buf = self._buf
        at = buf.find(tag)
        if at == 0:
            self._buf, self._raw = buf[len(tag) :], tag
            self._open()
            return "", []
        if at < 0:
            if self._is_cut:  # the budget ended inside a start tag: markup, not content
                buf = self._buf = buf[: len(buf) - partial_tag_len(buf, tag)]
            at = len(buf) - (0 if self._is_final else partial_tag_len(buf, tag))
            if at == 0:
                return None
        self._buf = buf[at:]
        return buf[:at], []

    def _call_step(self) -> tuple[str, list[ToolCallDelta]] | None:
        """A call body that ends at ``end_tag`` (one inside a JSON string is the string's text);
        unclosed at the end, it is malformed."""
        assert self._call is not None
        buf = self._buf
        end = buf.find(self.end_tag)
        if end >= 0:
            body, self._buf = buf[:end], buf[end + len(self.end_tag) :]
            self._raw += body + self.end_tag
            deltas = self._call.push(body)
            if self._call.is_in_string:
                return "", deltas + self._call.push(self.end_tag)
            return self._end_call(deltas)
        if self._is_final:
            self._raw, self._buf = self._raw + buf, ""
            return self._end_call(self._call.push(buf), is_closed=False)
        body = buf[: len(buf) - partial_tag_len(buf, self.end_tag)]
        if not body:
            return None
        self._raw, self._buf = self._raw + body, buf[len(body) :]
        return "", self._call.push(body)


class HermesParser(_TaggedParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    def _open(self) -> None:
        self._call = JsonCall(self._num_announced)


class Qwen3CoderParser(_TaggedParser):
    """Qwen3-Coder: ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``."""

    def _open(self) -> None:
        self._call = XmlCall(self._num_announced)


class MistralParser(_TaggedParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    start_tag = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__()
        self._expect: str | None = None  # inside the list: the punctuation allowed next

    def _open(self) -> None:
        self._expect = "["

    def _step(self) -> tuple[str, list[ToolCallDelta]] | None:
        if self._call is not None:
            return self._json_call_step()
        return self._list_step() if self._expect is not None else self._text_step()

    def _list_step(self) -> tuple[str, list[ToolCallDelta]] | None:
        rest = self._buf.lstrip()
        if not rest and not self._is_final:
            return None
        if not rest or rest[0] not in self._expect:
            self._expect = None  # not a call list after all: its text so far is content
            raw, self._raw = self._raw, ""
            return ("" if self._is_cut and not rest else raw), []  # unless the budget cut the list
        self._raw += self._buf[: len(self._buf) - len(rest)]
        if rest[0] == "{":
            self._buf, self._call, self._expect = rest, JsonCall(self._num_announced), ",]"
            return "", []
        self._raw, self._buf = self._raw + rest[0], rest[1:]
        self._expect = "{" if rest[0] in "[," else None
        if self._expect is None:
            self._raw, self._after_call = "", True
        return "", []

    def _end_call(self, deltas: list[ToolCallDelta], *, is_closed: bool = True) -> tuple[str, list[ToolCallDelta]]:
        num_calls = len(self.calls)
        out = super()._end_call(deltas, is_closed=is_closed)
        if len(self.calls) == num_calls:
            self._expect = None  # a malformed call ends the list: what follows is text
        return out


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: the whole output is ``{"name": ..., "parameters": {...}}``
    (``;``-separated for several), possibly after ``<|python_tag|>``; any other output is content."""

    python_tag = "<|python_tag|>"
    start_marks_a_call = False  # any output may open with "{": cut before its name, it is content

    def __init__(self) -> None:
        super().__init__()
        self._state = "expect"  # expect (a call may start) -> after (a call ended) -> ...; or plain

    def _step(self) -> tuple[str, list[ToolCallDelta]] | None:
        if self._call is not None:
            return self._json_call_step()
        if self._state == "plain":
            piece, self._buf = self._buf, ""
            return (piece, []) if piece else None
        rest = self._buf.lstrip()
        skipped = self._buf[: len(self._buf) - len(rest)]
        return self._expect_step(rest, skipped) if self._state == "expect" else self._after_step(rest, skipped)

    def _expect_step(self, rest: str, skipped: str) -> tuple[str, list[ToolCallDelta]] | None:
        if rest.startswith(self.python_tag):
            self._raw, self._buf = self._raw + skipped + self.python_tag, rest[len(self.python_tag) :]
            return "", []
        if rest.startswith("{"):
            self._raw, self._buf, self._call = self._raw + skipped, rest, JsonCall(self._num_announced)
            return "", []
        if not self._is_final and self.python_tag.startswith(rest):
            return None
        self._state = "plain"  # not a call: the rest of the output is content
        raw, self._raw = self._raw, ""
        if self._is_cut and self.python_tag.startswith(rest):  # the budget cut the calls' markup
            self._buf = ""
            return "", []
        return raw, []

    def _after_step(self, rest: str, skipped: str) -> tuple[str, list[ToolCallDelta]] | None:
        if rest.startswith(";"):
            self._raw, self._buf, self._state = skipped + ";", rest[1:], "expect"
            return "", []
        if not rest:
            if self._is_final:
                self._buf = ""  # trailing whitespace after the calls goes
            return None
        self._state = "plain"
        return "", []

    def _end_call(self, deltas: list[ToolCallDelta], *, is_closed: bool = True) -> tuple[str, list[ToolCallDelta]]:
        num_calls = len(self.calls)
        out = super()._end_call(deltas, is_closed=is_closed)
        self._state = "after" if len(self.calls) > num_calls else "plain"
        return out


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
