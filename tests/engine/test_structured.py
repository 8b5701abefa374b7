"""Structured outputs: every output of a tiny random model, sampled at temperature 1.0, follows the
request's grammar (JSON schema, JSON object, regex, choice, EBNF, forced tool calls). The model
cannot produce valid output by itself, so each pass is the grammar's doing. The real engine,
sampler, xgrammar matchers, parsers and Quart app run throughout.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading
from typing import Any

import anyio
import jsonschema
import openai
import pydantic
import pytest
import xgrammar as xgr
from support_fakes import HookedSegmentCache, scripted
from support_servers import served_over_http, serving_app

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import Constraint, Grammars
from atom_anyio.engine.request import EngineRequest
from atom_anyio.parse.tool_calls import ToolParser
from atom_anyio.parse.tool_grammar import forced_tool_calls_tag
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs
from atom_anyio.templates import template_path

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Answer in the requested format."}]
NO_THINKING = {"enable_thinking": False}
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # Quart is asyncio-only


def serve(tiny_model, **config: Any):
    return serving_app(tiny_model, **{"kv_cache_gib": 0.1, "max_model_len": 4096, **config})


@pytest.fixture(scope="module")
async def atom(tiny_model):
    async with serve(tiny_model) as app:
        yield app


@pytest.fixture(scope="module")
async def qwen(tiny_model):
    """The Qwen3-style template: hermes tool calls, and a prompt that opens <think> unless thinking is off."""
    async with serve(tiny_model, chat_template=template_path("qwen3_tools")) as app:
        yield app


async def post(atom: AtomApp, path: str, body: dict) -> tuple[int, dict]:
    r = await atom.quart.test_client().post(path, json=body)
    return r.status_code, await r.get_json()


async def chat(atom: AtomApp, **body: Any) -> dict:
    status, out = await post(atom, "/v1/chat/completions", {"messages": USER, "max_tokens": MAX_TOKENS, **body})
    assert status == 200, out
    return out


# fifty-odd schemas, each bounded so that output the grammar forces ends well within MAX_TOKENS

LEAVES: list[dict[str, Any]] = [
    {"type": "integer", "minimum": -5, "maximum": 50},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "maxLength": 8},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"type": "boolean"},
    {"type": "null"},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[a-z]{1,6}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]},
    {"type": ["string", "null"], "maxLength": 3},
]


def random_object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "tags", "score", "kind", "ok", "size", "note", "code"], rng.randint(1, 4))
    props: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if depth > 0 and roll < 0.2:
            props[name] = random_object(rng, depth - 1)
        elif depth > 0 and roll < 0.3:
            props[name] = {"type": "array", "items": random_object(rng, depth - 1), "maxItems": 2}
        else:
            props[name] = rng.choice(LEAVES)
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


PYDANTIC_STYLE = {
    "$defs": {
        "Point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        }
    },
    "type": "object",
    "properties": {
        "origin": {"$ref": "#/$defs/Point"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 2},
        "label": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    },
    "required": ["origin", "path", "label"],
}
SCHEMAS = [random_object(random.Random(i), depth=2) for i in range(48)] + [
    PYDANTIC_STYLE,
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
]


def schema_request(i: int, schema: dict) -> tuple[str, dict]:
    """Rotate the ways to ask: chat response_format, chat structured_outputs, completions guided_json,
    Responses text.format."""
    sampling = {"temperature": 1.0, "seed": i, "max_tokens": MAX_TOKENS}
    if i % 4 == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        return "/v1/chat/completions", {"messages": USER, "response_format": fmt, **sampling}
    if i % 4 == 1:
        return "/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": schema}, **sampling}
    if i % 4 == 2:
        return "/v1/completions", {"prompt": f"Item {i}:", "guided_json": schema, **sampling}
    fmt = {"type": "json_schema", "name": f"s{i}", "schema": schema, "strict": True}
    return "/v1/responses", {"input": "Answer.", "text": {"format": fmt}, "temperature": 1.0, "max_output_tokens": 400}


def text_of(out: dict) -> str:
    if "output" in out:  # a Response
        return "".join(part["text"] for item in out["output"] for part in item["content"])
    choice = out["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def finish_of(out: dict) -> str:
    return (
        {"completed": "stop"}.get(out["status"], out["status"])
        if "output" in out
        else out["choices"][0]["finish_reason"]
    )


async def test_fifty_schemas_sampled_at_temperature_one_all_validate(atom):
    assert len(SCHEMAS) >= 50
    results: dict[int, tuple[int, dict]] = {}

    async def one(i: int) -> None:
        results[i] = await post(atom, *schema_request(i, SCHEMAS[i]))

    async with anyio.create_task_group() as tg:  # one engine batch: all in flight together
        for i in range(len(SCHEMAS)):
            tg.start_soon(one, i)
    for i, schema in enumerate(SCHEMAS):
        status, out = results[i]
        assert status == 200, out
        assert finish_of(out) == "stop", (i, out)
        jsonschema.validate(json.loads(text_of(out)), schema)


async def test_regex_outputs_fullmatch(atom):
    pattern = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
    for seed in range(4):
        out = await chat(atom, guided_regex=pattern, temperature=1.0, seed=seed)
        assert re.fullmatch(pattern, text_of(out)), text_of(out)
        status, out = await post(
            atom, "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": pattern}, "seed": seed}
        )
        assert status == 200 and re.fullmatch(pattern, text_of(out)), out


async def test_choice_output_is_one_of_the_choices(atom):
    choices = ["yes", "no", 'it "depends"', "ça va"]
    seen = set()
    for seed in range(8):
        out = await chat(atom, guided_choice=choices, temperature=1.0, seed=seed)
        assert text_of(out) in choices
        seen.add(text_of(out))
    assert len(seen) > 1  # the model chooses; the grammar only bounds it


async def test_ebnf_grammar_output_is_in_its_language(atom):
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(4):
        out = await chat(atom, structured_outputs={"grammar": grammar}, temperature=1.0, seed=seed)
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text_of(out)), text_of(out)


async def test_json_object_output_parses_to_an_object(atom):
    for seed in range(3):
        out = await chat(atom, response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=300)
        if out["choices"][0]["finish_reason"] == "stop":  # an unbounded object may run out of tokens
            assert isinstance(json.loads(text_of(out)), dict)
        else:
            assert text_of(out).startswith("{")


async def test_n_choices_each_follow_the_grammar(atom):
    out = await chat(atom, guided_choice=["alpha", "beta", "gamma"], n=6, temperature=1.0, seed=3)
    assert all(c["message"]["content"] in ("alpha", "beta", "gamma") for c in out["choices"])


async def test_a_finished_grammar_ends_the_output_even_with_ignore_eos(atom):
    out = await chat(atom, guided_choice=["done"], ignore_eos=True, max_tokens=50)
    assert text_of(out) == "done" and out["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_of_masked_tokens_are_finite_json(atom):
    r = await atom.quart.test_client().post(
        "/v1/chat/completions",
        json={"messages": USER, "guided_choice": ["yes", "no"], "logprobs": True, "top_logprobs": 8, "temperature": 0},
    )
    body = await r.get_data(as_text=True)
    assert r.status_code == 200 and "Infinity" not in body
    content = json.loads(body)["choices"][0]["logprobs"]["content"]
    # the grammar allows fewer than five tokens at every step: the rest of each top eight is masked
    assert all(-9999.0 in [t["logprob"] for t in c["top_logprobs"]] for c in content)


async def test_min_tokens_does_not_hold_a_finished_grammar_open(atom):
    out = await chat(atom, guided_choice=["ok"], min_tokens=10, max_tokens=20)
    assert text_of(out) == "ok" and out["choices"][0]["finish_reason"] == "stop"


def test_bounded_json_strings_exclude_raw_control_characters(tiny_model):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    grammar = grammars.compile(StructuredOutputs("json", {"type": "string", "maxLength": 5}))
    assert xgr.GrammarMatcher(grammar).accept_string('"ab"')
    assert not xgr.GrammarMatcher(grammar).accept_string('"a\x11')  # json.loads refuses it
    assert not xgr.GrammarMatcher(grammar).accept_string('"a\n')


def accepts(grammar: xgr.CompiledGrammar, text: str, *, then_stops: bool = True) -> bool:
    """Whether ``text`` is in the grammar, and (``then_stops``) the output may end right after it."""
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and (not then_stops or matcher.accept_token(2))  # 2: the stop token


def test_each_part_of_a_json_number_has_at_most_sixteen_digits(tiny_model):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    tag = forced_tool_calls_tag("hermes", [tool], parallel=False)
    for spec, wrap in [
        (StructuredOutputs("json", schema), '{{"n": {}}}'),
        (StructuredOutputs("json", {"type": "integer", "minimum": 0}), "{}"),
        (
            StructuredOutputs("structural_tag", tag),
            '<tool_call>\n{{"name": "f", "arguments": {{"n": {}}}}}\n</tool_call>',
        ),
    ]:
        grammar = grammars.compile(spec)
        assert accepts(grammar, wrap.format("9" * 16)) and not accepts(grammar, wrap.format("9" * 17))
        if spec.value is schema:  # a fraction and an exponent too
            assert accepts(grammar, wrap.format(f"-1.{'5' * 16}e-{'3' * 16}"))
            assert not accepts(grammar, wrap.format(f"1.{'5' * 17}"))
            assert not accepts(grammar, wrap.format(f"1e{'3' * 17}"))
    digits = grammars.compile(StructuredOutputs("json", {"type": "string", "pattern": "^[0-9]*$"}))
    assert accepts(digits, f'"{"7" * 40}"')  # a string's pattern is its own


async def test_streamed_constrained_output_joins_to_valid_json(atom):
    schema = SCHEMAS[5]
    r = await atom.quart.test_client().post(
        "/v1/chat/completions",
        json={"messages": USER, "stream": True, "structured_outputs": {"json": schema}, "seed": 1, "max_tokens": 400},
    )
    body = await r.get_data(as_text=True)
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), schema)


# refused requests: 400 in each API's shape, naming the field


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
         "response_format.json_schema.schema", "keyword 'not'"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems'"),
        ({"guided_json": {"type": "number", "multipleOf": 0.5}}, "guided_json", "'multipleOf' on a non-integer"),
        ({"guided_json": {"$ref": "https://example.com/s.json"}}, "guided_json", "'$ref' to another document"),
        ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"if": {}}}}}},
         "structured_outputs.json", "'if' at 'properties.a'"),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "Lookbehind"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "not defined"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        # languages with no string in them compile, but no token can start them (a 500 until 2026-12-08)
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "admits no output"),
        ({"guided_grammar": "root ::= [^\\u0000-\\U0010FFFF]"}, "guided_grammar", "admits no output"),
        ({"guided_json": {"type": "string", "pattern": "[^\\s\\S]"}}, "guided_json", "admits no output"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "schema"),
    ],
)  # fmt: skip
async def test_unsupported_or_conflicting_constraints_are_a_400_naming_the_field(atom, body, param, needle):
    status, out = await post(atom, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body})
    assert status == 400, out
    assert out["error"]["param"] == param and needle in out["error"]["message"], out


async def test_a_grammar_that_dead_ends_mid_output_is_the_requests_fault_streamed_or_not(atom):
    """A JSON string whose pattern no character matches admits its opening quote and then nothing:
    the mask allows no token there. A 400 naming the field (an error event naming it once the stream
    began), never the 500 of a broken mask, and the engine serves the next request."""
    body = {"messages": USER, "max_tokens": 8, "guided_json": {"type": "string", "pattern": "[^\\s\\S]"}}
    status, out = await post(atom, "/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == "guided_json" and "admits no output" in out["error"]["message"], out
    r = await atom.quart.test_client().post("/v1/chat/completions", json={**body, "stream": True})
    events = [
        json.loads(line[6:]) for line in (await r.get_data(as_text=True)).splitlines() if line.startswith("data: {")
    ]
    assert r.status_code == 200 and events[-1]["error"]["param"] == "guided_json", events[-1]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    status, out = await post(atom, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out


async def test_responses_and_messages_refuse_in_their_own_shapes(qwen):
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object", "dependentRequired": {"a": ["b"]}}}
    status, out = await post(qwen, "/v1/responses", {"input": "hi", "text": {"format": fmt}})
    assert status == 400 and out["error"]["param"] == "text.format.schema"
    assert "dependentRequired" in out["error"]["message"]
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"not": {}}}}}
    body = {
        "model": qwen.runtime.model_name,
        "max_tokens": 8,
        "messages": USER,
        "tools": [tool],
        "tool_choice": {"type": "any"},
    }
    status, out = await post(qwen, "/v1/messages", body)
    assert status == 400 and out["type"] == "error", out
    assert out["error"]["type"] == "invalid_request_error" and "'not' at 'properties.a'" in out["error"]["message"]


async def test_a_forced_tool_with_an_unsupported_parameters_schema_is_a_400_naming_tools(qwen):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}
    body = {"messages": USER, "tools": [tool], "tool_choice": "required"}
    status, out = await post(qwen, "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "tools" and "'if'" in out["error"]["message"], out


async def test_compile_over_the_time_bound_is_a_400(tiny_model):
    async with serve(tiny_model, grammar_compile_timeout_s=1e-9) as atom:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}}
        status, out = await post(atom, "/v1/chat/completions", {"messages": USER, "guided_json": schema})
    assert status == 400, out
    assert out["error"]["param"] == "guided_json" and "exceeded" in out["error"]["message"]


async def test_forcing_a_tool_without_a_tool_call_format_is_a_400(tiny_model):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": USER, "tools": [tool], "tool_choice": "required"}
    async with serve(tiny_model, tool_call_parser="none") as atom:
        status, out = await post(atom, "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "tool_choice"


# forced tool calls

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}


def check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA_OF[call["function"]["name"]])


async def test_tool_choice_required_always_calls_a_tool_with_valid_arguments(qwen):
    for seed in range(4):
        out = await chat(qwen, tools=TOOLS, tool_choice="required", chat_template_kwargs=NO_THINKING, seed=seed)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        check_calls(choice["message"]["tool_calls"])


async def test_a_named_tool_choice_calls_exactly_that_tool(qwen):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        out = await chat(qwen, tools=TOOLS, tool_choice=named, chat_template_kwargs=NO_THINKING, seed=seed)
        calls = out["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_time"]
        check_calls(calls)


async def test_responses_and_messages_force_tool_calls(qwen):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    body = {"input": "hi", "tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}, "seed": 0}
    status, out = await post(qwen, "/v1/responses", {**body, "reasoning": {"effort": "none"}, "max_output_tokens": 400})
    assert status == 200, out
    calls = [i for i in out["output"] if i["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {
        "model": qwen.runtime.model_name,
        "max_tokens": 400,
        "messages": USER,
        "tools": anthropic_tools,
        "tool_choice": {"type": "any"},
        "thinking": {"type": "disabled"},
    }
    status, out = await post(qwen, "/v1/messages", body)
    assert status == 200 and out["stop_reason"] == "tool_use", out
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    assert uses
    for block in uses:
        jsonschema.validate(block["input"], SCHEMA_OF[block["name"]])
    status, out = await post(qwen, "/v1/messages", {**body, "tool_choice": {"type": "tool", "name": "get_time"}})
    assert status == 200 and out["stop_reason"] == "tool_use", out
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    assert [b["name"] for b in uses] == ["get_time"]
    jsonschema.validate(uses[0]["input"], TIME)


@pytest.mark.parametrize("tool_format", ["hermes", "llama3_json", "mistral"])
async def test_each_tool_format_grammar_round_trips_through_its_parser(tiny_model, tool_format):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    engine = Engine(tiny_model, EngineConfig(max_model_len=2048, kv_cache_gib=0.01))
    tag = forced_tool_calls_tag(tool_format, TOOLS, parallel=True)
    constraint = grammars.constraint(StructuredOutputs("structural_tag", tag))
    prompt = tiny_model.tokenizer.encode("call a tool")
    texts = await generate(
        engine, [(prompt, SamplingParams(seed=s, max_tokens=MAX_TOKENS), constraint) for s in range(4)]
    )
    for text, finish in texts:
        assert finish == "stop", text
        parser = ToolParser.for_format(tool_format)
        content = parser.feed(text)[0] + parser.finish()[0]
        assert not content.strip(), text
        check_calls([{"function": {"name": c.name, "arguments": c.arguments}} for c in parser.calls])


def test_forced_tool_calls_are_compact_json_and_may_end_after_any_complete_call(tiny_model):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    tag = forced_tool_calls_tag("hermes", TOOLS, parallel=True)
    grammar = grammars.compile(StructuredOutputs("structural_tag", tag))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    assert accepts(grammar, call) and accepts(grammar, f"{call}\n{call}")
    assert not accepts(grammar, call.replace('{"zone"', '{ "zone"'))
    assert not accepts(grammar, call.replace('"zone": ', '"zone":\n'))
    assert accepts(grammar, f"{call}\n")  # the newline after a call commits it to no other call
    assert accepts(grammar, f"{call}\n{call}\n")
    single = grammars.compile(
        StructuredOutputs("structural_tag", forced_tool_calls_tag("hermes", TOOLS, parallel=False))
    )
    assert accepts(single, f"{call}\n") and not accepts(single, f"{call}\n{call}", then_stops=False)


def test_a_structural_tag_that_sets_its_whitespace_keeps_it(tiny_model):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    content = {"type": "json_schema", "json_schema": TIME}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<t>", "content": content, "end": "</t>"}}
    spaced = '<t>{ "zone": "CET" }</t>'
    assert not accepts(grammars.compile(StructuredOutputs("structural_tag", tag)), spaced)
    content["max_whitespace_cnt"] = 2
    assert accepts(grammars.compile(StructuredOutputs("structural_tag", tag)), spaced)


# reasoning: the grammar applies once the reasoning block closes


async def test_the_grammar_starts_after_the_reasoning_block_closes(qwen):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    with scripted(qwen, 'Free text, not JSON.\n</think>{"a": 12}'):  # the fake ignores the mask: the matcher judges
        out = await chat(qwen, response_format=fmt)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == "Free text, not JSON." and message["content"] == '{"a": 12}'
    with scripted(qwen, "Thinking.\n</think>not JSON"):
        status, out = await post(qwen, "/v1/chat/completions", {"messages": USER, "response_format": fmt})
    assert status == 500 and "grammar" in out["error"]["message"]


async def test_a_chat_request_is_prepared_in_one_hop_into_the_engine_request_the_engine_runs(qwen, monkeypatch):
    """The prompt is rendered and tokenized once, and in that same prepare thread the grammar is
    compiled, the open reasoning block found and max_tokens resolved: the engine receives the
    request as that step built it, nothing added on the way down."""
    rt, loop_thread = qwen.runtime, threading.get_ident()
    encode_threads: list[int] = []
    compile_threads: list[int] = []
    submitted: list[EngineRequest] = []
    compile, submit_many = rt.prepare_ctx.grammars.compile, rt.engine.submit_many

    def recording_compile(spec: StructuredOutputs) -> Any:
        compile_threads.append(threading.get_ident())
        return compile(spec)

    def recording_submit(requests: list[EngineRequest]) -> Any:
        submitted.extend(requests)
        return submit_many(requests)

    monkeypatch.setattr(rt.prepare_ctx.grammars, "compile", recording_compile)
    hooked = HookedSegmentCache(rt.prepare_ctx.segment_cache, lambda text: encode_threads.append(threading.get_ident()))
    monkeypatch.setattr(rt, "prepare_ctx", dataclasses.replace(rt.prepare_ctx, segment_cache=hooked))
    monkeypatch.setattr(rt.engine, "submit_many", recording_submit)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    with scripted(qwen, 'Thinking.\n</think>{"a": 12}'):
        status, out = await post(qwen, "/v1/chat/completions", {"messages": USER, "response_format": fmt})
    assert status == 200 and out["choices"][0]["message"]["content"] == '{"a": 12}', out
    [request] = submitted
    [prepare_thread] = encode_threads  # the chat rendered and tokenized once
    assert compile_threads == [prepare_thread] and prepare_thread != loop_thread
    assert request.reasoning_end_ids == tuple(rt.loaded.tokenizer.encode("</think>", add_special_tokens=False))
    assert request.constraint is not None
    assert request.params.max_tokens is None  # as asked: the rest of the context, resolved once
    assert request.max_tokens == rt.max_model_len - request.num_prompt_tokens
    assert out["usage"]["prompt_tokens"] == request.num_prompt_tokens


# the engine: batching and preemption never change a constrained greedy output


async def generate(engine: Engine, items: list[tuple[list[int], SamplingParams, Constraint | None]]):
    results: list[tuple[str, str]] = [("", "")] * len(items)

    async def one(i: int, ids, params, constraint) -> None:
        text, finish = "", None
        async with engine.submit(EngineRequest.of_tokens(ids, params, engine, constraint)) as stream:
            async for d in stream:
                text, finish = text + d.text, d.finish_reason or finish
        results[i] = (text, finish)

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with anyio.create_task_group() as inner:
            for i, item in enumerate(items):
                inner.start_soon(one, i, *item)
        tg.cancel_scope.cancel()
    return results


async def test_constrained_greedy_output_is_the_same_alone_batched_and_preempted(tiny_model):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    schemas = SCHEMAS[:8]
    constraints = [grammars.constraint(StructuredOutputs("json", s)) for s in schemas]
    prompts = [tiny_model.tokenizer.encode(f"record {i} " * (3 + 2 * i)) for i in range(len(schemas))]
    greedy = SamplingParams(temperature=0, max_tokens=120)
    items = list(zip(prompts, [greedy] * len(prompts), constraints, strict=True))
    cfg = EngineConfig(max_model_len=1024, kv_cache_gib=0.01)
    alone = [(await generate(Engine(tiny_model, cfg), [item]))[0] for item in items]
    batched = await generate(Engine(tiny_model, cfg), items)
    small = Engine(tiny_model, EngineConfig(max_model_len=1024, num_kv_blocks=14))
    preempted = await generate(small, items)
    assert small.scheduler.num_preemptions > 0
    assert batched == alone and preempted == alone
    finished = [(text, schema) for (text, finish), schema in zip(alone, schemas, strict=True) if finish == "stop"]
    assert finished
    for text, schema in finished:
        jsonschema.validate(json.loads(text), schema)


async def test_unconstrained_rows_batched_with_constrained_ones_are_untouched(tiny_model):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    constraint = grammars.constraint(StructuredOutputs("choice", ["yes", "no"]))
    prompts = [tiny_model.tokenizer.encode(f"line {i} " * (2 + i)) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cfg = EngineConfig(max_model_len=512, kv_cache_gib=0.01)
    free = await generate(Engine(tiny_model, cfg), [(p, greedy, None) for p in prompts])
    mixed = await generate(
        Engine(tiny_model, cfg), [(p, greedy, constraint if i % 2 else None) for i, p in enumerate(prompts)]
    )
    assert [m for i, m in enumerate(mixed) if i % 2 == 0] == [f for i, f in enumerate(free) if i % 2 == 0]
    assert all(m[0] in ("yes", "no") and m[1] == "stop" for i, m in enumerate(mixed) if i % 2)


# the official OpenAI SDK against real hypercorn


class Colour(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    hex_code: str = pydantic.Field(pattern=r"^#[0-9a-f]{6}$")
    warm: bool
    shade: int = pydantic.Field(ge=0, le=9)


class Palette(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=12)
    colours: list[Colour] = pydantic.Field(max_length=3)


async def test_sdk_parse_returns_instances_of_the_pydantic_model(tiny_model):
    atom = AtomApp(Config.of(kv_cache_gib=0.05, max_model_len=4096), loaded=tiny_model)
    async with (
        served_over_http(atom) as base_url,
        openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client,
    ):
        model = atom.runtime.model_name
        completion = await client.chat.completions.parse(
            model=model, messages=USER, response_format=Palette, temperature=1.0, seed=5, max_tokens=MAX_TOKENS
        )
        assert isinstance(completion.choices[0].message.parsed, Palette)
        response = await client.responses.parse(
            model=model, input="a colour", text_format=Colour, temperature=1.0, max_output_tokens=MAX_TOKENS
        )
        assert isinstance(response.output_parsed, Colour)
