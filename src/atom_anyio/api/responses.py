"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from quart import Blueprint

from atom_anyio.api.errors import APIError
from atom_anyio.api.generation import Deltas
from atom_anyio.api.http import new_id, now, parse_body, sse
from atom_anyio.api.response_store import ResponseStore, StoredResponse
from atom_anyio.api.responses_schemas import FunctionTool, InputItem, ResponsesRequest, parse_items, to_messages
from atom_anyio.api.runtime import Runtime
from atom_anyio.api.usage import Usage
from atom_anyio.engine.stream import DeltaStream
from atom_anyio.models.generation_defaults import with_defaults
from atom_anyio.parse import OutputParser, ParsedDelta, ToolCallDelta
from atom_anyio.prompt.prepare import PreparedPrompt, PromptRequest
from atom_anyio.sampling_params import SamplingParams


def responses_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("openai_responses", __name__)
    store = rt.responses_store

    @bp.post("/v1/responses", endpoint="responses")
    async def create() -> Any:
        req = await parse_body(ResponsesRequest)
        rt.check_model(req.model)
        tools = req.function_tools()
        input_items = _history(store, req.previous_response_id) + req.input_items()
        prompt = PromptRequest(
            messages=to_messages(input_items, req.instructions),
            tools=[t.chat() for t in tools] if req.parses_tools else None,
            chat_template_kwargs=req.chat_template_kwargs,
            params=_sampling_params(rt, req),
            truncation=req.truncation,
            structured=req.structured(rt.parser_spec, tools),
        )

        def encoder_for(prepared: list[PreparedPrompt]) -> ResponseEncoder:
            [p] = prepared
            return ResponseEncoder(rt, req, tools, p, store, input_items)

        try:
            return await rt.generate([prompt], is_stream=req.stream, encoder_for=encoder_for)
        except APIError as exc:
            if exc.param == "messages":  # the prompt is built from the input items
                exc.param = "input"
            raise

    @bp.get("/v1/responses/<response_id>", endpoint="get_response")
    async def retrieve(response_id: str) -> Any:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @bp.delete("/v1/responses/<response_id>", endpoint="delete_response")
    async def delete(response_id: str) -> Any:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return bp


def _history(store: ResponseStore, previous_response_id: str | None) -> list[InputItem]:
    """The previous response's input items and output items, oldest first."""
    if previous_response_id is None:
        return []
    entry = store.get(previous_response_id)
    if entry is None:
        raise _not_found(previous_response_id, param="previous_response_id")
    return entry.input_items + parse_items(entry.response["output"], "output")


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found: it was never stored (store: false), "
        "was deleted, or was evicted from the bounded response store.",
        param=param,
        code="response_not_found",
    )


def _sampling_params(rt: Runtime, req: ResponsesRequest) -> SamplingParams:
    return SamplingParams(
        **with_defaults(rt.loaded.generation_defaults, temperature=req.temperature, top_p=req.top_p),
        max_tokens=req.max_output_tokens,  # None: the rest of the context
        seed=req.seed,
        skip_special_tokens=not rt.parser_spec.decodes_special_tokens(parse_tools=req.parses_tools),
    )


