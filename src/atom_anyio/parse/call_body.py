"""One tool call's body as it streams: the JSON object formats (Hermes, Mistral, Llama 3) and
Qwen3-Coder's XML. Each announces the call's name first, then streams argument fragments."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCallDelta:
    index: int  # 0-based index of the call within this choice
    id: str | None = None  # "call_<24 hex>", set on the first delta of a call
    name: str | None = None  # set on the first delta of a call (before any arguments)
    arguments: str = ""  # a JSON text fragment; a call's fragments join to its arguments object


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the complete JSON object text; the text so far when cut
    is_cut: bool = False  # the output ran out of tokens inside the call (finish reason "length")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class JsonExtent:
    """Where a JSON object or array ends, found incrementally (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.max_depth = 0
        self.is_in_string = False
        self._escape = False

    def feed(self, text: str) -> int | None:
        """The offset in ``text`` just past the value's end, or None if it has not ended."""
        for i, c in enumerate(text):
            if self.is_in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self.is_in_string = False
            elif c == '"':
                self.is_in_string = True
            elif c in "{[":
                self.depth += 1
                self.max_depth = max(self.max_depth, self.depth)
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


# `{"name": "...", "arguments": ` up to the arguments object: enough to announce the call
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class JsonCall:
    """One ``{"name": ..., "arguments"|"parameters": {...}}`` object as it streams. The raw
    arguments text streams once the head is seen; any other layout is parsed when it closes."""

    def __init__(self, index: int):
        self.index = index
        self.id = new_call_id()
        self.name: str | None = None
        self.text = ""  # the object's text so far
        self.rest = ""  # text pushed past the object's end, for the caller
        self.is_complete = False
        self._object = JsonExtent()
        self._arguments = JsonExtent()
        self._is_opaque = False  # not in the streamable layout: parsed whole when it closes
        self._args_start = self._sent = 0
        self._args_end: int | None = None

    @property
    def is_announced(self) -> bool:
        return self.name is not None

    @property
    def is_in_string(self) -> bool:
        """Inside one of the object's strings: text there, a tag's included, is the string's."""
        return not self.is_complete and self._object.is_in_string

    @property
    def arguments_so_far(self) -> str:
        """The argument text streamed so far (once announced)."""
        return self.text[self._args_start : self._sent]

    def push(self, text: str) -> list[ToolCallDelta]:
        if self.is_complete:
            self.rest += text
            return []
        end = self._object.feed(text)
        if end is not None:
            text, self.rest, self.is_complete = text[:end], self.rest + text[end:], True
        self.text += text
        deltas = [] if self.is_announced or self._is_opaque else self._announce()
        return deltas + self._stream_arguments()

    def _announce(self) -> list[ToolCallDelta]:
        m = _JSON_HEAD.match(self.text)
        if m is None:
            self._is_opaque = self._object.max_depth > 1 or self.is_complete
            return []
        try:
            name = json.loads(m.group(1))
        except json.JSONDecodeError:
            self._is_opaque = True
            return []
        self.name, self._args_start, self._sent = name, m.end(), m.end()
        return [ToolCallDelta(self.index, id=self.id, name=name)]

    def _stream_arguments(self) -> list[ToolCallDelta]:
        if not self.is_announced or self._args_end is not None:
            return []
        end = self._arguments.feed(self.text[self._sent :])
        sent = len(self.text) if end is None else self._sent + end
        fragment, self._sent = self.text[self._sent : sent], sent
        if end is not None:
            self._args_end = sent
        return [ToolCallDelta(self.index, arguments=fragment)] if fragment else []

    def close(self) -> tuple[list[ToolCallDelta], ToolCall | None]:
        """The finished call (and its one delta, if it was never announced), or None if malformed."""
        if not self.is_complete or self.rest.strip():
            return [], None
        call = self._parse()
        if call is None or self.is_announced:
            return [], call
        return [ToolCallDelta(self.index, id=call.id, name=call.name, arguments=call.arguments)], call

    def _parse(self) -> ToolCall | None:
        try:
            obj = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
        if not isinstance(args, dict):
            return None
        if not self.is_announced:
            return ToolCall(self.id, obj["name"], json.dumps(args, ensure_ascii=False))
        if self._args_end is None:
            return None
        raw = self.text[self._args_start : self._args_end]
        if obj["name"] != self.name or json.loads(raw) != args:
            return None
        return ToolCall(self.id, self.name, raw)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_FUNCTION_END = re.compile(r"\s*</function>")
_PARAMETER_END = "</parameter>"


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _parameter_value(raw: str) -> Any:
    """A parameter's value: JSON when it parses as JSON, else the text (one newline trimmed each side)."""
    text = raw.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return text


class XmlCall:
    """One Qwen3-Coder ``<function=NAME><parameter=P>value</parameter>...</function>`` body; the
    arguments object streams one parameter at a time."""

    def __init__(self, index: int):
        self.index = index
        self.id = new_call_id()
        self.name: str | None = None
        self.text = ""
        self._pos = 0
        self._parameter: str | None = None  # the open parameter's name
        self._arguments: list[str] = []
        self._is_done = False

    is_in_string = False  # no JSON strings in the markup: an end tag always ends the call

    @property
    def is_announced(self) -> bool:
        return self.name is not None

    @property
    def arguments_so_far(self) -> str:
        return "".join(self._arguments)

    def push(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        deltas: list[ToolCallDelta] = []
        while not self._is_done and self._advance(deltas):
            pass
        return deltas

    def _advance(self, deltas: list[ToolCallDelta]) -> bool:
        """Consume the next complete element at ``_pos``; False when it is not all here yet."""
        if self.name is None:
            if m := _FUNCTION.match(self.text, self._pos):
                self.name, self._pos = m.group(1).strip(), m.end()
                deltas.append(ToolCallDelta(self.index, id=self.id, name=self.name))
            return m is not None
        if self._parameter is not None:
            end = self.text.find(_PARAMETER_END, self._pos)
            if end < 0:
                return False
            value = _parameter_value(self.text[self._pos : end])
            key, self._parameter, self._pos = self._parameter, None, end + len(_PARAMETER_END)
            separator = ", " if self._arguments else "{"
            deltas.append(
                self._fragment(
                    f"{separator}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
                )
            )
            return True
        if m := _PARAMETER.match(self.text, self._pos):
            self._parameter, self._pos = m.group(1).strip(), m.end()
            return True
        if m := _FUNCTION_END.match(self.text, self._pos):
            self._is_done, self._pos = True, m.end()
            deltas.append(self._fragment("}" if self._arguments else "{}"))
            return True
        return False

    def _fragment(self, text: str) -> ToolCallDelta:
        self._arguments.append(text)
        return ToolCallDelta(self.index, arguments=text)

    def close(self) -> tuple[list[ToolCallDelta], ToolCall | None]:
        if not self._is_done or self.text[self._pos :].strip():
            return [], None
        arguments = "".join(self._arguments)
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return [], None
        return [], ToolCall(self.id, self.name, arguments)


# parsers
