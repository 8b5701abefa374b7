"""The Responses API as Codex uses it: complete (spec-valid) Response objects, namespace, custom
and hosted tools, sealed reasoning, compaction (a ``compaction_trigger`` item and
``POST /v1/responses/compact``) and WebSocket mode, on the tiny model behind real hypercorn with
the official ``openai`` SDK (its ``responses.stream``, ``responses.compact`` and ``responses.connect``).

Output the random tiny model would never write (a summary, reasoning, a tool call) comes from
``ScriptedSampler`` at the model boundary; the prompt each request renders is read through
``hook_prepare`` at the tokenizer boundary. Everything between stays real.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import openresponses_types as spec
import pytest
import websockets
from structlog.testing import capture_logs
from support_fakes import FakeSampler, hook_prepare, scripted
from support_servers import served_over_http

from atom_anyio.api.app import AtomApp
from atom_anyio.api.compaction import SUMMARY_INSTRUCTION
from atom_anyio.api.sealed import Sealer, SealError
from atom_anyio.config import Config
from atom_anyio.templates import template_path

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 2048
QWEN3_TEMPLATE = template_path("qwen3_tools")
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
MCP_TOOLS = {"type": "namespace", "name": "mcp__weather", "description": "Weather MCP server.", "tools": [WEATHER_TOOL]}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" LF body "*** End Patch"'},
}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch"
THOUGHT = "The user asks about Paris, so I look up its weather."
ANSWER = "It is sunny in Paris."
SUMMARY = "The user planned a trip to Zanzibar in May and wants a packing list."
CALL_ARGS = {"city": "Paris"}
NO_THINKING = {"reasoning": {"effort": "none"}}
TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")
SPEC_EVENTS = {  # the streaming events the Open Responses spec defines, by type
    "response.created": spec.ResponseCreatedStreamingEvent,
    "response.in_progress": spec.ResponseInProgressStreamingEvent,
    "response.completed": spec.ResponseCompletedStreamingEvent,
    "response.incomplete": spec.ResponseIncompleteStreamingEvent,
    "response.failed": spec.ResponseFailedStreamingEvent,
    "response.output_item.added": spec.ResponseOutputItemAddedStreamingEvent,
    "response.output_item.done": spec.ResponseOutputItemDoneStreamingEvent,
    "response.content_part.added": spec.ResponseContentPartAddedStreamingEvent,
    "response.content_part.done": spec.ResponseContentPartDoneStreamingEvent,
    "response.output_text.delta": spec.ResponseOutputTextDeltaStreamingEvent,
    "response.output_text.done": spec.ResponseOutputTextDoneStreamingEvent,
    "response.function_call_arguments.delta": spec.ResponseFunctionCallArgumentsDeltaStreamingEvent,
    "response.function_call_arguments.done": spec.ResponseFunctionCallArgumentsDoneStreamingEvent,
    "error": spec.ErrorStreamingEvent,
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served(tiny_model):
    """The tiny model (Qwen3-style template: thinking and tools) behind hypercorn on a free port,
    the official SDK on it, and the prompts the server rendered (the last one last)."""
    config = Config.of(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.05, chat_template=QWEN3_TEMPLATE)
    atom = AtomApp(config, loaded=tiny_model, sampler=FakeSampler())
    prompts: list[str] = []
    async with (
        served_over_http(atom) as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as sdk,
    ):
        hook_prepare(atom, prompts.append)
        yield atom, base_url, sdk, prompts


@pytest.fixture
def atom(served):
    return served[0]


@pytest.fixture
def sdk(served):
    return served[2]


@pytest.fixture
def prompts(served):
    return served[3]


@pytest.fixture
async def http(served):
    async with httpx.AsyncClient(base_url=served[1], timeout=60) as client:
        yield client


async def post(http: httpx.AsyncClient, body: dict[str, Any], status: int = 200, path: str = "/v1/responses") -> Any:
    r = await http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


async def sse_events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        text = (await r.aread()).decode()
    return [json.loads(frame.split("\ndata: ", 1)[1]) for frame in text.split("\n\n") if frame]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def assert_spec_events(events: list[dict[str, Any]]) -> None:
    """Each event the spec defines validates against its schema (``reasoning_text`` events are
    OpenAI's names, which the spec spells ``response.reasoning.*``)."""
    for event in events:
        if event["type"] in SPEC_EVENTS:
            SPEC_EVENTS[event["type"]].model_validate(event)


async def input_tokens(http: httpx.AsyncClient, body: dict[str, Any]) -> int:
    return (await post(http, {**body, "max_output_tokens": 1}))["usage"]["input_tokens"]


# complete Response objects


async def test_response_objects_validate_against_the_open_responses_schema(atom, http):
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "top_logprobs": 2,
        "max_tool_calls": 3,
        "service_tier": "auto",
        "safety_identifier": "user-1",
        "prompt_cache_key": "session-1",
    }
    body = {"input": "Weather in Paris?", "tools": [WEATHER_TOOL], **fields, **NO_THINKING}
    with scripted(atom, f"Let me check. {tool_call_text('get_weather', CALL_ARGS)}"):
        plain = await post(http, body)
        events = await sse_events(http, body)
    spec.ResponseResource.model_validate(plain)
    assert_spec_events(events)
    final = events[-1]["response"]
    for response in (plain, final):
        assert isinstance(response["created_at"], int) and isinstance(response["completed_at"], int)
        assert {k: response[k] for k in fields} == {**fields, "service_tier": "default"}
        assert response["background"] is False and response["tools"] == [{**WEATHER_TOOL, "strict": None}]
        assert [item["type"] for item in response["output"]] == ["message", "function_call"]


