"""POST /v1/chat/completions."""

from __future__ import annotations

import functools
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
from atom_anyio.api.errors import APIError
from atom_anyio.api.openai_schemas import ChatCompletionRequest
from atom_anyio.api.server import Server
from atom_anyio.engine.sequence import Delta, Logprob
from atom_anyio.parse import OutputParser, ParsedDelta, ToolCall, ToolCallDelta
from atom_anyio.prompt.prepare import PromptRequest


def chat_blueprint(server: Server) -> Blueprint:
    bp = Blueprint("openai_chat", __name__)

    @bp.post("/v1/chat/completions", endpoint="chat")
    async def chat_completions() -> Any:
        req = await parse_body(ChatCompletionRequest)
        server.check_model(req.model)
        parse_tools = bool(req.tools) and req.tool_choice != "none"  # "none": no tools in the prompt or the output
        prompt = PromptRequest(
            messages=req.flat_messages(),
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if parse_tools else None,
            chat_template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            max_tokens=req.requested_max_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured=req.structured(server.parser_spec),
        )
        admission = server.admit(req.n)
        try:
            prepared = await server.prepare(prompt)
            params = req.sampling_params(prepared.max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
            if parse_tools and server.parser_spec.keeps_special_tokens:
                params.skip_special_tokens = False
            encoder = ChatEncoder(server, req, prepared.text, parse_tools=parse_tools)
            stream = server.submit(prepared, params, admission)
        except BaseException:
            admission.release()
            raise
        if req.stream:
            events = encoder.stream(stream)
            return sse_response(server.stream_events(events, encoder.usage, admission, openai_error_event))
        return await server.json_response(encoder.response(stream), encoder.usage, admission)

    return bp


class ChatEncoder:
    """Engine deltas -> chat.completion / chat.completion.chunk objects."""

    def __init__(self, server: Server, req: ChatCompletionRequest, prompt_text: str | None, *, parse_tools: bool):
        self.req = req
        self.new_parser = functools.partial(OutputParser, server.parser_spec, prompt_text, parse_tools=parse_tools)
        self.id = new_id("chatcmpl-")
        self.created = now()
        self.model = server.model_name
        self.token_text = TokenText(server.loaded.tokenizer)
        self.usage = Usage()

    def logprobs(self, lps: list[Logprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            text, raw = self.token_text(lp.token_id)
            top = []
            for tid, val in lp.top:
                t, b = self.token_text(tid)
                top.append({"token": t, "logprob": val, "bytes": b})
            content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    async def response(self, stream) -> dict[str, Any]:
        choices = await collect(stream, self.req.n, self.usage)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(c) for c in choices],
            "usage": self.usage.openai(),
        }

    def _choice(self, c: Choice) -> dict[str, Any]:
        parser = self.new_parser()
        parsed = parser.parse_all(c.text)
        calls = parser.tool_calls
        message = {
            "role": "assistant",
            "content": parsed.content if parsed.content.strip() or not calls else None,
            "reasoning_content": parsed.reasoning or None,
        }
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
        return {
            "index": c.index,
            "message": message,
            "logprobs": self.logprobs(c.logprobs) if self.req.logprobs else None,
            "finish_reason": chat_finish_reason(parser, c.finish_reason),
            "stop_reason": c.stop_reason,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.req.wants_usage_chunk:
            out["usage"] = usage
        return out

    async def stream(self, stream) -> AsyncIterator[str]:
        parsers: dict[int, OutputParser] = {}  # per choice, created when it starts
        async with stream:
            async for d in stream:
                raise_on_error(d)
                self.usage.add(d)
                if d.index not in parsers:
                    parsers[d.index] = self.new_parser()
                    yield sse(self.chunk([self._delta_choice(d.index, {"role": "assistant", "content": ""})]))
                for chunk in self._delta_chunks(parsers[d.index], d):
                    yield sse(chunk)
        if len(parsers) < self.req.n:
            raise EngineFailed("the engine stopped before the request finished")
        if self.req.wants_usage_chunk:
            yield sse(self.chunk([], self.usage.openai()))
        yield sse("[DONE]")

    def _delta_chunks(self, parser: OutputParser, d: Delta) -> list[dict[str, Any]]:
        """One engine delta of one choice as chunks: its parsed text (and logprobs), then its finish."""
        parsed = parser.feed(d.text)
        if d.finish_reason is not None:
            parsed += parser.finish()
        chunks = []
        if parsed or d.logprobs and self.req.logprobs:
            chunks.append(self.chunk([self._delta_choice(d.index, wire_delta(parsed), d)]))
        if d.finish_reason is not None:
            finish = chat_finish_reason(parser, d.finish_reason)
            chunks.append(self.chunk([self._delta_choice(d.index, {}, None, finish)]))
        return chunks

    def _delta_choice(self, index: int, delta: dict, d: Delta | None = None, finish: str | None = None) -> dict:
        lp = self.logprobs(d.logprobs) if d is not None and d.logprobs and self.req.logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}


def wire_delta(parsed: ParsedDelta) -> dict[str, Any]:
    """A chunk's ``delta``: only the channels this engine delta added to."""
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content or not parsed:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = [tool_call_delta_json(t) for t in parsed.tool_calls]
    return delta


def tool_call_delta_json(t: ToolCallDelta) -> dict[str, Any]:
    """The first delta of a call carries id, type and name; later ones argument fragments."""
    out: dict[str, Any] = {"index": t.index}
    if t.id is not None:
        out["id"], out["type"] = t.id, "function"
    out["function"] = {"name": t.name, "arguments": t.arguments} if t.name is not None else {"arguments": t.arguments}
    return out


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_finish_reason(parser: OutputParser, reason: str | None) -> str | None:
    """``tool_calls`` when the output stopped after making calls."""
    if reason == "stop" and parser.tool_calls:
        return "tool_calls"
    return openai_finish_reason(reason)


def openai_error_event(err: APIError) -> str:
    return sse(err.openai())


def openai_finish_reason(reason: str | None) -> str | None:
    if reason in (None, "stop", "length"):
        return reason
    raise APIError(500, f"unexpected finish reason {reason!r}")
