"""HTTP pieces every wire format shares: body parsing and validation, SSE framing, ids."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import Response, has_request_context, request, websocket

from atom_anyio.api.errors import APIError, from_validation_error
from atom_anyio.api.limits import check_body, depth_error
from atom_anyio.engine.request import KVLease

M = TypeVar("M", bound=BaseModel)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only bodies with one are checked for a lone half
# the agent CLIs' session ids: Claude Code's, Codex's
SESSION_HEADERS = ("x-claude-code-session-id", "session-id")
MAX_LEASE_KEY_CHARS = 256


def connection() -> Any:
    """The HTTP request, or the WebSocket handshake, being handled (their path, method, headers)."""
    return request if has_request_context() else websocket


def kv_lease(key: str | None = None, ttl_s: float | None = None) -> KVLease:
    """How the request's KV outlasts it: for its conversation (the body's key, e.g. OpenAI's
    ``prompt_cache_key``, else an agent CLI's session header; none: the request alone), for
    ``ttl_s`` (None: the server's ``kv_lease_ttl_s``)."""
    headers = connection().headers
    key = key or next((v for h in SESSION_HEADERS if (v := headers.get(h))), None)
    return KVLease(key[:MAX_LEASE_KEY_CHARS] if key else None, ttl_s)


async def parse_body(model: type[M]) -> M:
    """The request body validated against ``model``; 4xx naming the field otherwise."""
    ctype = request.mimetype
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {ctype!r}", code="unsupported_media_type")
    raw = await request.get_data(as_text=False)
    try:
        body = json.loads(raw, parse_constant=_not_a_number)
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not valid UTF-8.", code="invalid_json") from None
    except RecursionError:
        raise depth_error() from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400, f"The request body is not valid JSON: {exc.msg} at position {exc.pos}", code="invalid_json"
        ) from None
    except ValueError as exc:  # NaN or Infinity, or an integer over Python's digit limit
        reason = str(exc).partition(";")[0]
        raise APIError(400, f"The request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    check_body(body)
    if SURROGATE_ESCAPE.search(raw) and not _is_encodable(body):
        raise APIError(400, "The request body has a lone UTF-16 surrogate (\\ud800-\\udfff).", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _not_a_number(literal: str) -> float:
    raise ValueError(f"{literal} is not a JSON number")


def _is_encodable(body: dict) -> bool:
    """No string holds half a surrogate pair (JSON escapes allow it; UTF-8 and the tokenizer do not)."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def sse_response(events: AsyncIterator[str]) -> Response:
    """A streamed ``text/event-stream`` response with no send timeout (Quart
    would otherwise cut a long stream off silently after 60 s)."""
    resp = Response(
        events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    resp.timeout = None
    return resp


def sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"