# tools: namespaces, custom (freeform) tools, hosted tools


async def test_a_namespaced_tool_is_offered_joined_and_its_call_comes_back_with_the_namespace(atom, sdk, http, prompts):
    model = atom.runtime.model_name
    with scripted(atom, tool_call_text("mcp__weather__get_weather", CALL_ARGS)):
        async with sdk.responses.stream(
            model=model, input="Weather?", tools=[MCP_TOOLS], reasoning={"effort": "none"}
        ) as s:
            final = await s.get_final_response()
    assert "mcp__weather__get_weather" in prompts[-1] and "Weather MCP server." in prompts[-1]
    [call] = final.output
    assert (call.type, call.namespace, call.name) == ("function_call", "mcp__weather", "get_weather")
    assert json.loads(call.arguments) == CALL_ARGS and final.tools[0].type == "namespace"
    # the call goes back with its namespace: the same prompt as the call under its joined name
    back = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    item = call.model_dump(exclude_none=True)
    joined = {**item, "name": "mcp__weather__get_weather"}
    del joined["namespace"]
    as_sent = await input_tokens(http, {"input": [item, back], "tools": [MCP_TOOLS], **NO_THINKING})
    as_joined = await input_tokens(http, {"input": [joined, back], "tools": [MCP_TOOLS], **NO_THINKING})
    assert as_sent == as_joined


async def test_a_custom_tool_is_offered_as_one_string_argument_and_called_with_its_input(atom, sdk, http, prompts):
    model = atom.runtime.model_name
    with scripted(atom, tool_call_text("apply_patch", {"input": PATCH})):
        async with sdk.responses.stream(
            model=model, input="Add a.txt", tools=[APPLY_PATCH], reasoning={"effort": "none"}
        ) as s:
            events = [event async for event in s]
            final = await s.get_final_response()
    assert "Edit files with a patch." in prompts[-1] and "LF body" in prompts[-1]  # the grammar, JSON-escaped
    [call] = final.output
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", PATCH)
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == PATCH and done.item_id == call.id
    # the call and its output go back: the same prompt as a function call with that one argument
    back = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"}
    as_fn = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": "apply_patch",
        "arguments": json.dumps({"input": PATCH}),
    }
    fn_back = {**back, "type": "function_call_output"}
    body = {"tools": [APPLY_PATCH], **NO_THINKING}
    custom = await input_tokens(http, {**body, "input": [call.model_dump(exclude_none=True), back]})
    assert custom == await input_tokens(http, {**body, "input": [as_fn, fn_back]})


async def test_hosted_tools_are_accepted_not_offered_and_named_in_one_log_line(http):
    hosted = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "mcp", "server_label": "docs"}]
    with capture_logs() as logs:
        data = await post(http, {"input": "Hi.", "tools": [*hosted, WEATHER_TOOL], "max_output_tokens": 1})
    assert data["tools"] == [{**WEATHER_TOOL, "strict": None}]
    assert data["usage"]["input_tokens"] == await input_tokens(http, {"input": "Hi.", "tools": [WEATHER_TOOL]})
    [line] = [log for log in logs if log["event"] == "responses.hosted_tools_skipped"]
    assert line["tool_types"] == ["web_search", "local_shell", "mcp"]


