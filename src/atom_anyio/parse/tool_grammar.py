"""Forced tool calls as xgrammar structural tags, one per tool-call format this server parses.

Each tag's output is exactly what the matching parser in ``tool_calls`` reads back: the call
markup around arguments that the tool's JSON schema constrains (compact JSON, as every schema
the grammar compiler reads). ``tool_choice: "required"`` allows one call (or several, when
parallel calls are on) of any of the tools; a named tool exactly one call of it. The output may
end after any complete call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# format -> (before the calls, a call's opening before its name, after the name, call end,
#            separator between calls, after the calls)
_JSON_FORMATS = {
    "hermes": ("", '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n", ""),
    "llama3_json": ("", '{"name": ', ', "parameters": ', "}", "; ", ""),
    "mistral": ("[TOOL_CALLS][", '{"name": ', ', "arguments": ', "}", ", ", "]"),
}


# Qwen3-Coder's XML calls are left out: its parser reads a parameter by its text (JSON when it
# parses as JSON), so a string parameter whose value looks like a number would come back a number.
FORCEABLE_FORMATS = tuple(_JSON_FORMATS)


def forced_tool_calls_tag(tool_format: str, tools: Sequence[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """A structural tag whose language is one or more calls of ``tools`` (chat-shaped
    ``{"type": "function", "function": {...}}``), one only unless ``parallel``."""
    before, _, _, _, separator, after = _JSON_FORMATS[tool_format]
    calls = {
        "type": "tags_with_separator",
        "tags": [_call_tag(tool_format, tool["function"]) for tool in tools],
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    # a whitespace separator may also end the calls: a model cannot tell the newline before another
    # call from the one before it stops, and writing it must not commit it to another call
    trailing = {"type": "optional", "content": _const(separator)} if separator.isspace() else None
    elements = [e for e in (_const(before), calls, trailing, _const(after)) if e is not None]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def _const(text: str) -> dict[str, Any] | None:
    return {"type": "const_string", "value": text} if text else None


def _call_tag(tool_format: str, function: dict[str, Any]) -> dict[str, Any]:
    name = function["name"]
    schema = function.get("parameters") or EMPTY_PARAMETERS
    _, open_, mid, end, _, _ = _JSON_FORMATS[tool_format]
    return {
        "type": "tag",
        "begin": f"{open_}{json.dumps(name, ensure_ascii=False)}{mid}",
        "content": {"type": "json_schema", "json_schema": schema},
        "end": end,
    }
