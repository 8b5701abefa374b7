"""Engine deltas -> Responses stream events and the final Response object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from atom_anyio.api.errors import APIError
from atom_anyio.api.generation import GenerationStream
from atom_anyio.api.http import new_id, now
from atom_anyio.api.response_store import ResponseStore, StoredResponse
from atom_anyio.api.responses_schemas import InputItem, ResponsesRequest
from atom_anyio.api.responses_tools import ToolSet
from atom_anyio.api.runtime import Runtime
from atom_anyio.api.sealed import Sealer
from atom_anyio.api.usage import Usage
from atom_anyio.engine.stream import RequestStream
from atom_anyio.parse import OutputParser, ParsedDelta, ToolCallDelta
from atom_anyio.prompt.prepare import PreparedPrompt, PromptRequest

Event = dict[str, Any]


@dataclass(frozen=True)
class ResponseTurn:
    """One Responses request, parsed: what its prompt and its Response are built from."""

    req: ResponsesRequest
    tools: ToolSet
    conversation: list[InputItem]  # the previous turns' items, then this input's
    prompt: PromptRequest
    stores: tuple[ResponseStore, ...]  # where the finished response is kept: none when store is false
    sealer: Sealer  # seals reasoning and compaction items
    frame: Callable[[Event], str]  # one event on the wire (an SSE frame, a WebSocket message)


class ResponseEncoder:
    """Output items are opened as the parser's channels change (reasoning, message text, tool
    calls) and closed when the next one opens or the output ends; both the streamed and the
    plain response come from these same events."""

    def __init__(self, rt: Runtime, turn: ResponseTurn, prepared: PreparedPrompt):
        self.turn = turn
        self.params = prepared.request.params  # what runs, and what the Response echoes
        self.id = new_id("resp_")
        self.created_at = now()
        self.completed_at: int | None = None
        self.model = rt.model_name
        self.parser = OutputParser(rt.parser_spec, prepared.opens_reasoning, parse_tools=turn.prompt.tools is not None)
        self.usage = Usage()
        self.num_reasoning_tokens = 0
        self.status = "in_progress"
        self.output: list[Event] = []  # the response's items: every streamed one but malformed calls
        self.output_index: dict[str, int] = {}  # item id -> its streamed output_index
        self.open: Event | None = None  # the item being streamed, the last of ``output``
        self.calls: dict[int, Event] = {}  # parser tool-call index -> its call item
        self.custom_arguments: dict[str, str] = {}  # custom call item id -> the arguments JSON written so far
        self.held = ""  # whitespace-only text outside a message: it opens no item unless text follows
        self.sequence_number = 0

    # the Response object

    def _response(self) -> Event:
        req = self.turn.req
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
            "max_tool_calls": req.max_tool_calls,
            "model": self.model,
            "output": self.output if finished else [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(req.reasoning.model_dump() if req.reasoning else {})},
            "store": req.store,
            "background": False,
            "service_tier": "default",  # one tier here, whatever was asked
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "presence_penalty": self.params.presence_penalty,
            "frequency_penalty": self.params.frequency_penalty,
            "top_logprobs": req.top_logprobs,
            "text": req.text.model_dump(exclude_none=True),
            "tool_choice": req.tool_choice,
            "tools": self.turn.tools.echo,
            "truncation": req.truncation,
            "usage": self._usage() if finished else None,
            "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "metadata": req.metadata or {},
        }

    def _usage(self) -> Event:
        u = self.usage
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }

    # the event stream

    async def response(self, stream: RequestStream) -> Event:
        """The plain (non-streaming) response: the same events, unsent."""
        async with aclosing(self._events(stream)) as events:
            async for _ in events:
                pass
        return self._response()

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        async with aclosing(self._events(stream)) as events:
            async for event in events:
                yield self.turn.frame(event)

    async def _events(self, stream: RequestStream) -> AsyncIterator[Event]:
        yield self._event("response.created", response=self._response())
        yield self._event("response.in_progress", response=self._response())
        finish = None
        async with GenerationStream(stream, self.usage, 1) as deltas:
            async for d in deltas:
                for event in self.text_events(d.text):
                    yield event
                if self.open is not None and self.open["type"] == "reasoning":
                    self.num_reasoning_tokens += len(d.token_ids)
                finish = d.finish_reason
        for event in self.finish_events(is_cut=finish == "length"):
            yield event
        self.status = "incomplete" if finish == "length" else "completed"
        for event in self._end_output():
            yield event
        self.completed_at = now()
        response = self._response()
        for store in self.turn.stores:
            store.put(self.id, StoredResponse(self.turn.conversation, response))
        yield self._event(f"response.{self.status}", response=response)

    def _end_output(self) -> Iterator[Event]:
        if not self.output_index:  # nothing visible came out: still one (empty) message
            yield from self._open(_new_item("message"))
        yield from self._close()

    def error_event(self, err: APIError) -> str:
        """The ``error`` event, then ``response.failed``, for an engine failure mid-stream."""
        self.status = "failed"
        failed = {**self._response(), "error": {"code": "server_error", "message": err.message}}
        error = self._event("error", code=err.code, message=err.message, param=err.param, error=err.openai()["error"])
        return self.turn.frame(error) + self.turn.frame(self._event("response.failed", response=failed))

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def text_events(self, text: str) -> Iterator[Event]:
        """The events of one engine text delta, in the text's order (the parser's pieces)."""
        for pd in self.parser.feed_pieces(text):
            yield from self._parsed(pd)

    def finish_events(self, *, is_cut: bool) -> Iterator[Event]:
        """The events of the output's end: what the parser held back, in order."""
        for pd in self.parser.finish_pieces(is_cut=is_cut):
            yield from self._parsed(pd)

    def _parsed(self, pd: ParsedDelta) -> Iterator[Event]:
        if pd.reasoning:
            yield from self._text("reasoning", pd.reasoning)
        if pd.content:
            yield from self._content(pd.content)
        for call in pd.tool_calls:
            yield from self._tool_call(call)

    def _content(self, text: str) -> Iterator[Event]:
        if (self.open is None or self.open["type"] != "message") and not (self.held + text).strip():
            self.held += text
            return
        text, self.held = self.held + text, ""
        yield from self._text("message", text)

    def _text(self, kind: str, text: str) -> Iterator[Event]:
        if self.open is None or self.open["type"] != kind:
            yield from self._open(_new_item(kind))
        item = self.open
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        yield self._event(delta, **self._where(item), content_index=0, delta=text, **extra)

    def _tool_call(self, call: ToolCallDelta) -> Iterator[Event]:
        if call.index not in self.calls:
            item = self._call_item(call.name or "", call.id or new_id("call_"))
            self.calls[call.index] = item
            yield from self._open(item)
        item = self.calls[call.index]
        assert item is self.open, "a tool call's arguments arrive before the next output item starts"
        if not call.arguments:
            return
        if item["type"] == "custom_tool_call":  # its input is known when its arguments close
            self.custom_arguments[item["id"]] = self.custom_arguments.get(item["id"], "") + call.arguments
            return
        item["arguments"] += call.arguments
        yield self._event("response.function_call_arguments.delta", **self._where(item), delta=call.arguments)

    def _call_item(self, offered_name: str, call_id: str) -> Event:
        """A call of ``offered_name``, as the client named the tool (its namespace apart)."""
        tool = self.turn.tools.called(offered_name)
        name, ns = (tool.name, tool.namespace) if tool else (offered_name, None)
        fields = {"call_id": call_id, "name": name, **({"namespace": ns} if ns else {})}
        if tool is not None and tool.is_custom:
            return {"id": new_id("ctc_"), "type": "custom_tool_call", "status": "in_progress", **fields, "input": ""}
        return {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", **fields, "arguments": ""}

    def _open(self, item: Event) -> Iterator[Event]:
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

    def _close(self) -> Iterator[Event]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        where = self._where(item)
        if item["type"] in ("function_call", "custom_tool_call"):
            yield from self._close_call(item)
        else:
            part = item["content"][0]
            if item["type"] == "message":
                yield self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                yield self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
                if self.turn.req.seals_reasoning:
                    item["encrypted_content"] = self.turn.sealer.seal("reasoning", {"text": part["text"]})
            yield self._event("response.content_part.done", **where, content_index=0, part=part)
        yield self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def _close_call(self, item: Event) -> Iterator[Event]:
        where = self._where(item)
        if not any(call.id == item["call_id"] for call in self.parser.tool_calls):
            item["status"] = "incomplete"  # announced, then it broke: its text follows as content
            assert self.output[-1] is item
            self.output.pop()
        if item["type"] == "function_call":
            done = {"arguments": item["arguments"], "name": item["name"]}
            yield self._event("response.function_call_arguments.done", **where, **done)
            return
        item["input"] = _custom_input(self.custom_arguments.get(item["id"], ""))
        yield self._event("response.custom_tool_call_input.delta", **where, delta=item["input"])
        yield self._event("response.custom_tool_call_input.done", **where, input=item["input"])

    def _where(self, item: Event) -> Event:
        return {"item_id": item["id"], "output_index": self.output_index[item["id"]]}


def _custom_input(arguments: str) -> str:
    """A freeform tool's input: the one string argument it was offered with (else the text as written)."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed["input"] if isinstance(parsed, dict) and isinstance(parsed.get("input"), str) else arguments


def _new_item(kind: str) -> Event:
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return {
            "id": new_id("msg_"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [part],
        }
    assert kind == "reasoning"
    part = {"type": "reasoning_text", "text": ""}
    return {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": [part]}


class WarmupEncoder(ResponseEncoder):
    """``generate: false``: the prompt is prefilled (its blocks cached for the turn that follows) and
    the response, with no output, completes; it can be continued like any other."""

    def _parsed(self, pd: ParsedDelta) -> Iterator[Event]:
        yield from ()

    def _end_output(self) -> Iterator[Event]:
        self.status = "completed"
        yield from ()