# sealed reasoning


def test_a_sealed_value_opens_only_under_its_key_and_its_kind():
    server, restarted = Sealer.random(), Sealer.random()
    sealed = server.seal("compaction", {"text": SUMMARY})
    assert server.open("compaction", sealed) == {"text": SUMMARY} and SUMMARY not in sealed
    for sealer, kind, value in [
        (restarted, "compaction", sealed),
        (server, "reasoning", sealed),
        (server, "compaction", ""),
        (server, "compaction", "not base64 !"),
    ]:
        with pytest.raises(SealError):
            sealer.open(kind, value)


async def test_sealed_reasoning_goes_back_into_the_prompt_and_a_tampered_one_is_refused(atom, http, prompts):
    user = {"role": "user", "content": "Weather in Paris?"}
    body = {"input": [user], "tools": [WEATHER_TOOL], "store": False}
    with scripted(atom, f"{THOUGHT}\n</think>\n\n{tool_call_text('get_weather', CALL_ARGS)}"):
        unsealed = await post(http, body)
        first = await post(http, {**body, "include": ["reasoning.encrypted_content"]})
    assert "encrypted_content" not in unsealed["output"][0]
    reasoning, call = first["output"]
    assert reasoning["content"][0]["text"] == THOUGHT and THOUGHT not in reasoning["encrypted_content"]
    back = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    sealed = {
        "type": "reasoning",
        "id": reasoning["id"],
        "summary": [],
        "encrypted_content": reasoning["encrypted_content"],
    }
    plain = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]}
    tokens = {}
    for name, items in {
        "sealed": [user, sealed, call, back],
        "plain": [user, plain, call, back],
        "none": [user, call, back],
    }.items():
        tokens[name] = await input_tokens(http, {**body, "input": items})
        if name == "sealed":
            assert THOUGHT in prompts[-1]
    assert tokens["sealed"] == tokens["plain"] > tokens["none"]
    content = reasoning["encrypted_content"]
    for tampered in (content[:-2] + ("A" if content[-2] != "A" else "B") + content[-1], "not-sealed", content[:40]):
        error = await post(http, {**body, "input": [user, {**sealed, "encrypted_content": tampered}, call, back]}, 400)
        assert (error["error"]["param"], error["error"]["code"]) == (
            "input.1.encrypted_content",
            "invalid_encrypted_content",
        )


# compaction


async def test_a_compaction_trigger_answers_one_sealed_summary_that_replaces_the_compacted_turns(atom, sdk, prompts):
    """Codex's remote compaction: the conversation plus a trigger, streamed; then the compaction
    item, followed by the new turn, stands for everything before it but the developer message."""
    model = atom.runtime.model_name
    developer = {"role": "developer", "content": "Answer in one line."}
    turns = [
        {"role": "user", "content": "I am going to Zanzibar in May."},
        {"role": "assistant", "content": "Lovely, the dry season starts in June."},
        {"role": "user", "content": "Help me pack."},
    ]
    trigger = [developer, *turns, {"type": "compaction_trigger"}]
    with scripted(atom, SUMMARY):
        async with sdk.responses.stream(
            model=model,
            input=trigger,
            tools=[WEATHER_TOOL, {"type": "web_search"}],
            store=False,
            include=["reasoning.encrypted_content"],
        ) as s:
            events = [event async for event in s]
            compacted = await s.get_final_response()
    summary_prompt = prompts[-1]
    assert "Zanzibar" in summary_prompt and summary_prompt.rstrip().count(SUMMARY_INSTRUCTION) == 1
    assert [item.type for item in compacted.output] == ["compaction"] and compacted.status == "completed"
    assert [e.type for e in events if "output_item" in e.type] == [
        "response.output_item.added",
        "response.output_item.done",
    ]
    assert not [e for e in events if e.type.endswith(".delta")]  # the summary is never sent in the clear
    [item] = compacted.output
    assert item.id.startswith("cmp_") and SUMMARY not in item.encrypted_content
    with scripted(atom, ANSWER):
        answer = await sdk.responses.create(
            model=model,
            input=[developer, turns[0], item.model_dump(exclude_none=True), {"role": "user", "content": "What first?"}],
            store=False,
            reasoning={"effort": "none"},
        )
    prompt = prompts[-1]
    assert answer.output_text == ANSWER
    assert SUMMARY in prompt and "Answer in one line." in prompt and "What first?" in prompt
    assert "I am going to Zanzibar" not in prompt and "dry season" not in prompt


