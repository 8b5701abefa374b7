"""POST /v1/chat/completions."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint

from atom_anyio.api.errors import APIError
from atom_anyio.api.generation import GenerationStream, TokenText
from atom_anyio.api.http import kv_lease, new_id, now, parse_body, sse
from atom_anyio.api.openai_schemas import ChatCompletionRequest
from atom_anyio.api.runtime import Runtime
from atom_anyio.api.usage import Usage
from atom_anyio.engine.stream import ChoiceDelta, Logprob, RequestStream, collect
from atom_anyio.parse import OutputParser, ParsedDelta, ToolCall, ToolCallDelta
from atom_anyio.prompt.prepare import PreparedPrompt, PromptRequest


def chat_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("openai_chat", __name__)

    @bp.post("/v1/chat/completions", endpoint="chat")
    async def chat_completions() -> Any:
        req = await parse_body(ChatCompletionRequest)
        rt.check_model(req.model)
        parse_tools = bool(req.tools) and req.tool_choice != "none"  # "none": no tools in the prompt or the output
        params = req.sampling_params(
            req.max_completion_tokens or req.max_tokens,
            (req.top_logprobs or 0) if req.logprobs else None,
            defaults=rt.loaded.generation_defaults,
            keep_special_tokens=rt.parser_spec.decodes_special_tokens(parse_tools=parse_tools),
        )
        prompt = PromptRequest(
            messages=req.flat_messages(),
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if parse_tools else None,
            chat_template_kwargs=req.template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            params=params,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured=req.structured(rt.parser_spec),
            lease=kv_lease(req.prompt_cache_key),
            cache_salt=req.cache_salt,
            priority=req.priority,
        )

        def encoder_for(prepared: list[PreparedPrompt]) -> ChatEncoder:
            [p] = prepared
            return ChatEncoder(rt, req, p.opens_reasoning, parse_tools=parse_tools)

        return await rt.generate([prompt], is_stream=req.stream, encoder_for=encoder_for)

    return bp


class OpenAIEncoder:
    """What the chat and completions encoders share: the id, the object envelope, usage, errors."""

    id_prefix = ""
    object_name = ""  # of the whole response
    chunk_object_name = ""

    def __init__(self, rt: Runtime, req: ChatCompletionRequest | Any):
        self.req = req
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.model = rt.model_name
        self.token_text = TokenText(rt.loaded.tokenizer)
        self.usage = Usage()

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response around its choices."""
        out = self._object(self.object_name, choices)
        out["usage"] = self.usage.openai()
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out = self._object(self.chunk_object_name, choices)
        if self.req.wants_usage_on_every_chunk:
            out["usage"] = usage or self.usage.openai()  # the deltas so far are folded in
        elif self.req.wants_usage_chunk:
            out["usage"] = usage
        return out

    def usage_chunk_and_done(self) -> list[str]:
        """A stream's last events: the usage chunk (when asked for) and [DONE]."""
        usage = [sse(self.chunk([], self.usage.openai()))] if self.req.wants_usage_chunk else []
        return [*usage, sse("[DONE]")]

    def error_event(self, err: APIError) -> str:
        return openai_error_event(err)

    def vllm_prompt_logprobs(self, lps: list[Logprob | None]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its own logprob, rank and
        text, and the top alternatives', keyed by token id."""
        out: list[dict[str, Any] | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): self._vllm_logprob(lp.token_id, lp.logprob, lp.rank)}
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), self._vllm_logprob(tid, value, rank))
            out.append(entry)
        return out

    def _vllm_logprob(self, token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": value, "rank": rank, "decoded_token": self.token_text(token_id)[0]}

    def _object(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices}


class ChatEncoder(OpenAIEncoder):
    """Engine deltas -> chat.completion / chat.completion.chunk objects."""

    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, rt: Runtime, req: ChatCompletionRequest, opens_reasoning: bool, *, parse_tools: bool):
        super().__init__(rt, req)
        self.new_parser = functools.partial(OutputParser, rt.parser_spec, opens_reasoning, parse_tools=parse_tools)

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

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        choices = await collect(GenerationStream(stream, self.usage, self.req.n), self.req.n)
        out = self.envelope([self._choice(c) for c in choices])
        if self.req.prompt_logprobs is not None:  # one prompt: its logprobs once, as vLLM
            out["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0].prompt_logprobs or [])
        return out

    def _choice(self, c: ChoiceDelta) -> dict[str, Any]:
        parser = self.new_parser()
        parsed = parser.parse_all(c.text, is_cut=c.finish_reason == "length")
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
            "logprobs": self.logprobs(c.logprobs or []) if self.req.logprobs else None,
            "finish_reason": chat_finish_reason(parser, c.finish_reason),
            "stop_reason": c.stop_reason,
        }

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        parsers: dict[int, OutputParser] = {}  # per choice, created when it starts
        async with GenerationStream(stream, self.usage, self.req.n) as deltas:
            async for d in deltas:
                if d.index not in parsers:
                    parsers[d.index] = self.new_parser()
                    yield sse(self.chunk([self._delta_choice(d.index, {"role": "assistant", "content": ""})]))
                for chunk in self._delta_chunks(parsers[d.index], d):
                    yield sse(chunk)
        for event in self.usage_chunk_and_done():
            yield event

    def _delta_chunks(self, parser: OutputParser, d: ChoiceDelta) -> list[dict[str, Any]]:
        """One engine delta of one choice as chunks: its parsed text (and logprobs), then its finish."""
        parsed = parser.feed(d.text)
        if d.finish_reason is not None:
            parsed += parser.finish(is_cut=d.finish_reason == "length")
        chunks = []
        if parsed or d.logprobs and self.req.logprobs:
            chunks.append(self.chunk([self._delta_choice(d.index, wire_delta(parsed), d)]))
        if d.finish_reason is not None:
            finish = chat_finish_reason(parser, d.finish_reason)
            chunks.append(self.chunk([self._delta_choice(d.index, {}, None, finish)]))
        return chunks

    def _delta_choice(self, index: int, delta: dict, d: ChoiceDelta | None = None, finish: str | None = None) -> dict:
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
