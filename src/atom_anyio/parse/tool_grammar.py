"""Forced tool calls as xgrammar structural tags, one per tool-call format this server parses.

Each tag's output is exactly what the matching parser in ``tool_calls`` reads back: the call
markup around arguments that the tool's JSON schema constrains. ``tool_choice: "required"``
allows one call (or several, when parallel calls are on) of any of the tools; a named tool
exactly one call of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_WHITESPACE = 1  # consecutive whitespace characters between JSON tokens: a model cannot pad forever

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
    tags = [_call_tag(tool_format, tool["function"]) for tool in tools]
    calls: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": _JSON_FORMATS[tool_format][4],
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    before, after = _JSON_FORMATS[tool_format][0::5]
    if before or after:
        calls = {
            "type": "sequence",
            "elements": [{"type": "const_string", "value": before}, calls, {"type": "const_string", "value": after}],
        }
    return {"type": "structural_tag", "format": calls}


def _call_tag(tool_format: str, function: dict[str, Any]) -> dict[str, Any]:
    name = function["name"]
    schema = function.get("parameters") or EMPTY_PARAMETERS
    _, open_, mid, end, _, _ = _JSON_FORMATS[tool_format]
    return {
        "type": "tag",
        "begin": f"{open_}{json.dumps(name, ensure_ascii=False)}{mid}",
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
        "end": end,
    }