async def test_the_compact_endpoint_answers_the_user_messages_and_one_compaction_item(atom, sdk, http, prompts):
    model = atom.runtime.model_name
    conversation = [
        {"role": "user", "content": "We launch on Tuesday."},
        {"role": "assistant", "content": "Noted: Tuesday."},
    ]
    with scripted(atom, SUMMARY):
        answered = await sdk.responses.with_raw_response.compact(model=model, input=conversation, prompt_cache_key="k")
    compacted, raw = answered.parse(), answered.http_response.json()
    spec.CompactResource.model_validate(raw)
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    assert [(item.type, getattr(item, "role", None)) for item in compacted.output] == [
        ("message", "user"),
        ("compaction", None),
    ]
    # a new chain from the compacted window
    with scripted(atom, ANSWER):
        await post(http, {"input": [*raw["output"], {"role": "user", "content": "When?"}], "max_output_tokens": 4})
    assert SUMMARY in prompts[-1] and "We launch on Tuesday." not in prompts[-1]
    error = await post(http, {"input": conversation}, 400, path="/v1/responses/compact")
    assert error["error"]["param"] == "model"


async def test_a_summary_request_over_the_context_drops_the_oldest_turns_to_fit(atom, http):
    filler = [{"role": "user", "content": f"Old message {i}: " + "words " * 150} for i in range(20)]
    with scripted(atom, SUMMARY):
        data = await post(http, {"input": [*filler, {"type": "compaction_trigger"}]})
    assert [item["type"] for item in data["output"]] == ["compaction"]
    assert data["usage"]["input_tokens"] + data["usage"]["output_tokens"] <= MAX_MODEL_LEN


async def test_a_tampered_or_misused_compaction_item_is_refused_naming_the_field(atom, http):
    trigger = [{"role": "user", "content": "Hi."}, {"type": "compaction_trigger"}]
    with scripted(atom, SUMMARY):  # the template opened <think>: all of it is reasoning
        [item] = (await post(http, {"input": trigger}))["output"]
        [reasoning] = (await post(http, {"input": "Hi.", "include": ["reasoning.encrypted_content"]}))["output"]
    sealed = item["encrypted_content"]
    altered = sealed[:-1] + ("x" if sealed[-1] != "x" else "y")
    for content in (altered, reasoning["encrypted_content"]):  # a reasoning seal is not a compaction seal
        error = await post(http, {"input": [{**item, "encrypted_content": content}]}, 400)
        assert (error["error"]["param"], error["error"]["code"]) == (
            "input.0.encrypted_content",
            "invalid_encrypted_content",
        )
    assert (await post(http, {"input": [item], "max_output_tokens": 1}))["status"] in ("completed", "incomplete")


# WebSocket mode


async def ws_turn(conn: Any, **body: Any) -> list[dict[str, Any]]:
    """One ``response.create`` on the socket: its events (as sent) up to the terminal one."""
    await conn.response.create(**body)
    events = [json.loads(await conn.recv_bytes())]
    while events[-1]["type"] not in TERMINAL:
        events.append(json.loads(await conn.recv_bytes()))
    return events


async def test_websocket_turns_carry_the_sse_events_and_continue_on_the_socket_without_the_store(
    atom, sdk, http, prompts
):
    model = atom.runtime.model_name
    body = {"model": model, "input": "Remember the code word cobalt.", "store": False, **NO_THINKING}
    with scripted(atom, ANSWER):
        sse = await sse_events(http, body)
        async with sdk.responses.connect() as conn:
            first = await ws_turn(conn, **body)
            second = await ws_turn(
                conn,
                model=model,
                input="The code word?",
                previous_response_id=first[-1]["response"]["id"],
                store=False,
                **NO_THINKING,
            )
            warm = await ws_turn(conn, model=model, input="Warm up.", generate=False, store=False)
            after_warm = await ws_turn(
                conn,
                model=model,
                input="Go on.",
                previous_response_id=warm[-1]["response"]["id"],
                store=False,
                **NO_THINKING,
            )
    assert [e["type"] for e in first] == [e["type"] for e in sse]
    assert_spec_events(first)
    assert (
        second[-1]["type"] == "response.completed"
        and second[-1]["response"]["output"][0]["content"][0]["text"] == ANSWER
    )
    assert "cobalt" in prompts[-3] and ANSWER in prompts[-3]  # the second turn's prompt held the first turn
    assert warm[-1]["response"]["output"] == [] and warm[-1]["response"]["status"] == "completed"
    assert after_warm[-1]["type"] == "response.completed" and "Warm up." in prompts[-1]


