"""POST /v1/messages and /v1/messages/count_tokens (the Anthropic Messages API)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pydantic_core
import structlog
from quart import Blueprint

from atom_anyio.api.anthropic_schemas import MessagesInput, MessagesRequest
from atom_anyio.api.errors import APIError
from atom_anyio.api.generation import GenerationStream
from atom_anyio.api.http import kv_lease, new_id, parse_body, sse
from atom_anyio.api.runtime import Runtime
from atom_anyio.api.usage import Usage
from atom_anyio.engine.stream import ChoiceDelta, RequestStream
from atom_anyio.parse import OutputParser, ParsedDelta, ToolCall, ToolCallDelta
from atom_anyio.prompt.prepare import PreparedPrompt, tokenize_prompt

Event = dict[str, Any]
log = structlog.get_logger("atom_anyio.api")


def messages_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("anthropic", __name__)

    @bp.post("/v1/messages")
    async def messages() -> Any:
        req = await parse_body(MessagesRequest)
        rt.check_model(req.model)
        _log_unapplied(req.unapplied)
        keeps_special = rt.parser_spec.decodes_special_tokens(parse_tools=req.parses_tools)
        params = req.sampling_params(keeps_special, defaults=rt.loaded.generation_defaults)

        def encoder_for(prepared: list[PreparedPrompt]) -> MessageEncoder:
            [p] = prepared
            return MessageEncoder(rt, req, p)

        # the conversation: Claude Code's session (its header, or metadata.user_id, which names it); cache_control's ttl
        lease = kv_lease(req.metadata and req.metadata.user_id, req.cache_ttl_s)
        prompt = req.prompt_request(params, req.structured(rt.parser_spec), lease)
        return await rt.generate([prompt], is_stream=req.stream, encoder_for=encoder_for)

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens() -> Any:
        req = await parse_body(MessagesInput)
        rt.check_model(req.model)
        _log_unapplied(req.unapplied)
        return {"input_tokens": await rt.run_in_prepare_thread(_count_tokens, rt, req)}

    return bp


@functools.lru_cache(maxsize=64)
def _log_unapplied(features: tuple[str, ...]) -> None:
    """One line per distinct set: Claude Code sends the same ones on every request."""
    if features:
        log.warning("anthropic.not_applied", features=list(features))


def _count_tokens(rt: Runtime, req: MessagesInput) -> int:
    """The same render and segment-cache path a message request's prompt takes."""
    return len(tokenize_prompt(req.prompt_request(), rt.prepare_ctx))


class MessageEncoder:
    """Engine deltas -> one Anthropic message, whole or as its stream events."""

    def __init__(self, rt: Runtime, req: MessagesRequest, prepared: PreparedPrompt):
        self.id = new_id("msg_")
        self.model = rt.model_name
        self.usage = Usage()
        parser = OutputParser(rt.parser_spec, prepared.opens_reasoning, parse_tools=req.parses_tools)
        self.blocks = ContentBlocks(parser, shows_thinking=req.shows_thinking)
        self.last: ChoiceDelta | None = None

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        async with GenerationStream(stream, self.usage, 1) as deltas:
            async for d in deltas:
                self._fold(d)
        return self.message(self.blocks.content)

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        async with GenerationStream(stream, self.usage, 1) as deltas:
            async for d in deltas:
                is_first = self.last is None
                events = self._fold(d)
                if is_first:  # the prompt's usage is known once it ran
                    start = self.message([], is_final=False)
                    events = [{"type": "message_start", "message": start}, {"type": "ping"}, *events]
                for event in events:
                    yield sse(event, event=event["type"])
        stop_reason, stop_sequence = self.stop_reason()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield sse({"type": "message_delta", "delta": delta, "usage": self.usage_json()}, event="message_delta")
        yield sse({"type": "message_stop"}, event="message_stop")

    def _fold(self, d: ChoiceDelta) -> list[Event]:
        """One delta into the blocks; the events it makes (the last closes every block)."""
        self.last = d
        events = self.blocks.feed(d.text)
        if d.finish_reason is None:
            return events
        return events + self.blocks.finish(is_cut=d.finish_reason == "length")

    def error_event(self, err: APIError) -> str:
        return sse(err.anthropic(), event="error")

    def stop_reason(self) -> tuple[str | None, str | None]:
        d = self.last
        if d is None or d.finish_reason is None:
            return None, None
        if d.finish_reason == "length":
            return "max_tokens", None
        if self.blocks.has_tool_use:
            return "tool_use", None
        if isinstance(d.stop_reason, str):
            return "stop_sequence", d.stop_reason
        return "end_turn", None

    def usage_json(self) -> dict[str, int]:
        """Anthropic counts prompt tokens read from the (prefix) cache apart from ``input_tokens``."""
        u = self.usage
        return {
            "input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens,
        }

    def message(self, content: list[dict[str, Any]], *, is_final: bool = True) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop_reason() if is_final else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage_json(),
        }


