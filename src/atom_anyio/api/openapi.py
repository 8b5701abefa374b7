"""The OpenAPI 3.1 document served at ``GET /openapi.json``.

Request bodies are the pydantic models the routes validate with, so the
document cannot drift from what the server accepts; responses are described
loosely except for the error shapes, which are exact."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from quart import Blueprint

from atom_anyio.api.anthropic_schemas import MessagesInput, MessagesRequest
from atom_anyio.api.errors import ANTHROPIC_STATUSES
from atom_anyio.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from atom_anyio.api.responses_schemas import ResponsesRequest
from atom_anyio.api.tokenize import DetokenizeRequest, TokenizeRequest
from atom_anyio.version import __version__

REF = "#/components/schemas/{model}"
BEARER = [{"bearer": []}]
ANTHROPIC_AUTH = [{"apiKey": []}, {"bearer": []}]
OPEN: list[dict[str, list[str]]] = []

# POST routes: (path, body model, tag, summary, generates: streams and may fail in the engine)
POSTS: list[tuple[str, type[BaseModel], str, str, bool]] = [
    ("/v1/chat/completions", ChatCompletionRequest, "openai", "Create a chat completion", True),
    ("/v1/completions", CompletionRequest, "openai", "Create a text completion", True),
    ("/v1/responses", ResponsesRequest, "openai", "Create a response (the Responses API)", True),
    ("/v1/messages", MessagesRequest, "anthropic", "Create a message (the Anthropic Messages API)", True),
    ("/v1/messages/count_tokens", MessagesInput, "anthropic", "Count a message request's input tokens", False),
    ("/tokenize", TokenizeRequest, "tokens", "Tokenize a prompt or messages as a request would", False),
    ("/detokenize", DetokenizeRequest, "tokens", "Decode token ids to text", False),
]

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
ERROR_REASONS = {
    400: "Invalid request: `param` (OpenAI) or the message names the field",
    401: "Missing or wrong API key",
    404: "Unknown model, route or stored response",
    413: "Body larger than the server's limit",
    415: "Content-Type is not JSON",
    500: "The engine failed while generating",
    503: "Shutting down or the engine is unavailable",
}
OBJECT = {"type": "object"}
# before OpenAPI 3.2 a stream's ``schema`` describes one event; ``data`` is the JSON text
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}


def openapi_blueprint() -> Blueprint:
    bp = Blueprint("openapi", __name__)

    @bp.get("/openapi.json")
    async def document() -> Any:
        return openapi_document()

    return bp


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The whole document; built on first use and shared (treat it as read-only)."""
    schemas = _request_schemas()
    schemas["OpenAIError"] = OPENAI_ERROR
    schemas["AnthropicError"] = ANTHROPIC_ERROR
    paths: dict[str, dict[str, Any]] = {}
    for path, model, tag, summary, generates in POSTS:
        paths[path] = {"post": _post(model, tag, summary, generates)}
    paths.update(_gets())
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "atom_anyio",
            "version": __version__,
            "description": "OpenAI- and Anthropic-compatible LLM inference. Authentication applies only when "
            "the server has an API key (ATOM_API_KEY). Unknown body fields are ignored.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
            "parameters": {
                "RequestId": {
                    "name": "x-request-id",
                    "in": "header",
                    "required": False,
                    "description": "Echoed back (first 128 characters); generated when absent.",
                    "schema": {"type": "string"},
                }
            },
        },
    }


def _request_schemas() -> dict[str, Any]:
    """Every request model's JSON schema, their shared definitions under components."""
    _, top = models_json_schema([(m, "validation") for _, m, *_ in POSTS], ref_template=REF)
    return dict(top["$defs"])


def _post(model: type[BaseModel], tag: str, summary: str, generates: bool) -> dict[str, Any]:
    anthropic = tag == "anthropic"
    ok: dict[str, Any] = {"application/json": {"schema": OBJECT}}
    if generates:
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    return _operation(
        tag,
        summary,
        ANTHROPIC_AUTH if anthropic else BEARER,
        {
            "200": {
                "description": "OK" + (" (server-sent events when `stream` is true)" if generates else ""),
                "content": ok,
            }
        },
        errors=(400, 401, 404, 413, 415, 500, 503) if generates else (400, 401, 404, 413, 415),
        anthropic=anthropic,
        requestBody={
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        },
    )


def _gets() -> dict[str, dict[str, Any]]:
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    model_id = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    model_card = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "max_model_len"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "root": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
    }
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"data": {"type": "array", "items": model_card}},
    }
    nullable_string = {"type": ["string", "null"]}
    tokenizer_info = {
        "type": "object",
        "required": ["tokenizer_class", "eos_token", "chat_template", "model_max_length"],
        "properties": {
            "tokenizer_class": {"type": "string"},
            **{k: nullable_string for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")},
            "model_max_length": {"type": "integer"},
        },
    }
    health = {"type": "object", "required": ["status"], "properties": {"status": {"enum": ["ok", "unavailable"]}}}
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/v1/models": {"get": _operation("openai", "List the served model", BEARER, _ok(models), errors=(401,))},
        "/v1/models/{model_id}": {
            "get": _operation(
                "openai", "The served model", BEARER, _ok(model_card), errors=(401, 404), parameters=model_id
            )
        },
        "/v1/responses/{response_id}": {
            "get": _operation(
                "openai", "A stored response", BEARER, _ok(OBJECT), errors=(401, 404), parameters=response_id
            ),
            "delete": _operation(
                "openai", "Delete a stored response", BEARER, _ok(OBJECT), errors=(401, 404), parameters=response_id
            ),
        },
        "/health": {
            "get": _operation(
                "server",
                "Readiness: 200 while the engine runs",
                OPEN,
                {
                    **_ok(health),
                    "503": {
                        "description": "The engine is not running",
                        "content": {"application/json": {"schema": health}},
                    },
                },
            )
        },
        "/version": {"get": _operation("server", "The server's version", OPEN, _ok(OBJECT))},
        "/tokenizer_info": {
            "get": _operation(
                "tokens",
                "The tokenizer's special tokens and the served chat template",
                BEARER,
                _ok(tokenizer_info),
                errors=(401,),
            )
        },
        "/metrics": {
            "get": _operation("server", "Prometheus metrics", OPEN, {"200": {"description": "OK", "content": text}})
        },
        "/openapi.json": {"get": _operation("server", "This document", OPEN, _ok(OBJECT))},
    }


def _ok(schema: dict[str, Any]) -> dict[str, Any]:
    return {"200": {"description": "OK", "content": {"application/json": {"schema": schema}}}}


def _operation(
    tag: str,
    summary: str,
    security: list[dict[str, list[str]]],
    responses: dict[str, Any],
    *,
    errors: tuple[int, ...] = (),
    anthropic: bool = False,
    parameters: list[dict[str, Any]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One operation; ``errors`` in the route's error shape (Anthropic's statuses on its routes)."""
    shape = {"$ref": REF.format(model="AnthropicError" if anthropic else "OpenAIError")}
    for status in errors:
        wire = ANTHROPIC_STATUSES.get(status, status) if anthropic else status
        responses[str(wire)] = {
            "description": ERROR_REASONS[status],
            "content": {"application/json": {"schema": shape}},
        }
    return {
        "tags": [tag],
        "summary": summary,
        "security": security,
        "parameters": [*(parameters or []), {"$ref": "#/components/parameters/RequestId"}],
        "responses": responses,
        **fields,
    }
