"""Chat completions with reasoning and tool calls: the Qwen3-style test template, the tiny model,
the real engine, detokenizer, parsers and Quart app.

A random tiny model never writes a tool call by itself, so these tests install a scripted sampler:
a fake at the model boundary that picks the next token of a fixed text (then EOS) instead of
sampling the logits. Everything after the sampler is real.
"""

from __future__ import annotations

import json
import re

import pytest
from support_fakes import FakeSampler, scripted
from support_servers import serving_app

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.templates import template_path

pytestmark = pytest.mark.anyio

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>'


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # Quart is asyncio-only


def chat_app(tiny_model):
    return serving_app(tiny_model, kv_cache_gib=0.05, chat_template=template_path("qwen3_tools"))


@pytest.fixture
async def app(tiny_model):
    async with chat_app(tiny_model) as atom:
        yield atom


async def chat(atom: AtomApp, **body) -> dict:
    r = await atom.quart.test_client().post("/v1/chat/completions", json={"messages": USER, "max_tokens": 200, **body})
    assert r.status_code == 200, await r.get_data(as_text=True)
    return await r.get_json()


async def chat_stream(atom: AtomApp, **body) -> list[dict]:
    body = {"messages": USER, "max_tokens": 200, "stream": True, **body}
    r = await atom.quart.test_client().post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in (await r.get_data(as_text=True)).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


async def test_a_tool_call_comes_back_as_message_tool_calls(app):
    with scripted(app, CALL):
        body = await chat(app, tools=[WEATHER_TOOL], chat_template_kwargs=NO_THINKING)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == len("call_") + 24
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}


