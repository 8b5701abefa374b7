"""The ASGI app: ``hypercorn atom_anyio:app``.

The callable owns the lifespan (and through ``runtime.serving`` the root task
group holding the engine loop); Quart routes HTTP and the Responses WebSocket.
Importing this module loads nothing heavy: the model is loaded when the
lifespan starts.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import structlog
from quart import Quart, Response, has_request_context, request
from quart.asgi import ASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from atom_anyio.api.anthropic import messages_blueprint
from atom_anyio.api.errors import APIError
from atom_anyio.api.http import connection
from atom_anyio.api.hypercorn_drain import drain_before_hypercorn_shutdown
from atom_anyio.api.openai_chat import chat_blueprint
from atom_anyio.api.openai_completions import completions_blueprint
from atom_anyio.api.openapi import openapi_blueprint
from atom_anyio.api.responses import responses_blueprint
from atom_anyio.api.runtime import Runtime, serving
from atom_anyio.api.status import status_blueprint
from atom_anyio.api.tokenize import tokenize_blueprint
from atom_anyio.api.tracker import current_record
from atom_anyio.config import Config
from atom_anyio.engine.sampler import Sampler
from atom_anyio.models.loader import LoadedModel
from atom_anyio.obs.logging import configure_logging
from atom_anyio.settings import ConfigError

log = structlog.get_logger("atom_anyio.api")

OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json")
CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Request-Id, Anthropic-Version, Anthropic-Beta"


class HTTPConnection(ASGIHTTPConnection):
    """Quart's, inside the tracker's request scope: the request's line is written when it ends,
    and a request admitted here is released even if its response body never starts."""

    async def __call__(self, receive: Any, send: Any) -> None:
        with self.app.extensions["atom_runtime"].tracker.http_request():
            await super().__call__(receive, send)


class AtomApp:
    """ASGI callable: the lifespan (``serving``) here, HTTP to the Quart app built on the runtime.

    ``on_engine_crash`` is called if the engine loop crashes (the CLI exits non-zero on it)."""

    def __init__(
        self,
        config: Config | None = None,
        loaded: LoadedModel | None = None,
        on_engine_crash: Callable[[], None] | None = None,
        sampler: Sampler | None = None,
    ):
        self._config = config
        self._loaded = loaded
        self._sampler = sampler  # the engine's (a test's fake); default the real one
        self.on_engine_crash = on_engine_crash
        self._runtime: Runtime | None = None
        self._quart: Quart | None = None

    @property
    def config(self) -> Config:
        if self._config is None:  # built from ATOM_* (``hypercorn atom_anyio:app``): its logging settings too
            self._config = Config.from_env()
            configure_logging(self._config.log_format, self._config.log_level)
        return self._config

    @property
    def is_serving(self) -> bool:
        return self._runtime is not None

    @property
    def runtime(self) -> Runtime:
        assert self._runtime is not None, "the app is not serving"
        return self._runtime

    @property
    def quart(self) -> Quart:
        assert self._quart is not None, "the app is not serving"
        return self._quart

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[AtomApp]:
        """Load, start the engine and bind the routes to the runtime; drain at exit."""
        async with serving(self.config, self._loaded, self.on_engine_crash, self._sampler) as runtime:
            self._runtime, self._quart = runtime, build_quart(runtime)
            yield self

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self._quart is None:  # before startup completed (servers wait for it) or after shutdown
            await _unavailable(scope, send)
        else:
            await self._quart(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        started = False
        try:
            async with self.serving():
                await self.quart.startup()
                started = True
                await send({"type": "lifespan.startup.complete"})
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drain_before_hypercorn_shutdown, self.runtime)
                    message = await receive()  # lifespan.shutdown
                    tg.cancel_scope.cancel()
                log.info("server.shutdown", reason="lifespan.shutdown")
                await self.quart.shutdown()
        except ConfigError as exc:  # a bad ATOM_* setting: one line naming it, no traceback, exit 2
            print(f"atom_anyio: error: {exc}", file=sys.stderr, flush=True)
            os._exit(2)  # hypercorn would print its own traceback for a failed startup
        except BaseException as exc:
            log.exception("lifespan.failed")
            if not started:
                await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                return
            raise
        await send({"type": "lifespan.shutdown.complete"})


async def _unavailable(scope: dict, send: Any) -> None:
    if scope["type"] == "websocket":  # closed before the handshake: the server answers 403
        await send({"type": "websocket.close", "code": 1013})
        return
    if scope["type"] != "http":
        return
    body = b'{"error":{"message":"the server is not serving","type":"server_error","code":"not_ready"}}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_quart(rt: Runtime) -> Quart:
    app = Quart("atom_anyio")
    app.extensions["atom_runtime"] = rt
    app.asgi_http_class = HTTPConnection
    app.config["MAX_CONTENT_LENGTH"] = rt.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = rt.config.body_timeout_s
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    for blueprint in (chat_blueprint, completions_blueprint, messages_blueprint, responses_blueprint):
        app.register_blueprint(blueprint(rt))
    app.register_blueprint(status_blueprint(rt))
    app.register_blueprint(tokenize_blueprint(rt))
    app.register_blueprint(openapi_blueprint())

    @app.before_request
    @app.before_websocket
    async def bind_request_id() -> None:
        structlog.contextvars.clear_contextvars()
        conn = connection()
        rid = conn.headers.get("x-request-id", "")[:128] or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=rid, method=conn.method, path=conn.path)
        if (record := current_record()) is not None:
            record.endpoint = endpoint_label()
            record.log_context = structlog.contextvars.get_contextvars()

    @app.after_request
    async def return_request_id(response: Any) -> Any:
        rid = structlog.contextvars.get_contextvars().get("request_id")
        if rid:
            response.headers["x-request-id"] = rid
        if (record := current_record()) is not None:
            record.status = response.status_code
        return response

    add_cors(app, rt.config.cors_allow_origins)

    @app.after_request
    async def receive_the_body(response: Any) -> Any:
        """An error can answer before the body arrived (401, 404, 415); hypercorn then closes
        the connection without ``Connection: close`` and the client's next request on it fails."""
        if response.status_code >= 400:
            with contextlib.suppress(HTTPException):  # 413: over the limit, it is not read
                await request.get_data()
        return response

    @app.before_request
    @app.before_websocket  # a refused handshake is answered with the 401
    async def authenticate() -> None:
        key = rt.config.api_key
        conn = connection()
        if not key or conn.path in OPEN_PATHS:
            return
        given = conn.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not token and conn.path.startswith("/v1/messages"):
            token = conn.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "Invalid or missing API key.", code="invalid_api_key")

    @app.errorhandler(APIError)
    async def api_error(err: APIError) -> Any:
        return error_response(err)

    @app.errorhandler(HTTPException)
    async def http_error(err: HTTPException) -> Any:
        conn, is_http = connection(), has_request_context()
        messages = {
            404: f"No route for {conn.method if is_http else 'a WebSocket to'} {conn.path}.",
            405: f"Method {conn.method} is not allowed for {conn.path}."
            if is_http
            else f"{conn.path} takes no WebSocket.",
            413: f"The request body is larger than the limit of {rt.config.max_body_bytes} bytes.",
        }
        code = err.code or 500
        return error_response(
            APIError(code, messages.get(code, err.description or err.name), code=err.name.lower().replace(" ", "_"))
        )

    @app.errorhandler(Exception)
    async def unexpected(err: Exception) -> Any:
        log.exception("request.unhandled_error")
        return error_response(APIError(500, f"Internal error: {type(err).__name__}", code="internal_error"))

    return app


