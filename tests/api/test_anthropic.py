"""The Anthropic Messages API: the real Quart app, engine, tokenizer and output parsers serving
the tiny random Llama through a Qwen3-style template (thinking and tools), and end to end with
the official ``anthropic`` SDK against the same app served by hypercorn on a real port.

A random tiny model never writes a tool call or a thinking block, so the tests that need one
install ``ScriptedSampler``: a fake at the model boundary (the sampler) that emits the tokens of
a fixed text. The engine loop, detokenizer, parsers and API mapping all stay real.

Quart runs on asyncio only, so every test here runs on the asyncio backend.
"""

from __future__ import annotations

import dataclasses
import json
import re
from contextlib import ExitStack
from typing import Any

import anthropic
import pytest
from structlog.testing import capture_logs
from support_fakes import FakeSampler, ScriptedSampler, fake_sampler, scripted
from support_servers import free_port, served_over_http

from atom_anyio.api.anthropic import ContentBlocks
from atom_anyio.api.anthropic_schemas import MessagesRequest
from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.parse import OutputParser, ParserSpec
from atom_anyio.prompt.prepare import prepare_prompt
from atom_anyio.templates import template_path

pytestmark = pytest.mark.anyio

TEMPLATE = template_path("qwen3_tools")
API_KEY = "sk-ant-test"
MODEL = "tiny"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"type": "disabled"}  # the template thinks unless told not to
THINKING = {"type": "enabled", "budget_tokens": 1024}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
THOUGHT = "The user wants the weather; I should call the tool."
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
THINK_THEN_CALL = f"{THOUGHT}\n</think>\n\nLet me check.\n{TOOL_CALL}"  # the prompt opened the <think>


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def atom(tiny_model):
    """One server for the module, run by hypercorn on a free port (stopped through its shutdown
    trigger); the Quart test client reaches the same app in-process."""
    config = Config.of(
        served_model_name=MODEL,
        api_key=API_KEY,
        chat_template=TEMPLATE,
        max_model_len=4096,
        kv_cache_gib=0.05,
        port=free_port(),
        max_body_bytes=256 * 1024,
    )
    app = AtomApp(config, loaded=tiny_model, sampler=FakeSampler())
    async with served_over_http(app, port=config.port):
        yield app


@pytest.fixture
def script(atom):
    """``script(text)`` makes the model write ``text``; the real sampler is back after the test."""
    with ExitStack() as installed:

        def install(text: str, fail_at: int | None = None) -> ScriptedSampler:
            installed.enter_context(scripted(atom, text, fail_at))
            return fake_sampler(atom.runtime.engine).fake

        yield install


@pytest.fixture
def client(atom):
    return atom.quart.test_client()


@pytest.fixture
async def sdk(atom):
    async with anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{atom.runtime.config.port}", api_key=API_KEY, max_retries=0
    ) as client:
        yield client


HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}


async def post(client, body: dict[str, Any], path: str = "/v1/messages", headers: dict | None = None):
    r = await client.post(path, json=body, headers=HEADERS if headers is None else headers)
    return r.status_code, await r.get_json()


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": USER, "thinking": NO_THINKING, **fields}


def events_of(sse_text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) per SSE event; the name must match the data's type."""
    out = []
    for chunk in sse_text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


# The documented order: message_start, then blocks (start, deltas, stop), message_delta,
# message_stop; pings anywhere (here: right after message_start).
STREAM_ORDER = re.compile(
    r"message_start ping( content_block_start( content_block_delta)* content_block_stop)* message_delta message_stop"
)


def content_of(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a client accumulates from the events (as the SDK does)."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                assert kind == "input_json_delta"
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
    return blocks


# responses


async def test_a_text_reply_has_the_message_shape_and_usage(client, script):
    script("Hello there!")
    status, msg = await post(client, body())
    assert status == 200
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["model"] == MODEL
    assert msg["content"] == [{"type": "text", "text": "Hello there!"}]
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    count_body = {"model": MODEL, "messages": USER, "thinking": NO_THINKING}
    _, count = await post(client, count_body, "/v1/messages/count_tokens")
    usage = msg["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == count["input_tokens"]
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["output_tokens"] == len(script("Hello there!").token_ids) + 1  # and the end token


async def test_a_repeated_prompt_reads_its_prefix_from_the_cache(client, script):
    script("Once.")
    long_user = [{"role": "user", "content": "Describe the sea. " * 20}]
    _, first = await post(client, body(messages=long_user))
    _, second = await post(client, body(messages=long_user))
    total = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    assert second["usage"]["cache_read_input_tokens"] >= 16  # at least one full KV block
    assert second["usage"]["input_tokens"] + second["usage"]["cache_read_input_tokens"] == total


async def test_thinking_and_a_tool_call_become_thinking_text_and_tool_use_blocks(client, script):
    script(THINK_THEN_CALL)
    request = body(tools=[WEATHER_TOOL], thinking=THINKING, max_tokens=2048)
    status, msg = await post(client, request)
    assert status == 200, msg
    thinking, text, tool_use = msg["content"]
    assert thinking == {"type": "thinking", "thinking": THOUGHT, "signature": thinking["signature"]}
    assert thinking["signature"]
    assert text == {"type": "text", "text": "Let me check."}
    assert tool_use["type"] == "tool_use" and tool_use["id"].startswith("toolu_")
    assert tool_use["name"] == "get_weather" and tool_use["input"] == {"city": "Paris", "unit": "C"}
    assert msg["stop_reason"] == "tool_use"


async def test_a_malformed_tool_call_comes_back_as_text(client, script):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
    script(broken)
    _, msg = await post(client, body(tools=[WEATHER_TOOL]))
    assert msg["content"] == [{"type": "text", "text": broken}] and msg["stop_reason"] == "end_turn"
    r = await client.post("/v1/messages", json=body(tools=[WEATHER_TOOL], stream=True), headers=HEADERS)
    events = events_of(await r.get_data(as_text=True))
    # the call was announced before it proved malformed: its block stays, the text follows it
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["tool_use", "text"] and events[-2][1]["delta"]["stop_reason"] == "end_turn"


async def test_tool_choice_none_renders_no_tools_and_parses_none(client, script):
    script(TOOL_CALL)
    _, msg = await post(client, body(tools=[WEATHER_TOOL], tool_choice={"type": "none"}))
    assert [b["type"] for b in msg["content"]] == ["text"] and "<tool_call>" in msg["content"][0]["text"]
    assert msg["stop_reason"] == "end_turn"
    count = {"model": MODEL, "messages": USER}
    _, plain = await post(client, count, "/v1/messages/count_tokens")
    _, none = await post(
        client, {**count, "tools": [WEATHER_TOOL], "tool_choice": {"type": "none"}}, "/v1/messages/count_tokens"
    )
    _, tools = await post(client, {**count, "tools": [WEATHER_TOOL]}, "/v1/messages/count_tokens")
    assert none == plain and tools["input_tokens"] > plain["input_tokens"]


async def test_thinking_switch_reaches_the_template(client, script):
    count = {"model": MODEL, "messages": USER}
    _, off = await post(client, {**count, "thinking": {"type": "disabled"}}, "/v1/messages/count_tokens")
    _, on = await post(
        client, {**count, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "/v1/messages/count_tokens"
    )
    assert off["input_tokens"] > on["input_tokens"]  # the empty think block that switches it off
    script("Just the answer.")
    _, msg = await post(client, body(thinking={"type": "disabled"}))
    assert msg["content"] == [{"type": "text", "text": "Just the answer."}]


async def test_a_stop_sequence_ends_the_message_and_is_reported(client, script):
    script("one two three four")
    _, msg = await post(client, body(stop_sequences=["three"]))
    assert msg["content"] == [{"type": "text", "text": "one two"}]
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == "three"


async def test_max_tokens_ends_the_message_with_max_tokens(client, script):
    script("one two three four five six")
    _, msg = await post(client, body(max_tokens=2))
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 2


async def test_a_final_assistant_message_is_continued(client, script, atom):
    messages = [*USER, {"role": "assistant", "content": "It is"}]
    prepared = prepare_prompt(
        MessagesRequest.model_validate(body(messages=messages)).prompt_request(), atom.runtime.prepare_ctx
    )
    assert prepared.text.endswith("It is")
    script(" sunny.")
    _, msg = await post(client, body(messages=messages))
    assert msg["content"] == [{"type": "text", "text": " sunny."}]


async def test_tool_use_and_tool_result_render_as_the_templates_expect(atom):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "I need the tool.", "signature": "abc"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief."}]
    req = MessagesRequest.model_validate(body(messages=messages, tools=[WEATHER_TOOL], system=system))
    text = prepare_prompt(req.prompt_request(), atom.runtime.prepare_ctx).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<think>\nI need the tool.\n</think>" in text  # thinking passed back as reasoning_content
    assert '"name": "get_weather"' in text and '"city": "Paris"' in text  # the call, arguments as JSON
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.index("get_weather", text.index("<|im_start|>assistant")) < text.index("18 C, sunny")
    errored = json.loads(json.dumps(messages))
    errored[-1]["content"][0]["is_error"] = True
    req = MessagesRequest.model_validate(body(messages=errored, tools=[WEATHER_TOOL]))
    assert "Error: 18 C, sunny" in prepare_prompt(req.prompt_request(), atom.runtime.prepare_ctx).text


# streaming


async def test_the_stream_follows_the_documented_event_sequence(client, script):
    script(THINK_THEN_CALL)
    request = body(tools=[WEATHER_TOOL], thinking=THINKING, max_tokens=2048)
    _, whole = await post(client, request)
    r = await client.post("/v1/messages", json={**request, "stream": True}, headers=HEADERS)
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    events = events_of(await r.get_data(as_text=True))
    names = [name for name, _ in events]
    assert STREAM_ORDER.fullmatch(" ".join(names)), names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    thinking_stop = names.index("content_block_stop")
    assert events[thinking_stop - 1][1]["delta"]["type"] == "signature_delta"
    tool_start = next(d for n, d in events if n == "content_block_start" and d["content_block"]["type"] == "tool_use")
    assert tool_start["content_block"]["input"] == {} and tool_start["content_block"]["name"] == "get_weather"
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    streamed = content_of(events)
    for block, expected in zip(streamed, whole["content"], strict=True):
        assert {k: v for k, v in block.items() if k != "id"} == {k: v for k, v in expected.items() if k != "id"}


async def test_a_one_token_stream_still_starts_without_a_stop_reason(client, script):
    script("one two three")
    r = await client.post("/v1/messages", json=body(max_tokens=1, stream=True), headers=HEADERS)
    events = events_of(await r.get_data(as_text=True))
    assert STREAM_ORDER.fullmatch(" ".join(n for n, _ in events))
    assert events[0][1]["message"]["stop_reason"] is None
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


async def test_an_engine_failure_mid_stream_ends_with_an_error_event(client, script, atom):
    script("a b c d e f g h", fail_at=3)
    status, err = await post(client, body())
    assert status == 500 and err["error"]["type"] == "api_error" and "device lost" in err["error"]["message"]
    r = await client.post("/v1/messages", json=body(stream=True), headers=HEADERS)
    events = events_of(await r.get_data(as_text=True))
    assert [n for n, _ in events][:2] == ["message_start", "ping"]
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error" and "device lost" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]
    engine = atom.runtime.engine
    assert engine.is_running and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# errors


@pytest.mark.parametrize(
    ("request_body", "status", "kind", "words"),
    [
        ({"model": MODEL, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
        (body(model="claude-nonexistent"), 404, "not_found_error", "claude-nonexistent"),
        (body(temperature=1.5), 400, "invalid_request_error", "temperature"),
        (body(messages=[]), 400, "invalid_request_error", "messages"),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            400,
            "invalid_request_error",
            "text-only",
        ),
        (
            body(tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER_TOOL]),
            400,
            "invalid_request_error",
            "nope",
        ),
        (body(thinking=THINKING), 400, "invalid_request_error", "budget_tokens"),
        # a max_tokens past the context is clamped; a prompt past it is refused as Anthropic words it
        (
            body(messages=[{"role": "user", "content": "river " * 5000}], max_tokens=10**6),
            400,
            "invalid_request_error",
            "prompt is too long: ",
        ),
        ({**body(), "messages": [{"role": "user", "content": "x" * 300_000}]}, 413, "request_too_large", "bytes"),
    ],
)
async def test_errors_have_anthropics_shape_and_status(client, request_body, status, kind, words):
    got, err = await post(client, request_body)
    assert got == status, err
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == kind and words in err["error"]["message"]


async def test_auth_takes_x_api_key_and_refuses_a_bad_one(client):
    status, err = await post(client, body(), headers={"x-api-key": "wrong"})
    assert status == 401 and err["error"]["type"] == "authentication_error"
    status, _ = await post(client, {"model": MODEL, "messages": USER}, "/v1/messages/count_tokens")
    assert status == 200


async def test_an_unknown_messages_route_is_a_not_found_error(client):
    r = await client.get("/v1/messages/batches", headers=HEADERS)
    assert r.status_code == 404 and (await r.get_json())["error"]["type"] == "not_found_error"


async def test_a_server_that_is_not_admitting_answers_overloaded(tiny_model):
    atom = AtomApp(
        Config.of(served_model_name=MODEL, kv_cache_gib=0.05, chat_template=TEMPLATE),
        loaded=tiny_model,
        sampler=FakeSampler(),
    )
    async with atom.serving():
        pass  # served, then shut down: no longer admitting
    r = await atom.quart.test_client().post("/v1/messages", json=body())
    assert r.status_code == 529 and (await r.get_json())["error"]["type"] == "overloaded_error"


# the official SDK against hypercorn


async def test_sdk_create_and_count_tokens(sdk, script):
    script("Hello from the SDK.")
    msg = await sdk.messages.create(model=MODEL, max_tokens=32, messages=USER, system="Be brief.", thinking=NO_THINKING)
    assert isinstance(msg, anthropic.types.Message)
    assert msg.content[0].text == "Hello from the SDK." and msg.stop_reason == "end_turn"
    count = await sdk.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.", thinking=NO_THINKING)
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


async def test_sdk_stream_accumulates_text_and_the_final_message(sdk, script):
    script("Streaming works, one token at a time.")
    async with sdk.messages.stream(model=MODEL, max_tokens=64, messages=USER, thinking=NO_THINKING) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Streaming works, one token at a time."
    assert final.content[0].text == text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(script("Streaming works, one token at a time.").token_ids) + 1


async def test_sdk_stream_of_thinking_and_a_tool_call(sdk, script):
    script(THINK_THEN_CALL)
    async with sdk.messages.stream(
        model=MODEL,
        max_tokens=2048,
        messages=USER,
        tools=[WEATHER_TOOL],
        thinking=THINKING,
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds and "input_json" in kinds
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == THOUGHT and final.content[0].signature
    assert final.content[2].input == {"city": "Paris", "unit": "C"} and final.stop_reason == "tool_use"


async def test_sdk_tool_use_round_trip(sdk, script):
    script(TOOL_CALL)
    first = await sdk.messages.create(
        model=MODEL, max_tokens=256, messages=USER, tools=[WEATHER_TOOL], thinking=NO_THINKING
    )
    assert first.stop_reason == "tool_use"
    (tool_use,) = [b for b in first.content if b.type == "tool_use"]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris", "unit": "C"}
    follow_up = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18 C"}]},
    ]
    script("It is 18 C in Paris.")
    second = await sdk.messages.create(
        model=MODEL, max_tokens=64, messages=follow_up, tools=[WEATHER_TOOL], thinking=NO_THINKING
    )
    assert second.content[0].text == "It is 18 C in Paris." and second.stop_reason == "end_turn"
    before = await sdk.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER_TOOL], thinking=NO_THINKING)
    after = await sdk.messages.count_tokens(model=MODEL, messages=follow_up, tools=[WEATHER_TOOL], thinking=NO_THINKING)
    assert after.input_tokens > before.input_tokens


async def test_sdk_error_types(sdk, atom):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # messages.create insists on it
        await sdk.post("/v1/messages", body={"model": MODEL, "messages": USER}, cast_to=anthropic.types.Message)
    with pytest.raises(anthropic.NotFoundError):
        await sdk.messages.create(model="claude-nonexistent", max_tokens=8, messages=USER)
    async with anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{atom.runtime.config.port}", api_key="wrong", max_retries=0
    ) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model=MODEL, max_tokens=8, messages=USER)


# what Claude Code sends

CLAUDE_CODE_PATH = "/v1/messages?beta=true"
SESSION_ID = "4f0c6a0e-1b9e-4a55-9c1e-2b1f4d0c9e11"
CLAUDE_CODE_BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "prompt-caching-scope-2026-01-05",
]
CLAUDE_CODE_HEADERS = {
    **HEADERS,
    "anthropic-beta": ",".join(CLAUDE_CODE_BETAS),
    "X-Claude-Code-Session-Id": SESSION_ID,
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1.332 (external, sdk-cli)",
}
EPHEMERAL = {"type": "ephemeral"}
BILLING_HEADER = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=sdk-cli; cch={nonce};"
REMINDER = "The user switched to plan mode: do not edit files."
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}


def claude_code_body(nonce: str = "6b1f0") -> dict[str, Any]:
    """A Claude Code 2.1 request as captured: a billing header with a per-request nonce, cache
    breakpoints everywhere, a system message mid-conversation, a server tool, adaptive thinking
    with its display omitted, effort, context management and a session id in metadata."""
    return {
        "model": MODEL,
        "max_tokens": 1024,
        "system": [
            {"type": "text", "text": BILLING_HEADER.format(nonce=nonce)},
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
            {"type": "text", "text": "You help users with software engineering tasks.", "cache_control": EPHEMERAL},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": USER[0]["content"], "cache_control": EPHEMERAL}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": THOUGHT, "signature": "c2lnbmF0dXJl"},
                    {"type": "redacted_thinking", "data": "b3BhcXVl"},
                    {"type": "text", "text": "Let me check.", "citations": None},
                    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "system", "content": REMINDER},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [{"type": "text", "text": "18 C, sunny"}],
                        "cache_control": EPHEMERAL,
                    }
                ],
            },
        ],
        "tools": [{**WEATHER_TOOL, "cache_control": EPHEMERAL}, WEB_SEARCH],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {
            "edits": [
                {"type": "clear_thinking_20251015", "keep": "all"},
                {
                    "type": "clear_tool_uses_20250919",
                    "trigger": {"type": "input_tokens", "value": 180_000},
                    "keep": {"type": "tool_uses", "value": 3},
                    "clear_at_least": {"type": "input_tokens", "value": 20_000},
                    "exclude_tools": ["web_search"],
                    "clear_tool_inputs": False,
                },
            ]
        },
        "metadata": {"user_id": json.dumps({"device_id": "9f2c", "account_uuid": "", "session_id": SESSION_ID})},
        "service_tier": "auto",
        "stream": False,
    }


def rendered(atom, request_body: dict[str, Any], ctx=None) -> str:
    """The prompt text a request runs, through the real preparation."""
    req = MessagesRequest.model_validate(request_body)
    return prepare_prompt(req.prompt_request(), ctx or atom.runtime.prepare_ctx).text


async def test_a_claude_code_request_is_answered(client, script):
    script(THINK_THEN_CALL)
    r = await client.post(CLAUDE_CODE_PATH, json=claude_code_body(), headers=CLAUDE_CODE_HEADERS)
    msg = await r.get_json()
    assert r.status_code == 200, msg
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][0]["thinking"] == "" and msg["content"][0]["signature"]
    assert msg["stop_reason"] == "tool_use"
    r = await client.post("/v1/messages/count_tokens?beta=true", json=claude_code_body(), headers=CLAUDE_CODE_HEADERS)
    usage = msg["usage"]
    assert (await r.get_json())["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert MessagesRequest.model_validate(claude_code_body()).cache_ttl_s == 3600  # the longest asked


async def test_the_billing_header_stays_out_of_the_prompt_so_its_nonce_keeps_the_cache(client, script, atom):
    first, second = rendered(atom, claude_code_body("a1")), rendered(atom, claude_code_body("b2"))
    assert first == second and "x-anthropic-billing-header" not in first and "cch=" not in first
    assert first.startswith("<|im_start|>system\nYou are Claude Code")
    script("Sunny.")
    _, one = await post(client, claude_code_body("c3"), CLAUDE_CODE_PATH, CLAUDE_CODE_HEADERS)
    _, two = await post(client, claude_code_body("d4"), CLAUDE_CODE_PATH, CLAUDE_CODE_HEADERS)
    total = one["usage"]["input_tokens"] + one["usage"]["cache_read_input_tokens"]
    # the next turn reads all of the prompt but its last, partial block from the cache
    assert two["usage"]["cache_read_input_tokens"] >= total - atom.runtime.prepare_ctx.block_size


def _system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        # before the first turn: joins the system prompt
        ([_system("Plan mode."), *USER], "<|im_start|>system\nBe brief.\nPlan mode.<|im_end|>\n<|im_start|>user\n"),
        # later: before the text of the next user turn
        (
            [*USER, _assistant("Hi."), _system("Plan mode."), {"role": "user", "content": "And Rome?"}],
            "<|im_start|>user\nPlan mode.\n\nAnd Rome?<|im_end|>",
        ),
        # followed by no user turn: after the text of the user turn before it
        ([*USER, _system("Plan mode."), _assistant("It is")], "Paris?\n\nPlan mode.<|im_end|>\n<|im_start|>assistant"),
        # with no user turn beside it: a user turn of its own, in its place
        ([*USER, _assistant("Hi."), _system("Plan mode.")], "Hi.<|im_end|>\n<|im_start|>user\nPlan mode.<|im_end|>"),
    ],
)
async def test_a_system_message_in_messages_reaches_the_prompt_in_its_place(atom, messages, expected):
    assert expected in rendered(atom, body(messages=messages, system="Be brief."))


async def test_clear_thinking_drops_the_thinking_of_older_turns(client, atom):
    def call(thought: str, n: int) -> list[dict[str, Any]]:
        tool_use = {"type": "tool_use", "id": f"toolu_{n}", "name": "get_weather", "input": {"city": "Paris"}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": "18 C"}
        thinking = {"type": "thinking", "thinking": thought, "signature": "sig"}
        return [{"role": "assistant", "content": [thinking, tool_use]}, {"role": "user", "content": [result]}]

    messages = [*USER, *call("First thought.", 1), *call("Second thought.", 2)]

    def keeping(keep: Any) -> dict[str, Any]:
        edit = {"type": "clear_thinking_20251015", "keep": keep}
        return body(messages=messages, tools=[WEATHER_TOOL], context_management={"edits": [edit]})

    every, last = rendered(atom, keeping("all")), rendered(atom, keeping({"type": "thinking_turns", "value": 1}))
    assert every == rendered(atom, body(messages=messages, tools=[WEATHER_TOOL]))  # without edits: as sent
    assert "First thought." in every and "Second thought." in every
    assert "First thought." not in last and "Second thought." in last
    counts = []
    for keep in ("all", {"type": "thinking_turns", "value": 1}, {"type": "thinking_turns", "value": 0}):
        request = {k: v for k, v in keeping(keep).items() if k != "max_tokens"}
        _, count = await post(client, request, "/v1/messages/count_tokens")
        counts.append(count["input_tokens"])
    assert counts[0] > counts[1] > counts[2]


async def test_omitted_thinking_comes_back_empty_and_signed(client, script):
    script(THINK_THEN_CALL)
    shown = body(tools=[WEATHER_TOOL], thinking={"type": "adaptive", "display": "summarized"}, max_tokens=2048)
    omitted = {**shown, "thinking": {"type": "adaptive", "display": "omitted"}}
    _, whole = await post(client, shown)
    _, hidden = await post(client, omitted)
    assert whole["content"][0]["thinking"] == THOUGHT
    assert hidden["content"][0] == {"type": "thinking", "thinking": "", "signature": whole["content"][0]["signature"]}
    assert [b["type"] for b in hidden["content"]] == ["thinking", "text", "tool_use"]
    r = await client.post("/v1/messages", json={**omitted, "stream": True}, headers=HEADERS)
    events = events_of(await r.get_data(as_text=True))
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    assert content_of(events)[0] == hidden["content"][0]


async def test_effort_sets_the_thinking_switch_when_thinking_is_absent(atom):
    # a server whose default turns thinking off, so that effort visibly turns it on
    ctx = dataclasses.replace(atom.runtime.prepare_ctx, default_chat_template_kwargs={"enable_thinking": False})
    plain = {k: v for k, v in body().items() if k != "thinking"}
    closed, opened = "<think>\n\n</think>\n\n", "<|im_start|>assistant\n<think>\n"
    assert rendered(atom, plain, ctx).endswith(closed)
    assert rendered(atom, {**plain, "output_config": {"effort": "low"}}, ctx).endswith(opened)
    assert rendered(atom, body(output_config={"effort": "max"}), ctx).endswith(closed)  # thinking disabled wins


async def test_server_tools_are_accepted_not_offered_and_logged_once(client):
    bash = {"type": "bash_20250124", "name": "bash"}
    count = {"model": MODEL, "messages": USER}

    async def tokens(**fields: Any) -> int:
        status, got = await post(client, {**count, **fields}, "/v1/messages/count_tokens")
        assert status == 200, got
        return got["input_tokens"]

    assert await tokens(tools=[WEATHER_TOOL, WEB_SEARCH, bash]) == await tokens(tools=[WEATHER_TOOL])
    assert await tokens(tools=[WEB_SEARCH, bash]) == await tokens()
    with capture_logs() as logs:
        for _ in range(2):
            status, _msg = await post(client, body(tools=[bash, WEATHER_TOOL, WEB_SEARCH]))
            assert status == 200
    [line] = [e for e in logs if e["event"] == "anthropic.not_applied"]
    assert line["features"] == ["server tool bash (bash_20250124)", "server tool web_search (web_search_20250305)"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"system": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]},
            "system.0.cache_control.ttl",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "x"}}]}
                ]
            },
            "block 0.cache_control.type",
        ),
        (
            {"tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral", "ttl": "1d"}}]},
            "tools.0.cache_control.ttl",
        ),
        ({"tools": [{"name": "no_schema"}]}, "input_schema"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
        ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
        ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "some"}]}}, "keep"),
    ],
)
async def test_bad_claude_code_fields_are_a_400_naming_the_field(client, fields, named):
    status, err = await post(client, body(**fields))
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert named in err["error"]["message"], err


async def test_sdk_beta_stream_of_a_claude_code_request(sdk, script):
    script(THINK_THEN_CALL)
    fields = {k: v for k, v in claude_code_body().items() if k != "stream"}
    async with sdk.beta.messages.stream(
        **fields, betas=CLAUDE_CODE_BETAS, extra_headers={"X-Claude-Code-Session-Id": SESSION_ID}
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert "signature" in kinds and "thinking" not in kinds  # omitted: no thinking deltas
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "" and final.content[0].signature
    assert final.stop_reason == "tool_use"


async def test_claude_codes_session_and_cache_control_set_the_kv_lease(client, atom):
    """The turn's KV is leased for its session (the header Claude Code sends) for cache_control's ttl."""
    bm = atom.runtime.engine.block_manager
    long_history = [{"role": "user", "content": "river " * 200}]
    cached = {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    headers = {**HEADERS, "X-Claude-Code-Session-Id": "session-7"}
    status, _ = await post(client, body(messages=long_history, system=[cached]), headers=headers)
    assert status == 200
    lease = bm.leases["session-7"]
    assert lease.block_ids and 3500 < lease.expiry - bm.clock() <= 3600
    status, _ = await post(client, body(messages=long_history, metadata={"user_id": '{"session_id": "s-8"}'}))
    assert status == 200
    lease = bm.leases['{"session_id": "s-8"}']  # no cache_control: the server's TTL
    assert lease.expiry - bm.clock() <= atom.runtime.config.engine.kv_lease_ttl_s


def test_a_malformed_tool_call_streams_in_order_however_the_deltas_fall():
    """Many tokens to a delta (a verified draft's) can announce a call and prove it malformed at once:
    at every pair of cut points the blocks are the call's tool_use block, then its text, and never a
    call's delta after its own text. Before the parser's ordered pieces, a call whose deltas and text
    came in one delta got its tool_use block after the text, and cuts at 1 and 50 failed the stream."""
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
    spec = ParserSpec(None, "hermes")
    for i in range(1, len(broken)):
        for j in range(i, len(broken) + 1):
            blocks = ContentBlocks(OutputParser(spec, False, parse_tools=True))
            events = [e for part in (broken[:i], broken[i:j], broken[j:]) if part for e in blocks.feed(part)]
            events += blocks.finish(is_cut=False)
            kinds = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
            assert kinds in (["text"], ["tool_use", "text"]), (i, j, kinds)
            text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
            assert text == broken and blocks.content == [{"type": "text", "text": broken}], (i, j)
