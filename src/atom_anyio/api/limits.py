"""Every limit on a request body, in one place (docs/operations.md lists
them). The size and shape limits are checked on the parsed JSON before the
wire format's model sees it, so each endpoint refuses the same way: a 400
naming the field and the limit."""

from __future__ import annotations

import json
from typing import Any

from atom_anyio.api.errors import APIError

MAX_JSON_DEPTH = 64  # nesting of objects and arrays in a body
MAX_MESSAGES = 10_000  # chat / Messages ``messages``, Responses ``input`` items
MAX_PROMPTS = 128  # prompts in one completions request
MAX_N = 128  # choices per prompt
MAX_STOP = 16  # OpenAI ``stop`` strings
MAX_STOP_SEQUENCES = 64  # Anthropic ``stop_sequences``
MAX_LOGIT_BIAS = 1024  # ``logit_bias`` entries
MAX_TOOLS = 256  # tool definitions
MAX_SCHEMA_BYTES = 64 * 1024  # one tool definition or response-format schema, as compact JSON

# (field, limit name, limit) for lists and maps at the top of a body
_COUNTED = (
    ("messages", "max_messages", MAX_MESSAGES),
    ("input", "max_messages", MAX_MESSAGES),
    ("tools", "max_tools", MAX_TOOLS),
    ("logit_bias", "max_logit_bias", MAX_LOGIT_BIAS),
    ("stop", "max_stop", MAX_STOP),
    ("stop_sequences", "max_stop_sequences", MAX_STOP_SEQUENCES),
)


def check_body(body: dict[str, Any]) -> None:
    """Refuse a parsed body past a size or shape limit (400 naming both)."""
    check_depth(body)
    for name, limit_name, limit in _COUNTED:
        value = body.get(name)
        if isinstance(value, list | dict) and len(value) > limit:
            raise limit_error(name, limit_name, limit, f"has {len(value)} entries")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
        raise limit_error("prompt", "max_prompts", MAX_PROMPTS, f"has {len(prompt)} prompts")
    n = body.get("n")
    if type(n) is int and n > MAX_N:
        raise limit_error("n", "max_n", MAX_N, f"is {n}")
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        _check_schema_size(f"tools.{i}", tool)
    _check_schema_size("response_format", body.get("response_format"))
    text = body.get("text")
    if isinstance(text, dict):
        _check_schema_size("text.format", text.get("format"))


def check_depth(body: Any) -> None:
    """Iteratively, so a deep body costs no recursion."""
    stack = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise depth_error()
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def depth_error() -> APIError:
    return APIError(
        400,
        f"The request body is nested deeper than the limit of {MAX_JSON_DEPTH} (max_json_depth).",
        code="limit_exceeded",
    )


def limit_error(param: str, limit_name: str, limit: int, detail: str) -> APIError:
    return APIError(
        400, f"'{param}' {detail}; the limit is {limit} ({limit_name}).", param=param, code="limit_exceeded"
    )


def _check_schema_size(param: str, value: Any) -> None:
    if value is None:
        return
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_SCHEMA_BYTES:
        raise limit_error(param, "max_schema_bytes", MAX_SCHEMA_BYTES, f"is {size} bytes of JSON")