def add_cors(app: Quart, allow_origins: str) -> None:
    """CORS for the configured origins only (``*``: any); nothing at all when none are."""
    origins = {o.strip() for o in allow_origins.split(",") if o.strip()}
    if not origins:
        return

    def allowed_origin() -> str | None:
        origin = request.headers.get("Origin")
        return origin if origin and (origin in origins or "*" in origins) else None

    @app.before_request
    async def preflight() -> Any:  # registered before authentication: a preflight carries no key
        origin = allowed_origin()
        if request.method == "OPTIONS" and origin and "Access-Control-Request-Method" in request.headers:
            headers = {
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": CORS_ALLOW_HEADERS,
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            }
            return Response("", status=204, headers=headers)
        return None

    @app.after_request
    async def allow_origin(response: Any) -> Any:
        origin = allowed_origin()
        if origin:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, Retry-After"
            response.headers.add("Vary", "Origin")
        return response


def endpoint_label() -> str:
    """The matched route's endpoint name (its blueprint prefix dropped); "other" for
    a path no route matches, so a label never carries a client-chosen string."""
    rule = connection().url_rule
    return rule.endpoint.rpartition(".")[2] if rule is not None and rule.endpoint else "other"


def error_response(err: APIError) -> Any:
    if connection().path.startswith("/v1/messages"):
        return err.anthropic(), err.anthropic_status, err.headers
    return err.openai(), err.status, err.headers


app = AtomApp()