class ResponseEncoder:
    """Engine deltas -> Response stream events and the final Response object.

    Output items are opened as the parser's channels change (reasoning, message text,
    function calls) and closed when the next one opens or the output ends; both the
    streamed and the plain response come from these same events."""

    def __init__(
        self,
        rt: Runtime,
        req: ResponsesRequest,
        tools: list[FunctionTool],
        prepared: PreparedPrompt,
        store: ResponseStore,
        input_items: list[InputItem],
    ):
        self.req = req
        self.params = prepared.request.params  # what runs, and what the Response echoes
        self.tools = [t.model_dump(exclude_none=True) for t in tools]
        self.store = store
        self.input_items = input_items
        self.id = new_id("resp_")
        self.created_at = now()
        self.model = rt.model_name
        self.parser = OutputParser(rt.parser_spec, prepared.opens_reasoning, parse_tools=req.parses_tools)
        self.usage = Usage()
        self.num_reasoning_tokens = 0
        self.status = "in_progress"
        self.output: list[dict[str, Any]] = []  # the response's items: every streamed one but malformed calls
        self.output_index: dict[str, int] = {}  # item id -> its streamed output_index
        self.open: dict[str, Any] | None = None  # the item being streamed, the last of ``output``
        self.calls: dict[int, dict[str, Any]] = {}  # parser tool-call index -> its function_call item
        self.held = ""  # whitespace-only text outside a message: it opens no item unless text follows
        self.sequence_number = 0
        self.completed_at: float | None = None

    # the Response object

    def _response(self) -> dict[str, Any]:
        req = self.req
        finished = self.status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": self.output if finished else [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(req.reasoning.model_dump() if req.reasoning else {})},
            "store": req.store,
            "temperature": self.params.temperature,
            "text": req.text.model_dump(exclude_none=True),
            "tool_choice": req.tool_choice,
            "tools": self.tools,
            "top_p": self.params.top_p,
            "truncation": req.truncation,
            "usage": self._usage() if finished else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _usage(self) -> dict[str, Any]:
        u = self.usage
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }

    # the event stream

    async def response(self, stream: DeltaStream) -> dict[str, Any]:
        """The plain (non-streaming) response: the same events, unsent."""
        async with aclosing(self._events(stream)) as events:
            async for _ in events:
                pass
        return self._response()

    async def events(self, stream: DeltaStream) -> AsyncIterator[str]:
        async with aclosing(self._events(stream)) as events:
            async for event in events:
                yield sse(event, event=event["type"])

    async def _events(self, stream: DeltaStream) -> AsyncIterator[dict[str, Any]]:
        yield self._event("response.created", response=self._response())
        yield self._event("response.in_progress", response=self._response())
        finish = None
        async with Deltas(stream, self.usage, 1) as deltas:
            async for d in deltas:
                for event in self._parsed(self.parser.feed(d.text)):
                    yield event
                if self.open is not None and self.open["type"] == "reasoning":
                    self.num_reasoning_tokens += len(d.token_ids)
                finish = d.finish_reason
        for event in self._parsed(self.parser.finish(is_cut=finish == "length")):
            yield event
        if not self.output_index:  # nothing visible came out: still one (empty) message
            for event in self._open(_new_item("message")):
                yield event
        self.status = "incomplete" if finish == "length" else "completed"
        for event in self._close():
            yield event
        self.completed_at = time.time()
        response = self._response()
        if self.req.store:
            self.store.put(self.id, StoredResponse(self.input_items, response))
        yield self._event(f"response.{self.status}", response=response)

    def error_event(self, err: APIError) -> str:
        """The ``error`` event, then ``response.failed``, for an engine failure mid-stream."""
        self.status = "failed"
        failed = {**self._response(), "error": {"code": "server_error", "message": err.message}}
        error = self._event("error", code=err.code, message=err.message, param=err.param)
        return sse(error, event="error") + sse(self._event("response.failed", response=failed), "response.failed")

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _parsed(self, pd: ParsedDelta) -> Iterator[dict[str, Any]]:
        if pd.reasoning:
            yield from self._text("reasoning", pd.reasoning)
        if pd.content:
            yield from self._content(pd.content)
        for call in pd.tool_calls:
            yield from self._tool_call(call)

    def _content(self, text: str) -> Iterator[dict[str, Any]]:
        if (self.open is None or self.open["type"] != "message") and not (self.held + text).strip():
            self.held += text
            return
        text, self.held = self.held + text, ""
        yield from self._text("message", text)

    def _text(self, kind: str, text: str) -> Iterator[dict[str, Any]]:
        if self.open is None or self.open["type"] != kind:
            yield from self._open(_new_item(kind))
        item = self.open
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        yield self._event(delta, **self._where(item), content_index=0, delta=text, **extra)

    def _tool_call(self, call: ToolCallDelta) -> Iterator[dict[str, Any]]:
        if call.index not in self.calls:
            item = _new_item("function_call", call_id=call.id or new_id("call_"), name=call.name or "")
            self.calls[call.index] = item
            yield from self._open(item)
        item = self.calls[call.index]
        assert item is self.open, "a tool call's arguments arrive before the next output item starts"
        if call.arguments:
            item["arguments"] += call.arguments
            yield self._event("response.function_call_arguments.delta", **self._where(item), delta=call.arguments)

    def _open(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._close()
        self.held = ""
        self.output_index[item["id"]] = len(self.output_index)
        self.output.append(item)
        self.open = item
        parts = item.get("content")
        added = {**item, "content": []} if parts else dict(item)
        yield self._event("response.output_item.added", output_index=self.output_index[item["id"]], item=added)
        if parts:
            yield self._event("response.content_part.added", **self._where(item), content_index=0, part=dict(parts[0]))

    def _close(self) -> Iterator[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        if item["type"] == "function_call" and not self._is_well_formed(item):
            item["status"] = "incomplete"  # announced, then it broke: its text follows as content
            assert self.output[-1] is item
            self.output.pop()
        where = self._where(item)
        if item["type"] == "function_call":
            done = {"arguments": item["arguments"], "name": item["name"]}
            yield self._event("response.function_call_arguments.done", **where, **done)
        else:
            part = item["content"][0]
            if item["type"] == "message":
                yield self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                yield self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            yield self._event("response.content_part.done", **where, content_index=0, part=part)
        yield self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def _is_well_formed(self, call_item: dict[str, Any]) -> bool:
        return any(call.id == call_item["call_id"] for call in self.parser.tool_calls)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output_index[item["id"]]}


def _new_item(kind: str, **fields: Any) -> dict[str, Any]:
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return {
            "id": new_id("msg_"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [part],
        }
    if kind == "reasoning":
        part = {"type": "reasoning_text", "text": ""}
        return {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": [part]}
    return {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "arguments": "", **fields}