async def test_a_streamed_tool_call_sends_the_name_then_argument_fragments(app):
    with scripted(app, f"The user wants the weather.\n</think>\n\n{CALL}"):
        chunks = await chat_stream(app, tools=[WEATHER_TOOL])  # thinking on: the prompt ends inside <think>
    assert joined(chunks, "reasoning_content") == "The user wants the weather."
    assert joined(chunks, "content") == ""
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in rest)
    fragments = [tc["function"]["arguments"] for tc in calls]
    assert len([f for f in fragments if f]) > 1 and "".join(fragments) == ARGUMENTS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(tag in json.dumps(chunks) for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"))


async def test_reasoning_content_in_the_message_and_in_stream_deltas(app):
    text = "Paris is in France.\n</think>\n\nIt is sunny in Paris."
    with scripted(app, text):
        body = await chat(app)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Paris is in France."
    assert message["content"] == "It is sunny in Paris." and "tool_calls" not in message
    assert body["choices"][0]["finish_reason"] == "stop"
    with scripted(app, text):
        chunks = await chat_stream(app)
    assert joined(chunks, "reasoning_content") == "Paris is in France."
    assert joined(chunks, "content") == "It is sunny in Paris."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", ["none", None])
async def test_without_tool_parsing_tool_syntax_is_plain_content(app, tool_choice):
    body = {"chat_template_kwargs": NO_THINKING}
    if tool_choice is not None:
        body |= {"tools": [WEATHER_TOOL], "tool_choice": tool_choice}
    with scripted(app, CALL):
        choice = (await chat(app, **body))["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    with scripted(app, CALL):
        chunks = await chat_stream(app, **body)
    assert joined(chunks, "content") == CALL and "tool_calls" not in json.dumps(chunks)


async def test_a_malformed_call_comes_back_as_content(app):
    malformed = '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>'
    with scripted(app, malformed):
        choice = (await chat(app, tools=[WEATHER_TOOL], chat_template_kwargs=NO_THINKING))["choices"][0]
    assert choice["message"]["content"] == malformed and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    with scripted(app, malformed):
        chunks = await chat_stream(app, tools=[WEATHER_TOOL], chat_template_kwargs=NO_THINKING)
    assert joined(chunks, "content") == malformed and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_text_before_a_call_is_content_and_a_call_cut_before_its_name_is_dropped(app):
    with scripted(app, f"Let me look that up. {CALL}"):
        message = (await chat(app, tools=[WEATHER_TOOL], chat_template_kwargs=NO_THINKING))["choices"][0]["message"]
    assert message["content"] == "Let me look that up. " and len(message["tool_calls"]) == 1
    with scripted(app, f"Let me look that up. {CALL}"):
        choice = (await chat(app, tools=[WEATHER_TOOL], chat_template_kwargs=NO_THINKING, max_tokens=12))["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "Let me look that up. "  # the cut markup is no content


async def test_an_assistant_tool_call_and_its_result_render_through_the_template(app):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    client = app.quart.test_client()
    r = await client.post("/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]})
    tokenized = await r.get_json()
    prompt = app.runtime.loaded.tokenizer.decode(tokenized["tokens"])
    assert f"<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n{CALL}<|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>" in prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    with scripted(app, "The tool says sunny.\n</think>\n\nIt is sunny, 24 C."):
        body = await chat(app, messages=messages, tools=[WEATHER_TOOL])
    assert body["usage"]["prompt_tokens"] == tokenized["count"]
    assert body["choices"][0]["message"]["content"] == "It is sunny, 24 C."
    assert body["choices"][0]["message"]["reasoning_content"] == "The tool says sunny."


async def test_the_parser_flags_override_the_template(tiny_model):
    config = Config.of(
        kv_cache_gib=0.05, chat_template=template_path("qwen3_tools"), reasoning_parser="none", tool_call_parser="none"
    )
    atom = AtomApp(config, loaded=tiny_model, sampler=FakeSampler())
    async with atom.serving():
        with scripted(atom, f"Thoughts.\n</think>\n\n{CALL}"):
            message = (await chat(atom, tools=[WEATHER_TOOL]))["choices"][0]["message"]
    assert message["content"] == f"Thoughts.\n</think>\n\n{CALL}" and message["reasoning_content"] is None


async def test_openai_sdk_chat_with_tools_and_streamed_reasoning_over_http(app):
    """The official SDK against real hypercorn: a tool-call round trip and streamed reasoning_content."""
    import openai
    from support_servers import served_over_http

    thought = "The user wants the weather, so I call the tool."
    async with served_over_http(app) as base_url:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = app.runtime.model_name
        with scripted(app, f"{thought}\n</think>\n\n{CALL}"):  # the prompt opened the <think>
            first = await client.chat.completions.create(model=model, messages=USER, tools=[WEATHER_TOOL])
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.reasoning_content == thought
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(ARGUMENTS)

        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
        ]
        with scripted(app, f"{thought}\n</think>\n\nIt is 21 degrees in Paris."):
            stream = await client.chat.completions.create(
                model=model, messages=history, tools=[WEATHER_TOOL], stream=True
            )
            chunks = [chunk async for chunk in stream]
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert reasoning == thought and content == "It is 21 degrees in Paris."
        assert chunks[-1].choices[0].finish_reason == "stop"
        await client.close()


# tools with default flags on a template that reads none (SmolLM2's): the default Hermes format

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
BOUNDED_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]


@pytest.fixture(scope="module")
async def smol(tiny_model):
    """Default flags and the tokenizer's own template (SmolLM2's, which reads no tools)."""
    async with serving_app(tiny_model, kv_cache_gib=0.05) as atom:
        yield atom


async def rendered(atom: AtomApp, messages: list[dict], **body) -> str:
    r = await atom.quart.test_client().post("/tokenize", json={"messages": messages, **body})
    assert r.status_code == 200, await r.get_data(as_text=True)
    return atom.runtime.loaded.tokenizer.decode((await r.get_json())["tokens"])


async def test_default_flags_list_the_tools_in_a_system_block(smol):
    prompt = await rendered(smol, USER, tools=[WEATHER_TOOL])
    assert prompt.startswith("<|im_start|>system\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in prompt
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call><|im_end|>' in prompt
    )
    assert prompt.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    with_system = await rendered(smol, [{"role": "system", "content": "Be brief."}, *USER], tools=[WEATHER_TOOL])
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert "<tools>" not in await rendered(smol, USER)


async def test_default_flags_render_tool_calls_and_results_as_text(smol):
    for tools in ([WEATHER_TOOL], None):
        prompt = await rendered(smol, HISTORY, **({"tools": tools} if tools else {}))
        assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in prompt
        responses = "<tool_response>\nsunny, 24 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
        assert f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n" in prompt
        assert ("<tools>" in prompt) == bool(tools)


async def test_default_flags_parse_a_hermes_call_streamed_and_not(smol):
    with scripted(smol, CALL):
        choice = (await chat(smol, tools=[WEATHER_TOOL]))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    with scripted(smol, f"Checking. {CALL}"):
        chunks = await chat_stream(smol, tools=[WEATHER_TOOL])
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(t["function"]["arguments"] for t in calls) == ARGUMENTS
    assert joined(chunks, "content") == "Checking. " and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_default_flags_parse_parallel_calls(smol):
    with scripted(smol, f"{CALL}\n{TIME_CALL}"):
        message = (await chat(smol, tools=[WEATHER_TOOL, TIME_TOOL]))["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"zone": "CET"}


async def test_default_flags_enforce_required_and_named_tool_choice(smol):
    """The real sampler under the grammar: the random tiny model must still call a tool."""
    tools = [BOUNDED_WEATHER_TOOL, TIME_TOOL]
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}]):
        body = await chat(smol, tools=tools, tool_choice=choice, parallel_tool_calls=False, seed=seed)
        message = body["choices"][0]["message"]
        assert body["choices"][0]["finish_reason"] == "tool_calls", body
        [call] = message["tool_calls"]
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        if choice != "required":
            assert call["function"]["name"] == "get_time"
            assert re.fullmatch("[A-Z]{3}", json.loads(call["function"]["arguments"])["zone"])


