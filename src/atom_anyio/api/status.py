"""Models, health, version, tokenize, detokenize, metrics."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from quart import Blueprint, Response

from atom_anyio import __version__
from atom_anyio.api.common import parse_body
from atom_anyio.api.errors import APIError
from atom_anyio.api.openai_schemas import ChatMessage, Lenient, Tool, _text_of_parts
from atom_anyio.api.server import Server
from atom_anyio.prompt.prepare import PromptError, PromptRequest, tokenize_prompt


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def misc_blueprint(server: Server) -> Blueprint:
    bp = Blueprint("misc", __name__)

    def model_card() -> dict[str, Any]:
        return {
            "id": server.model_name,
            "object": "model",
            "created": int(server.started_at),
            "owned_by": "atom_anyio",
            "root": server.config.model or server.model_name,
            "max_model_len": server.max_model_len,
        }

    @bp.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @bp.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Any:
        server.check_model(model_id)
        return model_card()

    @bp.get("/health")
    async def health() -> Any:
        if server.is_healthy:
            return {"status": "ok"}
        return {"status": "unavailable", "error": server.engine and server.engine.error}, 503

    @bp.get("/version")
    async def version() -> Any:
        model = server.loaded.model if server.loaded else None
        return {
            "version": __version__,
            "attention_backend": model and model.attention_backend.name,
            "dtype": model and model.dtype_name,
        }

    @bp.get("/metrics")
    async def metrics() -> Any:
        return Response(server.metrics.render(), mimetype="text/plain; version=0.0.4")

    @bp.post("/tokenize")
    async def tokenize() -> Any:
        req = await parse_body(TokenizeRequest)
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value")
        try:
            ids = await server.run_in_prepare_thread(_tokenize, server, req)
        except PromptError as exc:
            raise APIError(400, exc.message, param=exc.param, code=exc.code) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @bp.post("/detokenize")
    async def detokenize() -> Any:
        req = await parse_body(DetokenizeRequest)
        server.check_model(req.model)
        vocab = server.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens", code="invalid_value")
        text = await server.run_in_prepare_thread(server.loaded.tokenizer.decode, req.tokens)
        return {"prompt": text}

    return bp


def _tokenize(server: Server, req: TokenizeRequest) -> list[int]:
    """The same render and segment-cache path a request's prompt takes."""
    if req.prompt is not None:
        if not req.add_special_tokens:
            return list(server.prepare_ctx.segment_cache.encode(req.prompt).token_ids)
        return tokenize_prompt(PromptRequest(prompt=req.prompt), server.prepare_ctx)
    messages = []
    for i, m in enumerate(req.messages or []):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            msg["content"] = _text_of_parts(m.content, f"messages.{i}.content")
        messages.append(msg)
    request = PromptRequest(
        messages=messages,
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        chat_template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
    )
    return tokenize_prompt(request, server.prepare_ctx)
