"""Constrained output ends (issue 24): the default model, SmolLM2-135M, as the server loads it at
its defaults (``auto``: bfloat16 where the CPU has it natively, float32 elsewhere), sampled at
temperature 1.0 under forced tool calls and JSON schemas, through the official SDKs over real
hypercorn, 20 seeds a check (Responses and Anthropic take the seed as an extension, in
``extra_body``). Every check's samples run in one engine batch, once for the module; each test
reads its own.

The grammar leaves the model no whitespace to pad with and no number to run on, and lets it stop
after any complete call; a string stays unbounded, and in its last tokens the wind-down closes
the output in time (a string cut short). So every sample ends complete: parseable calls, never
markup in the text, and objects the SDKs' parse helpers return.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import anyio
import jsonschema
import openai
import pydantic
import pytest
from support_servers import served_over_http, serving_app

from atom_anyio.models.loader import load_model

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SEEDS = range(20)
QUESTION = "What is the weather in Oslo?"
CITY_PROMPT = "Give me a city: name, country and population."
PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "get_time": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
}
DESCRIPTIONS = {"get_weather": "Get the current weather in a city.", "get_time": "The time in a timezone."}
NAMED = "get_weather"


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


@dataclass(frozen=True)
class Server:
    """The served model, and one client of each SDK that every sample shares (an SDK client per
    sample loaded the CA bundle 200 times: 5 s of the event loop before the first request)."""

    model: str
    openai: openai.AsyncOpenAI
    anthropic: anthropic.AsyncAnthropic


@dataclass
class Calls:
    is_cut: bool  # the output ran out of tokens
    text: str
    calls: list[tuple[str, str]]  # name, arguments (JSON text; Anthropic's input dumped)


@dataclass
class Parsed:
    is_cut: bool
    text: str
    parsed: City | None  # what the SDK's parse helper returned; None when it raised


# one sample per API: forced tool calls


async def chat(server: Server, seed: int, **body: Any) -> Calls:
    tools = [
        {"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": p}}
        for n, p in PARAMETERS.items()
    ]
    messages = [{"role": "user", "content": QUESTION}]
    out = await server.openai.chat.completions.create(
        model=server.model, messages=messages, tools=tools, temperature=1.0, seed=seed, max_tokens=100, **body
    )
    if body.get("stream"):
        return await joined(out)
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return Calls(choice.finish_reason == "length", choice.message.content or "", calls)


async def joined(stream: Any) -> Calls:
    """A streamed chat choice as a client joins it: content, and each call's name and fragments."""
    text, calls, finish = "", {}, None
    async for chunk in stream:
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        text += delta.content or ""
        for t in delta.tool_calls or []:
            name, arguments = calls.get(t.index, (t.function.name, ""))
            calls[t.index] = (name, arguments + (t.function.arguments or ""))
    assert finish in ("tool_calls", "length"), finish
    return Calls(finish == "length", text, [calls[i] for i in sorted(calls)])


async def responses(server: Server, seed: int, **body: Any) -> Calls:
    tools = [
        {"type": "function", "name": n, "description": DESCRIPTIONS[n], "parameters": p} for n, p in PARAMETERS.items()
    ]
    out = await server.openai.responses.create(
        model=server.model,
        input=QUESTION,
        tools=tools,
        temperature=1.0,
        max_output_tokens=100,
        extra_body={"seed": seed},
        **body,
    )
    calls = [(item.name, item.arguments) for item in out.output if item.type == "function_call"]
    return Calls(out.status == "incomplete", out.output_text, calls)


async def messages(server: Server, seed: int, **body: Any) -> Calls:
    tools = [{"name": n, "description": DESCRIPTIONS[n], "input_schema": p} for n, p in PARAMETERS.items()]
    out = await server.anthropic.messages.create(
        model=server.model,
        max_tokens=100,
        messages=[{"role": "user", "content": QUESTION}],
        tools=tools,
        extra_body={"temperature": 1.0, "seed": seed},  # this SDK version takes no temperature argument
        **body,
    )
    assert out.stop_reason in ("tool_use", "max_tokens"), out
    calls = [(b.name, json.dumps(b.input)) for b in out.content if b.type == "tool_use"]
    return Calls(out.stop_reason == "max_tokens", "".join(b.text for b in out.content if b.type == "text"), calls)


# one sample per API: JSON from a pydantic model, through the SDKs' parse helpers


