"""The OpenAI Responses API: ``POST /v1/responses`` (SSE or JSON, and over a WebSocket),
``POST /v1/responses/compact``, ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quart import Blueprint

from atom_anyio.api.compaction import MAX_SUMMARY_TOKENS, CompactionEncoder, compact_resource, summary_messages
from atom_anyio.api.errors import APIError
from atom_anyio.api.http import kv_lease, parse_body, sse
from atom_anyio.api.response_store import ResponseStore
from atom_anyio.api.responses_encoder import Event, ResponseEncoder, ResponseTurn, WarmupEncoder
from atom_anyio.api.responses_schemas import (
    COMPACTION_TRIGGER,
    CompactRequest,
    InputItem,
    ResponsesRequest,
    check_call_outputs,
    parse_items,
    to_messages,
)
from atom_anyio.api.responses_tools import ToolSet, forced_tool, parse_tools
from atom_anyio.api.responses_ws import serve_websocket
from atom_anyio.api.runtime import Runtime
from atom_anyio.api.sealed import Sealer
from atom_anyio.api.structured import forced_tools, only_one, response_format
from atom_anyio.generation_defaults import with_defaults
from atom_anyio.prompt.prepare import PreparedPrompt, PromptRequest
from atom_anyio.sampling_params import SamplingParams


def responses_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("openai_responses", __name__)
    api = Responses(rt, rt.responses_store, Sealer.of(rt.config.responses_seal_key))

    @bp.post("/v1/responses", endpoint="responses")
    async def create() -> Any:
        req = await parse_body(ResponsesRequest)
        return await api.respond(api.turn(req, frame=sse_frame))

    @bp.websocket("/v1/responses", endpoint="responses_websocket")
    async def create_over_websocket() -> None:
        await serve_websocket(api)

    @bp.post("/v1/responses/compact", endpoint="compact_response")
    async def compact() -> Any:
        body = await parse_body(CompactRequest)
        raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input or []
        req = ResponsesRequest(
            model=body.model,
            input=[*raw, {"type": COMPACTION_TRIGGER}],
            instructions=body.instructions,
            previous_response_id=body.previous_response_id,
            prompt_cache_key=body.prompt_cache_key,
            store=False,
        )
        turn = api.turn(req, frame=sse_frame)
        return compact_resource(await api.respond(turn), turn.conversation)

    @bp.get("/v1/responses/<response_id>", endpoint="get_response")
    async def retrieve(response_id: str) -> Any:
        entry = api.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry.response

    @bp.delete("/v1/responses/<response_id>", endpoint="delete_response")
    async def delete(response_id: str) -> Any:
        if not api.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return bp


def sse_frame(event: Event) -> str:
    return sse(event, event=event["type"])


class Responses:
    """What every Responses route shares: the store, the sealing key (``responses_seal_key``, else
    one per process: then sealed items do not survive a restart), and the path from a parsed
    request to its response."""

    def __init__(self, rt: Runtime, store: ResponseStore, sealer: Sealer):
        self.rt = rt
        self.store = store
        self.sealer = sealer

    def turn(
        self, req: ResponsesRequest, *, frame: Callable[[Event], str], cache: ResponseStore | None = None
    ) -> ResponseTurn:
        """The request checked and its prompt built; ``cache``: a WebSocket's own responses, looked
        up before the store and kept whatever ``store`` says."""
        self.rt.check_model(req.model)
        tools = parse_tools(req.tools)
        forced = forced_tool(req.tool_choice, tools)
        history = self.history(req.previous_response_id, cache)
        items = req.input_items(self.sealer)
        check_call_outputs(history, items)
        conversation = history + items
        if req.is_compaction:
            prompt = self._summary_prompt(req, conversation)
        else:
            prompt = self._prompt(req, tools, forced, conversation)
        stores = ((cache,) if cache is not None else ()) + ((self.store,) if req.store else ())
        return ResponseTurn(req, tools, conversation, prompt, stores, self.sealer, frame)

    def _prompt(
        self, req: ResponsesRequest, tools: ToolSet, forced: str | None, conversation: list[InputItem]
    ) -> PromptRequest:
        is_parsing_tools = bool(tools.offered) and req.tool_choice != "none"
        chat_tools = tools.chat()
        calls = forced_tools(self.rt.parser_spec, chat_tools, forced, parallel=req.parallel_tool_calls)
        return PromptRequest(
            messages=to_messages(conversation, req.instructions),
            tools=chat_tools if is_parsing_tools else None,
            chat_template_kwargs=req.chat_template_kwargs,
            params=self._params(req, req.max_output_tokens if req.generate else 1, is_parsing_tools),
            truncation=req.truncation,
            structured=only_one(response_format(req.text.format, "text.format"), calls),
            lease=kv_lease(req.prompt_cache_key),  # Codex sends its session id as both
            cache_salt=req.cache_salt,
            priority=req.priority,
        )

    def _summary_prompt(self, req: ResponsesRequest, conversation: list[InputItem]) -> PromptRequest:
        return PromptRequest(
            messages=summary_messages(to_messages(conversation, req.instructions)),
            chat_template_kwargs={"enable_thinking": False},
            params=self._params(req, min(req.max_output_tokens or MAX_SUMMARY_TOKENS, MAX_SUMMARY_TOKENS), False),
            truncation="auto",  # the oldest turns go until the summary request fits
        )

    def _params(self, req: ResponsesRequest, max_tokens: int | None, is_parsing_tools: bool) -> SamplingParams:
        return SamplingParams(
            **with_defaults(self.rt.loaded.generation_defaults, temperature=req.temperature, top_p=req.top_p),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            max_tokens=max_tokens,
            seed=req.seed,
            skip_special_tokens=not self.rt.parser_spec.decodes_special_tokens(parse_tools=is_parsing_tools),
        )

    async def respond(self, turn: ResponseTurn) -> Any:
        """Generate: the streamed events (framed by the turn) or the whole Response."""
        req = turn.req
        encoder = CompactionEncoder if req.is_compaction else ResponseEncoder if req.generate else WarmupEncoder

        def encoder_for(prepared: list[PreparedPrompt]) -> ResponseEncoder:
            [p] = prepared
            return encoder(self.rt, turn, p)

        try:
            return await self.rt.generate([turn.prompt], is_stream=req.stream, encoder_for=encoder_for)
        except APIError as exc:
            if exc.param == "messages":  # the prompt is built from the input items
                exc.param = "input"
            raise

    def history(self, previous_response_id: str | None, cache: ResponseStore | None = None) -> list[InputItem]:
        """The previous response's conversation and output items, oldest first."""
        if previous_response_id is None:
            return []
        cached = cache.get(previous_response_id) if cache is not None else None
        entry = cached or self.store.get(previous_response_id)
        if entry is None:
            raise not_found(previous_response_id, param="previous_response_id")
        return entry.input_items + parse_items(entry.response["output"], "output", self.sealer)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"{'Previous response' if param else 'Response'} with id '{response_id}' not found: it was never stored "
        "(store: false), was deleted, or was evicted from the bounded response store.",
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )
