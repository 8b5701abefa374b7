"""POST /v1/responses, GET/DELETE /v1/responses/{id}: the OpenAI Responses API on the tiny model.

Shapes, errors and the store through the Quart test client; end to end with the official
``openai`` SDK against real hypercorn. Reasoning and function-call output comes from a scripted
token source installed at the sampler boundary (``ScriptedSampler``): the model's forward,
the engine loop, the detokenizer, the output parsers and the API mapping all stay real.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest
from support_fakes import FakeSampler, fake_sampler, scripted
from support_servers import served_over_http

from atom_anyio.api.app import AtomApp
from atom_anyio.api.response_store import ResponseStore, StoredResponse
from atom_anyio.api.responses import Responses, sse_frame
from atom_anyio.api.responses_encoder import ResponseEncoder
from atom_anyio.api.responses_schemas import ResponsesRequest
from atom_anyio.api.sealed import Sealer
from atom_anyio.config import Config
from atom_anyio.prompt.prepare import prepare_prompt
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
THOUGHT = "The user asks about Paris, so I look up its weather."
ANSWER = "It is sunny in Paris."
CALL_ARGS = {"city": "Paris"}
NO_THINKING = {"reasoning": {"effort": "none"}}  # the template's prompt then closes the reasoning channel
COUNT = "one two three four five six seven eight"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def serving(tiny_model, **config: Any):
    atom = AtomApp(
        Config.of(**{"max_model_len": MAX_MODEL_LEN, "kv_cache_gib": 0.05, **config}),
        loaded=tiny_model,
        sampler=FakeSampler(),
    )
    async with atom.serving():
        yield atom


@pytest.fixture(scope="module")
async def atom(tiny_model):
    """The tiny model with the Qwen3-style template (thinking and tools)."""
    async for app in serving(tiny_model, chat_template=QWEN3_TEMPLATE):
        yield app


@pytest.fixture
def client(atom):
    return atom.quart.test_client()


# helpers


async def post(client, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = await client.post("/v1/responses", json=body)
    data = await r.get_json()
    assert r.status_code == status, data
    return data


def assert_openai_error(data: dict[str, Any], *, param: str | None, code: str) -> str:
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["param"] == param and data["error"]["code"] == code, data
    return data["error"]["message"]


async def stream_events(client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a streamed response, each framed ``event: <type>\\ndata: <json>\\n\\n``."""
    r = await client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    body_text = (await r.get_data()).decode()
    assert body_text.endswith("\n\n")
    events = []
    for frame in body_text.split("\n\n")[:-1]:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


_TEXT = (
    "response.content_part.added (?:response.output_text.delta )*response.output_text.done response.content_part.done "
)
_REASONING = (
    "response.content_part.added (?:response.reasoning_text.delta )*response.reasoning_text.done "
    "response.content_part.done "
)
_CALL = "(?:response.function_call_arguments.delta )*response.function_call_arguments.done "
_ITEM = f"response.output_item.added (?:{_TEXT}|{_REASONING}|{_CALL})response.output_item.done "
DOCUMENTED_ORDER = re.compile(f"response.created response.in_progress (?:{_ITEM})+response.(?:completed|incomplete) ")


def assert_documented_order(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Events in the documented sequence, each item event on the item just added; returns the
    final response, whose output is the items as their done events gave them (less malformed calls)."""
    names = "".join(e["type"] + " " for e in events)
    assert DOCUMENTED_ORDER.fullmatch(names), names
    added: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(added)
            added.append(e["item"])
        if "item_id" in e:
            assert (e["item_id"], e["output_index"]) == (added[-1]["id"], len(added) - 1), e
    final = events[-1]["response"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert final["output"] == [
        item for item in done if item["type"] != "function_call" or item["status"] == "completed"
    ]
    return final


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def store_of(atom: AtomApp) -> ResponseStore:
    return atom.runtime.responses_store


# shape and fields


async def test_string_input_returns_a_response_with_one_message_and_usage(client, atom):
    body = {
        "input": "Tell me about rivers.",
        "temperature": 0,
        "max_output_tokens": 8,
        "metadata": {"k": "v"},
        **NO_THINKING,
    }
    data = await post(client, body)
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert data["status"] in ("completed", "incomplete") and data["error"] is None
    assert data["model"] == atom.runtime.model_name
    [message] = data["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    usage = data["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 8
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert set(usage["input_tokens_details"]) == {"cached_tokens"}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    echoed = {k: data[k] for k in ("temperature", "top_p", "max_output_tokens", "truncation", "metadata", "store")}
    assert echoed == {
        "temperature": 0,
        "top_p": 1.0,
        "max_output_tokens": 8,
        "truncation": "disabled",
        "metadata": {"k": "v"},
        "store": True,
    }
    assert data["tools"] == [] and data["tool_choice"] == "auto" and data["text"] == {"format": {"type": "text"}}


async def test_repeated_input_reports_cached_input_tokens(client):
    body = {"input": "A long enough prompt to fill a whole KV block or two. " * 4, "max_output_tokens": 1}
    await post(client, body)
    again = await post(client, body)
    assert 0 < again["usage"]["input_tokens_details"]["cached_tokens"] < again["usage"]["input_tokens"]


async def test_max_output_tokens_ends_incomplete_with_the_reason(client, atom):
    with scripted(atom, COUNT):
        data = await post(client, {"input": "Count.", "max_output_tokens": 3, **NO_THINKING})
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["usage"]["output_tokens"] == 3 and data["output"][-1]["status"] == "incomplete"


async def test_items_and_instructions_render_as_the_equivalent_chat(client):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(CALL_ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]},
        {"role": "user", "content": "Thanks!"},
    ]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}}
    chat = [
        {"role": "system", "content": "Be kind."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Thanks!"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    r = await client.post("/tokenize", json={"messages": chat, "tools": [chat_tool]})
    expected = (await r.get_json())["count"]
    data = await post(
        client, {"input": items, "instructions": "Be kind.", "tools": [WEATHER_TOOL], "max_output_tokens": 1}
    )
    assert data["usage"]["input_tokens"] == expected
    assert data["instructions"] == "Be kind." and data["tools"] == [{**WEATHER_TOOL, "strict": None}]
    # tool_choice "none" leaves the tools out of the prompt
    r = await client.post("/tokenize", json={"messages": chat})
    without_tools = (await r.get_json())["count"]
    body = {
        "input": items,
        "instructions": "Be kind.",
        "tools": [WEATHER_TOOL],
        "tool_choice": "none",
        "max_output_tokens": 1,
    }
    assert (await post(client, body))["usage"]["input_tokens"] == without_tools < expected


@pytest.mark.parametrize(("effort", "thinking"), [("minimal", False), ("none", False), ("low", True), ("high", True)])
async def test_reasoning_effort_switches_the_templates_thinking(client, effort, thinking):
    messages = [{"role": "user", "content": "Hi."}]
    r = await client.post(
        "/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}}
    )
    expected = (await r.get_json())["count"]
    data = await post(client, {"input": "Hi.", "reasoning": {"effort": effort}, "max_output_tokens": 1})
    assert data["usage"]["input_tokens"] == expected and data["reasoning"]["effort"] == effort


async def test_text_format_json_schema_is_accepted_and_echoed(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": {"type": "object"}, "strict": True}
    data = await post(client, {"input": "Hi.", "text": {"format": fmt}, "max_output_tokens": 1})
    assert data["text"]["format"] == fmt


# the output parsers: reasoning and function calls


async def test_reasoning_then_text_become_a_reasoning_item_and_a_message(client, atom):
    with scripted(atom, f"{THOUGHT}\n</think>\n\n{ANSWER}"):  # the prompt opened <think>
        data = await post(client, {"input": "Weather in Paris?"})
    assert data["status"] == "completed"
    reasoning, message = data["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}] and reasoning["summary"] == []
    assert message["type"] == "message" and output_text(data) == ANSWER
    details = data["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < data["usage"]["output_tokens"]


async def test_a_tool_call_becomes_a_function_call_item(client, atom):
    with scripted(atom, tool_call_text("get_weather", CALL_ARGS)):
        data = await post(client, {"input": "Weather in Paris?", "tools": [WEATHER_TOOL], **NO_THINKING})
    [call] = [item for item in data["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == CALL_ARGS
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"
    assert output_text(data).strip() == ""


async def test_parallel_tool_calls_become_one_item_each_with_no_whitespace_message(client, atom):
    paris, rome = tool_call_text("get_weather", CALL_ARGS), tool_call_text("get_weather", {"city": "Rome"})
    with scripted(atom, f"{paris}\n{rome}"):
        events = await stream_events(client, {"input": "Paris and Rome?", "tools": [WEATHER_TOOL], **NO_THINKING})
    final = assert_documented_order(events)
    assert [item["type"] for item in final["output"]] == ["function_call", "function_call"]
    assert [json.loads(item["arguments"]) for item in final["output"]] == [CALL_ARGS, {"city": "Rome"}]
    assert len({item["call_id"] for item in final["output"]}) == 2


async def test_a_malformed_call_is_dropped_from_the_output_and_its_text_becomes_a_message(client, atom):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    body = {"input": "Weather?", "tools": [WEATHER_TOOL], **NO_THINKING}
    with scripted(atom, broken):
        plain = await post(client, body)
        events = await stream_events(client, body)
    final = assert_documented_order(events)
    assert [item["type"] for item in plain["output"]] == [item["type"] for item in final["output"]] == ["message"]
    assert output_text(plain) == output_text(final) and "Paris" in output_text(plain)
    # the stream had announced the call before it broke: it closes as incomplete
    [call] = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["output_index"] == 0]
    assert call["type"] == "function_call" and call["status"] == "incomplete"


async def test_tool_call_syntax_stays_text_when_tool_choice_is_none(client, atom):
    text = tool_call_text("get_weather", CALL_ARGS)
    with scripted(atom, text):
        data = await post(client, {"input": "Weather?", "tools": [WEATHER_TOOL], "tool_choice": "none", **NO_THINKING})
    assert [item["type"] for item in data["output"]] == ["message"] and output_text(data) == text


# streaming


async def test_stream_follows_the_documented_event_order_and_matches_the_plain_response(client, atom):
    body = {"input": "Weather in Paris?", "tools": [WEATHER_TOOL]}
    script = f"{THOUGHT}\n</think>\n\nLet me check. {tool_call_text('get_weather', CALL_ARGS)}"
    with scripted(atom, script):
        plain = await post(client, body)
        events = await stream_events(client, body)
    final = assert_documented_order(events)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert final["status"] == "completed" and final["usage"] == plain["usage"]
    kinds = [item["type"] for item in final["output"]]
    assert kinds == [item["type"] for item in plain["output"]] == ["reasoning", "message", "function_call"]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert reasoning == final["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]
    assert text == output_text(final) == output_text(plain)
    assert json.loads(args) == json.loads(final["output"][2]["arguments"]) == CALL_ARGS
    [args_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert args_done["arguments"] == final["output"][2]["arguments"]


async def test_stream_stopped_by_max_output_tokens_ends_with_response_incomplete(client, atom):
    with scripted(atom, COUNT):
        events = await stream_events(client, {"input": "Count.", "max_output_tokens": 2, **NO_THINKING})
    final = assert_documented_order(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["usage"]["output_tokens"] == 2


async def test_engine_failure_mid_stream_ends_with_an_error_event(client, atom):
    sampler = fake_sampler(atom.runtime.engine)
    sampler.fail(RuntimeError("injected device error"))
    try:
        events = await stream_events(client, {"input": "Hi.", "max_output_tokens": 4})
        plain = await client.post("/v1/responses", json={"input": "Hi.", "max_output_tokens": 4})
    finally:
        sampler.restore()
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "injected device error" in events[2]["message"] and events[2]["code"] == "engine_error"
    assert events[3]["response"]["status"] == "failed"
    assert plain.status_code == 500
    assert_openai_error(await plain.get_json(), param=None, code="engine_error")
    assert (await post(client, {"input": "Hi.", "max_output_tokens": 1}))["status"] in ("completed", "incomplete")


# errors


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
            "unsupported_content",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "unsupported_item"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "invalid_value"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "invalid_value"),
        ({"input": ""}, "input", "invalid_value"),
        ({"input": "Hi.", "tools": [{"type": "calculator"}]}, "tools.0.type", "unsupported_tool"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
            "input.0.call_id",
            "invalid_value",
        ),
        (
            {"input": [{"type": "compaction_trigger"}, {"role": "user", "content": "x"}]},
            "input.0.type",
            "unsupported_item",
        ),
        ({"input": "Hi.", "tools": [{"type": "function"}]}, "tools.0.name", "invalid_value"),
        (
            {"input": "Hi.", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
            "invalid_value",
        ),
        ({"input": "Hi.", "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"input": "Hi.", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"input": "Hi.", "temperature": 3}, "temperature", "invalid_value"),
        ({"input": "Hi.", "truncation": "sometimes"}, "truncation", "invalid_value"),
        ({"input": "Hi.", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
        ({"input": "Hi.", "text": {"format": {"type": "yaml"}}}, "text.format.type", "invalid_value"),
        ({"input": "Hi.", "background": True}, "background", "invalid_value"),
    ],
)
async def test_invalid_request_is_refused_naming_the_field(client, body, param, code):
    message = assert_openai_error(await post(client, body, 400), param=param, code=code)
    assert param.split(".")[-1] in message or code in ("unsupported_content", "unsupported_tool")


async def test_input_over_the_context_is_refused_unless_truncation_is_auto(client, atom):
    filler = [{"role": "user", "content": f"Old message {i}: " + "words " * 150} for i in range(20)]
    body = {"input": [*filler, {"role": "user", "content": "Latest question?"}], "max_output_tokens": 4}
    message = assert_openai_error(await post(client, body, 400), param="input", code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in message
    data = await post(client, {**body, "truncation": "auto"})
    assert data["truncation"] == "auto" and data["usage"]["input_tokens"] + 4 <= MAX_MODEL_LEN


# the store


async def test_previous_response_id_prepends_the_stored_input_and_output(client, atom):
    with scripted(atom, ANSWER):
        first = await post(client, {"input": "Weather in Paris?", "instructions": "Be brief.", **NO_THINKING})
        second = await post(client, {"input": "And tomorrow?", "previous_response_id": first["id"], **NO_THINKING})
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    # instructions are not carried over; the previous input and output are
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": output_text(first)},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = await client.post("/tokenize", json={"messages": chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert output_text(first) == ANSWER and second["usage"]["input_tokens"] == (await r.get_json())["count"]


async def test_stored_response_can_be_retrieved_and_deleted(client):
    data = await post(client, {"input": "Hi.", "max_output_tokens": 2})
    r = await client.get(f"/v1/responses/{data['id']}")
    assert r.status_code == 200 and await r.get_json() == data
    r = await client.delete(f"/v1/responses/{data['id']}")
    assert await r.get_json() == {"id": data["id"], "object": "response.deleted", "deleted": True}
    for r in (await client.get(f"/v1/responses/{data['id']}"), await client.delete(f"/v1/responses/{data['id']}")):
        assert r.status_code == 404
        assert data["id"] in assert_openai_error(await r.get_json(), param=None, code="response_not_found")


async def test_store_false_keeps_nothing(client, atom):
    num_stored = len(store_of(atom))
    data = await post(client, {"input": "Hi.", "max_output_tokens": 1, "store": False})
    assert data["store"] is False and len(store_of(atom)) == num_stored
    assert (await client.get(f"/v1/responses/{data['id']}")).status_code == 404
    body = {"input": "Hi.", "previous_response_id": data["id"]}
    message = assert_openai_error(
        await post(client, body, 404), param="previous_response_id", code="previous_response_not_found"
    )
    assert data["id"] in message


async def test_store_evicts_the_least_recently_used_response(tiny_model):
    async for atom in serving(tiny_model, responses_store_max_items=2):
        client = atom.quart.test_client()
        ids = [(await post(client, {"input": f"Hi {i}.", "max_output_tokens": 1}))["id"] for i in range(2)]
        assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 200  # now the most recent
        ids.append((await post(client, {"input": "Hi 2.", "max_output_tokens": 1}))["id"])
        assert len(store_of(atom)) == 2
        assert (await client.get(f"/v1/responses/{ids[1]}")).status_code == 404
        assert [(await client.get(f"/v1/responses/{i}")).status_code for i in (ids[0], ids[2])] == [200, 200]
        body = {"input": "Again.", "previous_response_id": ids[1]}
        assert_openai_error(
            await post(client, body, 404), param="previous_response_id", code="previous_response_not_found"
        )


async def test_store_expires_responses_idle_past_the_ttl(tiny_model):
    clock = [0.0]
    async for atom in serving(tiny_model, responses_store_ttl_s=60):
        client = atom.quart.test_client()
        store_of(atom).clock = lambda: clock[0]
        kept = (await post(client, {"input": "Hi.", "max_output_tokens": 1}))["id"]
        idle = (await post(client, {"input": "Hi.", "max_output_tokens": 1}))["id"]
        clock[0] = 45
        assert (await client.get(f"/v1/responses/{kept}")).status_code == 200  # a read renews it
        clock[0] = 90
        assert (await client.get(f"/v1/responses/{idle}")).status_code == 404
        assert (await client.get(f"/v1/responses/{kept}")).status_code == 200
        clock[0] = 200
        body = {"input": "Again.", "previous_response_id": kept}
        assert_openai_error(
            await post(client, body, 404), param="previous_response_id", code="previous_response_not_found"
        )
        assert len(store_of(atom)) == 0


def test_store_stays_within_max_items_and_drops_expired_entries_from_the_front():
    now = [0.0]
    store = ResponseStore(max_items=3, ttl_s=10, clock=lambda: now[0])
    for i in range(100):
        store.put(f"r{i}", StoredResponse([], {"id": f"r{i}"}))
        now[0] += 1
        assert len(store) <= 3
    assert [store.get(f"r{i}") is not None for i in (96, 97, 98, 99)] == [False, True, True, True]
    now[0] += 10
    store.put("fresh", StoredResponse([], {"id": "fresh"}))
    assert len(store) == 1 and store.get("fresh") is not None
    with pytest.raises(ValueError):
        ResponseStore(max_items=0, ttl_s=10)


# end to end: the official SDK against hypercorn


@pytest.fixture(scope="module")
async def sdk(tiny_model):
    """The official AsyncOpenAI client against real hypercorn serving the app on a free port."""
    atom = AtomApp(
        Config.of(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.05, chat_template=QWEN3_TEMPLATE),
        loaded=tiny_model,
        sampler=FakeSampler(),
    )
    # graceful at exit: hypercorn closes, the lifespan drains and stops the engine
    async with (
        served_over_http(atom) as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield atom, client


async def test_sdk_create_retrieve_chain_and_delete(sdk):
    atom, client = sdk
    model, no_thinking = atom.runtime.model_name, {"effort": "none"}
    with scripted(atom, ANSWER):
        first = await client.responses.create(
            model=model, input="Weather in Paris?", instructions="Be brief.", reasoning=no_thinking
        )
        second = await client.responses.create(
            model=model, input="And tomorrow?", previous_response_id=first.id, reasoning=no_thinking
        )
    assert first.status == "completed" and first.output_text == ANSWER
    assert (
        first.usage.input_tokens > 0
        and first.usage.output_tokens == len(atom.runtime.loaded.tokenizer.encode(ANSWER)) + 1
    )
    assert second.previous_response_id == first.id and second.output_text == ANSWER
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    retrieved = await client.responses.retrieve(first.id)
    assert retrieved.id == first.id and retrieved.output_text == ANSWER
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        await client.responses.create(model=model, input="Hi.", previous_response_id=first.id)


async def test_sdk_stream_events_final_response_and_a_tool_round_trip(sdk):
    atom, client = sdk
    model, tools = atom.runtime.model_name, [WEATHER_TOOL]
    with scripted(atom, f"{THOUGHT}\n</think>\n\n{tool_call_text('get_weather', CALL_ARGS)}"):
        async with client.responses.stream(model=model, input="Weather in Paris?", tools=tools) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    reasoning, call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text.strip() == THOUGHT
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == CALL_ARGS
    # the SDK's accumulated snapshot of the arguments matches the final call
    [last_args] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert last_args.arguments == call.arguments
    # the call's output goes back, chained on the previous response
    with scripted(atom, ANSWER):
        answer = await client.responses.create(
            model=model,
            previous_response_id=final.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            tools=tools,
            reasoning={"effort": "none"},
        )
    assert answer.output_text == ANSWER and answer.usage.input_tokens > final.usage.input_tokens


async def test_sdk_max_output_tokens_gives_an_incomplete_response(sdk):
    atom, client = sdk
    body = {
        "model": atom.runtime.model_name,
        "input": "Count.",
        "max_output_tokens": 3,
        "reasoning": {"effort": "none"},
    }
    with scripted(atom, COUNT):
        plain = await client.responses.create(**body)
        async with client.responses.stream(**body) as stream:
            events = [event async for event in stream]
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output_text == " ".join(COUNT.split()[:3]) or plain.usage.output_tokens == 3
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == plain.output_text


async def test_a_malformed_call_streams_in_order_however_the_deltas_fall(atom):
    """Many tokens to a delta (a verified draft's) can announce a call and prove it malformed at once:
    at every pair of cut points the encoder's events keep the documented order, the call's item (closed
    incomplete) first, then the message with its text, and the Response's output is the message alone.
    Before the parser's ordered pieces some cuts put the call's arguments after its text."""
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
    rt = atom.runtime
    api = Responses(rt, rt.responses_store, Sealer.of(rt.config.responses_seal_key))
    body = {"model": rt.model_name, "input": "Weather?", "tools": [WEATHER_TOOL], **NO_THINKING}
    request = ResponsesRequest.model_validate(body)
    async with atom.quart.test_request_context("/v1/responses", method="POST"):  # the request's headers
        turn = api.turn(request, frame=sse_frame)
    prepared = prepare_prompt(turn.prompt, rt.prepare_ctx)
    for i in range(1, len(broken)):
        for j in range(i, len(broken) + 1, 7):
            encoder = ResponseEncoder(rt, turn, prepared)
            events = [
                encoder._event(kind, response=encoder._response())
                for kind in ("response.created", "response.in_progress")
            ]
            for part in (broken[:i], broken[i:j], broken[j:]):
                events += encoder.text_events(part)
            events += encoder.finish_events(is_cut=False)
            encoder.status = "completed"
            events += list(encoder._end_output())
            events.append(encoder._event("response.completed", response=encoder._response()))
            final = assert_documented_order(events)
            assert [item["type"] for item in final["output"]] == ["message"], (i, j)
            assert output_text(final) == broken, (i, j)