async def test_default_flags_responses_call_and_force_tools(smol):
    tools = [{"type": "function", **t["function"]} for t in [BOUNDED_WEATHER_TOOL, TIME_TOOL]]
    client = smol.quart.test_client()
    body = {"input": "What is the weather in Paris?", "tools": tools, "max_output_tokens": 200}
    with scripted(smol, CALL):
        out = await (await client.post("/v1/responses", json=body)).get_json()
    [call] = [item for item in out["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["arguments"] == ARGUMENTS
    forced = {**body, "tool_choice": {"type": "function", "name": "get_time"}, "seed": 0}
    out = await (await client.post("/v1/responses", json=forced)).get_json()
    assert [item["name"] for item in out["output"] if item["type"] == "function_call"] == ["get_time"], out


async def test_default_flags_anthropic_tools_auto_any_and_tool(smol):
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in [BOUNDED_WEATHER_TOOL, TIME_TOOL]
    ]
    body = {"model": smol.runtime.model_name, "max_tokens": 200, "messages": USER, "tools": tools}
    client = smol.quart.test_client()
    with scripted(smol, CALL):
        out = await (await client.post("/v1/messages", json=body)).get_json()
    assert out["stop_reason"] == "tool_use", out
    [use] = [b for b in out["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["input"] == json.loads(ARGUMENTS)
    for choice in [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_time"}]:
        r = await client.post("/v1/messages", json={**body, "tool_choice": choice, "temperature": 0})
        out = await r.get_json()
        assert r.status_code == 200 and out["stop_reason"] == "tool_use", out
        uses = [b for b in out["content"] if b["type"] == "tool_use"]
        assert len(uses) == 1 and (choice["type"] == "any" or uses[0]["name"] == "get_time")


async def test_default_flags_sdk_clients_receive_structured_tool_calls_over_http(smol):
    import anthropic
    import openai
    from support_servers import served_over_http

    async with served_over_http(smol) as base_url:
        oa = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        model = smol.runtime.model_name
        with scripted(smol, CALL):
            first = await oa.chat.completions.create(model=model, messages=USER, tools=[WEATHER_TOOL])
        [call] = first.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(ARGUMENTS)
        with scripted(smol, CALL):
            stream = await oa.chat.completions.create(model=model, messages=USER, tools=[WEATHER_TOOL], stream=True)
            deltas = [
                t
                for chunk in [c async for c in stream]
                if chunk.choices
                for t in chunk.choices[0].delta.tool_calls or []
            ]
        assert deltas[0].function.name == "get_weather"
        assert json.loads("".join(d.function.arguments for d in deltas)) == json.loads(ARGUMENTS)
        await oa.close()

        tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0) as an:
            with scripted(smol, CALL):
                message = await an.messages.create(model=model, max_tokens=200, messages=USER, tools=tools)
            assert message.stop_reason == "tool_use"
            [use] = [b for b in message.content if b.type == "tool_use"]
            assert use.name == "get_weather" and use.input == json.loads(ARGUMENTS)
            with scripted(smol, CALL):
                async with an.messages.stream(model=model, max_tokens=200, messages=USER, tools=tools) as stream:
                    streamed = await stream.get_final_message()
            [use] = [b for b in streamed.content if b.type == "tool_use"]
            assert use.name == "get_weather" and use.input == json.loads(ARGUMENTS)


def cut_inside_the_unit(tokenizer) -> tuple[int, str]:
    """The fewest tokens of CALL that reach inside the unit's string, and the arguments they hold
    (SmolLM2's tokenizer: 28 tokens, ``{"city": "Paris", "unit": "c``)."""
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    opened = CALL.index('"unit": "') + len('"unit": "')
    num_tokens = next(n for n in range(len(ids)) if len(tokenizer.decode(ids[:n])) > opened)
    arguments = tokenizer.decode(ids[:num_tokens])[CALL.index(ARGUMENTS) :]
    assert ARGUMENTS.startswith(arguments) and not arguments.endswith('"'), arguments  # the string still open
    return num_tokens, arguments


async def test_a_call_cut_by_max_tokens_is_a_cut_tool_call_in_every_api_never_content(smol):
    """As OpenAI reports a truncated call: finish_reason length and the call with the arguments so
    far; Responses an incomplete function_call item; Anthropic a tool_use block with what its JSON
    holds. Streamed or not, the markup never reaches the text."""
    import anthropic
    import openai
    from support_servers import served_over_http

    model = smol.runtime.model_name
    cut_at, cut_arguments = cut_inside_the_unit(smol.runtime.loaded.tokenizer)
    async with served_over_http(smol) as base_url:
        oa = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        body = {"model": model, "messages": USER, "tools": [WEATHER_TOOL], "max_tokens": cut_at}
        with scripted(smol, CALL):
            first = await oa.chat.completions.create(**body)
        [call] = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "length" and first.choices[0].message.content is None
        assert call.function.name == "get_weather" and call.function.arguments == cut_arguments
        with scripted(smol, CALL):
            chunks = [c async for c in await oa.chat.completions.create(**body, stream=True) if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == "get_weather" and {t.index for t in deltas} == {0}
        assert "".join(t.function.arguments or "" for t in deltas) == cut_arguments
        assert chunks[-1].choices[0].finish_reason == "length"

        tools = [{"type": "function", **WEATHER_TOOL["function"]}]
        with scripted(smol, CALL):
            response = await oa.responses.create(model=model, input="Weather?", tools=tools, max_output_tokens=cut_at)
        assert response.status == "incomplete" and response.output_text == ""
        [item] = response.output
        assert item.type == "function_call" and item.status == "incomplete" and item.arguments == cut_arguments
        await oa.close()

        tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0) as an:
            body = {"model": model, "max_tokens": cut_at, "messages": USER, "tools": tools}
            with scripted(smol, CALL):
                message = await an.messages.create(**body)
            with scripted(smol, CALL):
                async with an.messages.stream(**body) as stream:
                    streamed = await stream.get_final_message()
        for m in (message, streamed):
            assert m.stop_reason == "max_tokens"
            [use] = m.content
            assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}


def test_smollm2_renders_tools_in_the_default_format(smollm2_path):
    """SmolLM2's real tokenizer and template, through the same prepare path a request takes."""
    from atom_anyio.models.gguf_file import load_gguf_tokenizer
    from atom_anyio.prompt.prepare import PrepareContext, PromptRequest, prepare_prompt
    from atom_anyio.prompt.segment_cache import SegmentCache

    tokenizer = load_gguf_tokenizer(smollm2_path)
    ctx = PrepareContext(tokenizer=tokenizer, segment_cache=SegmentCache(tokenizer), max_model_len=8192, block_size=16)
    assert not ctx.reads_tools([WEATHER_TOOL])
    text = prepare_prompt(PromptRequest(messages=HISTORY[:2], tools=[WEATHER_TOOL]), ctx).text
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to help with the user's request. "
        "The functions are listed as JSON schemas within <tools></tools> tags:\n"
        f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> tags, "
        'one block per call:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