def _input(call: ToolCall) -> Any:
    """A tool_use block's input; of a call cut short, what its JSON so far holds (as the SDKs
    read a stream's partial JSON)."""
    if not call.is_cut:
        return json.loads(call.arguments)
    try:
        return pydantic_core.from_json(call.arguments or "{}", allow_partial=True)
    except ValueError:
        return {}


class ContentBlocks:
    """Engine text -> parsed output -> content blocks, returning the stream events that build them.

    A block runs until output of another kind arrives. Text blocks hold whitespace back until
    visible text follows it, and one after another block starts at its first visible character:
    the separators around reasoning and tool calls are template markup, not content.
    ``shows_thinking`` false (display "omitted"): thinking blocks stay empty, their signature still
    the digest of what the model thought."""

    def __init__(self, parser: OutputParser, *, shows_thinking: bool = True):
        self.parser = parser
        self.shows_thinking = shows_thinking
        self._thought = hashlib.sha256()  # of the open thinking block
        self.blocks: list[dict[str, Any]] = []
        self._kind: str | None = None  # of the open block (the last one)
        self._call_id: str | None = None  # the parser's id of the open tool call
        self._call_index: int | None = None
        self._held = ""  # trailing whitespace, not yet in a text block
        self._malformed: list[int] = []  # tool_use blocks whose call the parser gave back as text

    @property
    def content(self) -> list[dict[str, Any]]:
        """The message's blocks; a call that proved malformed is left out (its text follows as text)."""
        return [b for i, b in enumerate(self.blocks) if i not in self._malformed]

    @property
    def has_tool_use(self) -> bool:
        return bool(self.parser.tool_calls)

    def feed(self, text: str) -> list[Event]:
        return [e for pd in self.parser.feed_pieces(text) for e in self._add(pd)]  # in the text's order

    def finish(self, *, is_cut: bool) -> list[Event]:
        return [e for pd in self.parser.finish_pieces(is_cut=is_cut) for e in self._add(pd)] + self._close()

    def _add(self, pd: ParsedDelta) -> list[Event]:
        events = self._thinking(pd.reasoning) if pd.reasoning else []
        if pd.content:
            events += self._text(pd.content)
        for call in pd.tool_calls:
            events += self._tool_call(call)
        return events

    def _close(self) -> list[Event]:
        """Close the open block: a thinking block gets its signature, a tool_use block its input."""
        if self._kind is None:
            return []
        block, events = self.blocks[-1], []
        if self._kind == "thinking":
            block["signature"] = self._thought.hexdigest()
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self._kind == "tool_use":
            call = next((c for c in self.parser.tool_calls if c.id == self._call_id), None)
            if call is None:
                self._malformed.append(len(self.blocks) - 1)
            else:
                block["input"] = _input(call)
        self._kind = None
        return [*events, {"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events, self._held = self._close(), ""
        self.blocks.append(block)
        self._kind = block["type"]
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [*events, {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _thinking(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._kind != "thinking":
            events = self._open({"type": "thinking", "thinking": "", "signature": ""})
            self._thought = hashlib.sha256()
        self._thought.update(text.encode())
        if not self.shows_thinking:
            return events
        self.blocks[-1]["thinking"] += text
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str) -> list[Event]:
        text, self._held = self._held + text, ""
        visible = text.rstrip()
        if not visible:
            self._held = text
            return []
        events: list[Event] = []
        if self._kind != "text":
            events = self._open({"type": "text", "text": ""})
            visible = visible.lstrip() if len(self.blocks) > 1 else visible
        self._held = text[len(text.rstrip()) :]
        self.blocks[-1]["text"] += visible
        return [*events, self._delta({"type": "text_delta", "text": visible})]

    def _tool_call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if self._kind != "tool_use" or call.index != self._call_index:
            assert call.id is not None and call.name is not None, "a call's first delta names it"
            tool_id = "toolu_" + call.id.removeprefix("call_")
            events = self._open({"type": "tool_use", "id": tool_id, "name": call.name, "input": {}})
            self._call_id, self._call_index = call.id, call.index
        if call.arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events