async def chat_parse(server: Server, seed: int) -> Parsed:
    raw = await server.openai.chat.completions.with_raw_response.parse(
        model=server.model,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        temperature=1.0,
        seed=seed,
        max_tokens=300,
    )
    choice = json.loads(raw.http_response.text)["choices"][0]
    try:
        parsed = raw.parse().choices[0].message.parsed
    except openai.LengthFinishReasonError:
        parsed = None
    return Parsed(choice["finish_reason"] == "length", choice["message"]["content"], parsed)


async def responses_parse(server: Server, seed: int) -> Parsed:
    raw = await server.openai.responses.with_raw_response.parse(
        model=server.model,
        input=CITY_PROMPT,
        text_format=City,
        temperature=1.0,
        max_output_tokens=300,
        extra_body={"seed": seed},
    )
    body = json.loads(raw.http_response.text)
    try:
        parsed = raw.parse().output_parsed
    except pydantic.ValidationError:
        parsed = None
    text = "".join(part["text"] for item in body["output"] for part in item["content"])
    return Parsed(body["status"] == "incomplete", text, parsed)


@dataclass(frozen=True)
class Check:
    sample: Callable[..., Awaitable[Any]]
    body: dict[str, Any]
    num_calls: int | None = None  # exactly this many calls (None: one or more)
    named: str | None = None  # the only tool it may call


CALL_CHECKS = {
    "chat-required-parallel": Check(chat, {"tool_choice": "required"}),
    "chat-required-parallel-streamed": Check(chat, {"tool_choice": "required", "stream": True}),
    "chat-required-one": Check(chat, {"tool_choice": "required", "parallel_tool_calls": False}, num_calls=1),
    "chat-named": Check(chat, {"tool_choice": {"type": "function", "function": {"name": NAMED}}}, 1, NAMED),
    "responses-required-parallel": Check(responses, {"tool_choice": "required"}),
    "responses-named": Check(responses, {"tool_choice": {"type": "function", "name": NAMED}}, 1, NAMED),
    "messages-any-parallel": Check(messages, {"tool_choice": {"type": "any"}}),
    "messages-tool": Check(messages, {"tool_choice": {"type": "tool", "name": NAMED}}, 1, NAMED),
}
PARSE_CHECKS = {"chat-parse": Check(chat_parse, {}), "responses-parse": Check(responses_parse, {})}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # Quart is asyncio-only


@pytest.fixture(scope="module")
async def samples(smollm2_path) -> dict[str, list[Any]]:
    """Every check's sample for every seed, all in flight together."""
    out: dict[str, dict[int, Any]] = {name: {} for name in CALL_CHECKS | PARSE_CHECKS}

    async def one(server: Server, name: str, check: Check, seed: int) -> None:
        out[name][seed] = await check.sample(server, seed, **check.body)

    async with (
        serving_app(load_model(None, "auto"), kv_cache_gib=0.5) as atom,
        served_over_http(atom) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as oa,
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as an,
    ):
        server = Server(atom.runtime.model_name, oa, an)
        async with anyio.create_task_group() as tg:
            for name, check in (CALL_CHECKS | PARSE_CHECKS).items():
                for seed in SEEDS:
                    tg.start_soon(one, server, name, check, seed)
    return {name: [by_seed[seed] for seed in SEEDS] for name, by_seed in out.items()}


def check_compact(text: str) -> None:
    """Outside its strings, JSON text has one space after each ``,`` and ``:`` and no other
    whitespace, and no part of a number is longer than 16 digits."""
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', text)
    assert not re.search(r"(?<![,:])\s|\s\s", skeleton), text
    assert all(len(digits) <= 16 for digits in re.findall(r"\d+", skeleton)), text


@pytest.mark.parametrize("name", CALL_CHECKS)
async def test_a_forced_call_always_ends_with_parseable_calls_and_no_markup_in_the_text(samples, name):
    check = CALL_CHECKS[name]
    for out in samples[name]:
        assert not out.is_cut and out.text == "" and out.calls, out
        assert check.num_calls in (None, len(out.calls)), out
        if check.named is not None:
            assert {tool for tool, _ in out.calls} == {check.named}, out
        for tool, arguments in out.calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[tool])
            check_compact(arguments)


@pytest.mark.parametrize("name", PARSE_CHECKS)
async def test_a_pydantic_object_always_parses_within_300_tokens(samples, name):
    for out in samples[name]:
        check_compact(out.text)
        assert not out.is_cut and isinstance(out.parsed, City), out
