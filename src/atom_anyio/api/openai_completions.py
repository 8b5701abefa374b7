"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint

from atom_anyio.api.common import (
    Choice,
    EngineFailed,
    TokenText,
    Usage,
    collect,
    new_id,
    now,
    parse_body,
    raise_on_error,
    sse,
    sse_response,
)
from atom_anyio.api.openai_chat import openai_error_event, openai_finish_reason
from atom_anyio.api.openai_schemas import CompletionRequest
from atom_anyio.api.server import Server
from atom_anyio.api.structured import only_one
from atom_anyio.engine.sequence import Logprob
from atom_anyio.prompt.prepare import PromptRequest


def completions_blueprint(server: Server) -> Blueprint:
    bp = Blueprint("openai_completions", __name__)

    @bp.post("/v1/completions")
    async def completions() -> Any:
        req = await parse_body(CompletionRequest)
        server.check_model(req.model)
        structured = only_one(*req.vllm_structured())
        prompts = [
            PromptRequest(
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=None if isinstance(p, str) else p,
                max_tokens=req.max_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                structured=structured,
            )
            for p in req.prompts()
        ]
        encoder = CompletionEncoder(server, req)
        admission = server.admit(encoder.num_choices)
        try:
            prepared = await server.prepare_many(prompts)
            # usage counts every prompt; Usage.add() only raises it to one prompt's count
            encoder.usage.prompt_tokens = sum(p.num_prompt_tokens for p in prepared)
            encoder.prompt_texts = [p.text or "" for p in prepared]
            if req.echo:
                encoder.prompt_texts = [
                    p.text if p.text is not None else server.loaded.tokenizer.decode(p.token_ids) for p in prepared
                ]
            stream = server.submit_many(
                [(p, req.sampling_params(p.max_tokens, req.logprobs)) for p in prepared], admission
            )
        except BaseException:
            admission.release()
            raise
        if req.stream:
            events = encoder.stream(stream)
            return sse_response(server.stream_events(events, encoder.usage, admission, openai_error_event))
        return await server.json_response(encoder.response(stream), encoder.usage, admission)

    return bp


class CompletionEncoder:
    """Engine deltas -> text_completion objects."""

    def __init__(self, server: Server, req: CompletionRequest):
        self.req = req
        self.id = new_id("cmpl-")
        self.created = now()
        self.model = server.model_name
        self.token_text = TokenText(server.loaded.tokenizer)
        self.usage = Usage()
        self.prompt_texts: list[str] = []
        self.num_choices = len(req.prompts()) * req.n

    def logprobs(self, lps: list[Logprob], offset: int) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({self.token_text(t)[0]: v for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echo(self, index: int) -> str:
        return self.prompt_texts[index // self.req.n] if self.req.echo else ""

    async def response(self, stream) -> dict[str, Any]:
        choices = await collect(stream, self.num_choices, self.usage)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(c) for c in choices],
            "usage": self.usage.openai(),
        }

    def _choice(self, c: Choice) -> dict[str, Any]:
        lp = self.logprobs(c.logprobs, 0) if self.req.logprobs is not None else None
        return {
            "index": c.index,
            "text": self._echo(c.index) + c.text,
            "logprobs": lp,
            "finish_reason": openai_finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.req.wants_usage_chunk:
            out["usage"] = usage
        return out

    async def stream(self, stream) -> AsyncIterator[str]:
        offsets = [0] * self.num_choices
        echoed: set[int] = set()
        finished = 0
        async with stream:
            async for d in stream:
                raise_on_error(d)
                self.usage.add(d)
                text = d.text
                if d.index not in echoed:
                    echoed.add(d.index)
                    text = self._echo(d.index) + text
                lp = None
                if self.req.logprobs is not None and d.logprobs:
                    lp = self.logprobs(d.logprobs, offsets[d.index])
                offsets[d.index] += len(d.text)
                finished += d.finish_reason is not None
                choice = {
                    "index": d.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": openai_finish_reason(d.finish_reason),
                }
                yield sse(self.chunk([choice]))
        if finished < self.num_choices:
            raise EngineFailed("the engine stopped before the request finished")
        if self.req.wants_usage_chunk:
            yield sse(self.chunk([], self.usage.openai()))
        yield sse("[DONE]")
