"""``/v1/responses`` over a WebSocket (Responses WebSocket mode).

The client sends ``{"type": "response.create", ...request body...}`` messages, one at a time; each
is answered by the events its SSE stream would carry, one JSON text message per event, ending with
``response.completed`` / ``response.incomplete`` / ``response.failed``. A request the server refuses
is answered by one ``{"type": "error", "status", "error": {...}}`` message; the socket stays open.

The socket keeps its own last responses (``CACHED_RESPONSES``), ``store: false`` ones included, so
``previous_response_id`` continues a chain on the same socket without the store; a turn that fails
drops the response it continued from there, so the next attempt must start again.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from pydantic import ValidationError
from quart import websocket

from atom_anyio.api.errors import APIError, from_validation_error
from atom_anyio.api.limits import check_body
from atom_anyio.api.response_store import ResponseStore
from atom_anyio.api.responses_schemas import ResponsesRequest


class Responses(Protocol):
    """What the socket runs its turns through (``responses.Responses``); a protocol, as that module
    imports this one to serve the route."""

    def turn(self, req: ResponsesRequest, *, frame: Callable[[dict[str, Any]], str], cache: ResponseStore) -> Any: ...

    async def respond(self, turn: Any) -> Any: ...


CACHED_RESPONSES = 8
FINISHED = ("response.completed", "response.incomplete")


def ndjson_frame(event: dict[str, Any]) -> str:
    """An event as one line: JSON escapes every newline, so a line is exactly one message."""
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n"


async def serve_websocket(api: Responses) -> None:
    await websocket.accept()
    cache = ResponseStore(CACHED_RESPONSES, api.store.ttl_s)
    while True:
        await _turn(api, cache, await websocket.receive())


async def _turn(api: Responses, cache: ResponseStore, message: str | bytes) -> None:
    """One ``response.create``: its own request line, admission and response."""
    structlog.contextvars.bind_contextvars(request_id=uuid.uuid4().hex)
    with api.rt.tracker.http_request() as record:
        record.endpoint = "responses_websocket"
        record.log_context = structlog.contextvars.get_contextvars()
        previous = None
        try:
            body = _create_event(message)
            previous = body.get("previous_response_id")
            turn = api.turn(_request(body), frame=ndjson_frame, cache=cache)
            response = await api.respond(turn)
        except APIError as err:
            record.status = err.status
            await websocket.send(json.dumps({"type": "error", "status": err.status, "error": err.openai()["error"]}))
        else:
            record.status = 200
            last = await _relay(response)
            if json.loads(last)["type"] in FINISHED:
                return
        if isinstance(previous, str):
            cache.delete(previous)


async def _relay(response: Any) -> str:
    """Send the streamed response's events, one message each; the last one sent."""
    last = ""
    async with response.response as body:  # the body Quart would have sent as SSE, framed as lines
        async for chunk in body:
            for last in chunk.splitlines():
                await websocket.send(last)
    return last


def _create_event(message: str | bytes) -> dict[str, Any]:
    try:
        body = json.loads(message, parse_constant=_not_a_number)
    except (ValueError, RecursionError):
        raise APIError(400, "The message is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict) or body.get("type") != "response.create":
        kind = body.get("type") if isinstance(body, dict) else None
        raise APIError(
            400,
            f"Invalid value for 'type': {kind!r}; messages on this socket are response.create events",
            param="type",
            code="invalid_value",
        )
    check_body(body)
    return body


def _not_a_number(literal: str) -> float:
    raise ValueError(f"{literal} is not a JSON number")


def _request(body: dict[str, Any]) -> ResponsesRequest:
    """The event's request body; always streamed (``stream`` is not a field of the event)."""
    try:
        return ResponsesRequest.model_validate({**body, "stream": True})
    except ValidationError as exc:
        raise from_validation_error(exc) from None
