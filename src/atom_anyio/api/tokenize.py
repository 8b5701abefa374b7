"""POST /tokenize and /detokenize: the prompt path, without generating; GET /tokenizer_info."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from quart import Blueprint

from atom_anyio.api.errors import APIError
from atom_anyio.api.http import parse_body
from atom_anyio.api.openai_schemas import ChatMessage, Lenient, Tool, text_of_parts
from atom_anyio.api.runtime import Runtime
from atom_anyio.prompt.prepare import PromptRequest, tokenize_prompt


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


def tokenize_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("tokenize", __name__)

    @bp.post("/tokenize")
    async def tokenize() -> Any:
        req = await parse_body(TokenizeRequest)
        rt.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value")
        ids = await rt.run_in_prepare_thread(_tokenize, rt, req)
        return {"tokens": ids, "count": len(ids), "max_model_len": rt.max_model_len}

    @bp.post("/detokenize")
    async def detokenize() -> Any:
        req = await parse_body(DetokenizeRequest)
        rt.check_model(req.model)
        vocab = rt.prepare_ctx.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens", code="invalid_value")
        text = await rt.run_in_prepare_thread(rt.loaded.tokenizer.decode, req.tokens)
        return {"prompt": text}

    @bp.get("/tokenizer_info")
    async def tokenizer_info() -> Any:
        """vLLM's: what a client needs to tokenize as the server does through /tokenize and
        /detokenize (lm-evaluation-harness's remote tokenizer reads it), with the served template."""
        return tokenizer_info_of(rt)

    return bp


def tokenizer_info_of(rt: Runtime) -> dict[str, Any]:
    tokenizer = rt.loaded.tokenizer
    template = rt.prepare_ctx.template_sources  # the served one: the server's, else the tokenizer's
    if not isinstance(template, str | None):  # named templates: the default one
        template = template.get("default")
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": template,
        "model_max_length": rt.max_model_len,
    }


def _tokenize(rt: Runtime, req: TokenizeRequest) -> list[int]:
    """The same render and segment-cache path a request's prompt takes."""
    if req.prompt is not None:
        if not req.add_special_tokens:
            return list(rt.prepare_ctx.segment_cache.encode(req.prompt).token_ids)
        return tokenize_prompt(PromptRequest(prompt=req.prompt), rt.prepare_ctx)
    messages = []
    for i, m in enumerate(req.messages or []):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            msg["content"] = text_of_parts(m.content, f"messages.{i}.content")
        messages.append(msg)
    request = PromptRequest(
        messages=messages,
        tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        chat_template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
    )
    return tokenize_prompt(request, rt.prepare_ctx)
