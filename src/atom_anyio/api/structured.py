"""Each API's structured-output fields mapped onto one ``StructuredOutputs``, or a 400 naming the field.

At most one constraint per request: a response format, vLLM's ``structured_outputs`` or a legacy
``guided_*`` field, or a forced tool call (``tool_choice`` required or named).
"""

from __future__ import annotations

from typing import Any

from atom_anyio.api.errors import APIError
from atom_anyio.parse import ParserSpec
from atom_anyio.parse.tool_grammar import FORCEABLE_FORMATS, forced_tool_calls_tag
from atom_anyio.sampling_params import StructuredOutputs

# vLLM's structured_outputs keys -> our kinds
_VLLM_KEYS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
_TYPES = {
    "json": (dict, str),
    "regex": (str,),
    "choice": (list,),
    "grammar": (str,),
    "json_object": (bool,),
    "structural_tag": (dict, str),
}


def bad(param: str, reason: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {reason}", param=param, code="invalid_value")


def only_one(*candidates: StructuredOutputs | None) -> StructuredOutputs | None:
    """The one constraint set, or None; two or more are a 400 naming them."""
    given = [c for c in candidates if c is not None]
    if len(given) > 1:
        names = ", ".join(c.param for c in given)
        raise APIError(400, f"only one output constraint may be set per request; got {names}", param=given[1].param)
    return given[0] if given else None


def checked(kind: str, value: Any, param: str) -> StructuredOutputs:
    """``value`` of ``kind`` after the checks the grammar compiler does not make."""
    if not isinstance(value, _TYPES[kind]):
        raise bad(param, f"expected {' or '.join(t.__name__ for t in _TYPES[kind])}")
    if kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
        raise bad(param, "must be a non-empty list of non-empty strings")
    if kind in ("regex", "grammar") and not value:
        raise bad(param, "must not be empty")
    if kind == "json_object":
        value = None
    return StructuredOutputs(kind, value, param)


def vllm_structured(
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> list[StructuredOutputs | None]:
    """vLLM's ``structured_outputs`` object and its legacy ``guided_*`` fields, each a candidate."""
    out: list[StructuredOutputs | None] = []
    for key, value in (structured_outputs or {}).items():
        kind = _VLLM_KEYS.get(key)
        if kind is None or value is None or (kind == "json_object" and value is False):
            continue  # vLLM's options (disable_fallback, whitespace_pattern, ...) are not constraints
        out.append(checked(kind, value, f"structured_outputs.{key}"))
    for key, value in guided.items():
        if value is not None:
            out.append(checked(key.removeprefix("guided_"), value, key))
    return out


def response_format(fmt: dict[str, Any] | None, param: str = "response_format") -> StructuredOutputs | None:
    """OpenAI's ``response_format`` (chat) and ``text.format`` (Responses, where the schema sits
    beside the type instead of under ``json_schema``)."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object", None, param)
    if kind != "json_schema":
        raise bad(f"{param}.type", f"{kind!r} is not supported; use text, json_object or json_schema")
    holder, where = (fmt, param) if "schema" in fmt else (fmt.get("json_schema"), f"{param}.json_schema")
    if not isinstance(holder, dict) or not isinstance(holder.get("schema"), dict):
        raise bad(f"{where}.schema", "a json_schema format needs a 'schema' object")
    return StructuredOutputs("json", holder["schema"], f"{where}.schema")


def forced_tools(
    spec: ParserSpec,
    tools: list[dict[str, Any]],
    forced: str | None,
    *,
    parallel: bool,
    param: str = "tool_choice",
) -> StructuredOutputs | None:
    """A grammar over the model's tool-call format: ``forced`` None (auto, none: nothing forced),
    ``"required"`` (any of ``tools``, chat-shaped) or a tool's name (exactly that one)."""
    if forced is None:
        return None
    if spec.tool_format is None:
        raise bad(
            param, "forcing a tool call needs the model's tool-call format; start the server with --tool-call-parser"
        )
    if spec.tool_format not in FORCEABLE_FORMATS:
        raise bad(param, f"forcing a tool call is not supported for the {spec.tool_format} tool-call format")
    if forced != "required":
        tools = [t for t in tools if t["function"]["name"] == forced]
        if not tools:
            raise bad(param, f"{forced!r} is not one of the request's tools")
        parallel = False
    # a compile error is in a tool's parameters schema
    return StructuredOutputs(
        "structural_tag", forced_tool_calls_tag(spec.tool_format, tools, parallel=parallel), "tools"
    )