async def test_websocket_errors_are_events_and_a_failed_continuation_is_forgotten(atom, sdk):
    model = atom.runtime.model_name
    async with sdk.responses.connect() as conn:
        [missing] = await ws_turn(conn, model=model, input="Hi.", previous_response_id="resp_nope", store=False)
        with scripted(atom, ANSWER):
            first = await ws_turn(conn, model=model, input="Hi.", store=False, **NO_THINKING)
        rid = first[-1]["response"]["id"]
        orphan = [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
        [failed] = await ws_turn(conn, model=model, input=orphan, previous_response_id=rid, store=False)
        [retry] = await ws_turn(conn, model=model, input="Again.", previous_response_id=rid, store=False)
    spec.WebSocketErrorEvent.model_validate(missing)
    assert (missing["status"], missing["error"]["code"]) == (404, "previous_response_not_found")
    assert (failed["status"], failed["error"]["param"]) == (400, "input.0.call_id")
    assert retry["error"]["code"] == "previous_response_not_found"
    async with sdk.responses.connect() as conn:  # a store:false chain does not outlive its socket
        with scripted(atom, ANSWER):
            first = await ws_turn(conn, model=model, input="Hi.", store=False, **NO_THINKING)
    async with sdk.responses.connect() as conn:
        [lost] = await ws_turn(
            conn, model=model, input="Hi.", previous_response_id=first[-1]["response"]["id"], store=False
        )
    assert lost["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/health", "/v1/responses/compact", "/nope"])
async def test_a_websocket_to_a_route_without_one_is_refused_with_a_4xx_not_a_500(served, path):
    url = served[1].replace("http://", "ws://") + path
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        async with websockets.connect(url):
            pass
    response = refused.value.response
    assert 400 <= response.status_code < 500, response.body
    assert json.loads(response.body)["error"]["message"]


async def test_a_websocket_needs_the_api_key(tiny_model):
    config = Config.of(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.05, api_key="sk-test")
    async with served_over_http(AtomApp(config, loaded=tiny_model, sampler=FakeSampler())) as base_url:
        url = base_url.replace("http://", "ws://") + "/v1/responses"
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers={"Authorization": "Bearer wrong"}):
                pass
        assert refused.value.response.status_code == 401
        async with websockets.connect(url, additional_headers={"Authorization": "Bearer sk-test"}) as ws:
            await ws.send(json.dumps({"type": "response.create", "input": "Hi.", "max_output_tokens": 1}))
            events = [json.loads(await ws.recv()) for _ in range(2)]
            assert [e["type"] for e in events] == ["response.created", "response.in_progress"]


def test_a_seal_key_setting_lets_sealed_items_survive_a_restart():
    """Two processes with the same responses_seal_key open each other's items; without it, or with
    another key, an item sealed before a restart is refused."""
    item = Sealer.of("the operators secret").seal("reasoning", {"text": "I think."})
    assert Sealer.of("the operators secret").open("reasoning", item) == {"text": "I think."}
    for other in (Sealer.of("another secret"), Sealer.of(None)):
        with pytest.raises(SealError):
            other.open("reasoning", item)


async def test_codexs_prompt_cache_key_keys_the_kv_lease_and_cache_salt_separates_tenants(http, atom):
    bm = atom.runtime.engine.block_manager
    question = "Inspect the repository and report what it holds. " * 12
    body = {"model": atom.runtime.model_name, "input": question, "max_output_tokens": 4, "store": False}
    r = await http.post("/v1/responses", json={**body, "prompt_cache_key": "codex-session-1"})
    assert r.status_code == 200 and bm.leases["codex-session-1"].block_ids
    salted = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        r = await http.post("/v1/responses", json={**body, "cache_salt": salt})
        salted.append(r.json()["usage"]["input_tokens_details"]["cached_tokens"])
    assert salted[0] == 0 and salted[1] > 0 and salted[2] == 0
