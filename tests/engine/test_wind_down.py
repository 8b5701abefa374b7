"""Wind-down: a constrained output near its max_tokens keeps room to close its grammar, and ends
with ``"stop"`` and a complete result. The closer alone on real matchers, then the real engine
with a tiny random model sampled at temperature 1, which by itself would run out of tokens inside
a string, and the app's log line and counter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import anyio
import jsonschema
import pytest
import xgrammar as xgr
from structlog.testing import capture_logs
from support_servers import serving_app

from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import Constraint, Grammars
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.wind_down import WIND_DOWN_TOKENS
from atom_anyio.parse.tool_calls import ToolParser
from atom_anyio.parse.tool_grammar import forced_tool_calls_tag
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs

pytestmark = pytest.mark.anyio

NOTE = {  # free strings: a random model sampled at temperature 1 rarely ends one by itself
    "type": "object",
    "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "tags"],
}
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "country", "population"],
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
    },
    "required": ["city", "unit", "days"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
SMALL = {"max_model_len": 1024, "kv_cache_gib": 0.02}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # Quart is asyncio-only


@pytest.fixture(scope="module")
def grammars(tiny_model) -> Grammars:
    return Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])


def json_spec(schema: dict) -> StructuredOutputs:
    return StructuredOutputs("json", schema)


def tool_spec(parallel: bool) -> StructuredOutputs:
    return StructuredOutputs("structural_tag", forced_tool_calls_tag("hermes", TOOLS, parallel=parallel))


# the closer on its own


@pytest.mark.parametrize(
    ("spec", "prefix"),
    [
        (json_spec(CITY), '{"name": "Oslo and a long story about'),  # mid-string, required ones missing
        (json_spec(CITY), '{"name": "a\\'),  # mid-escape
        (json_spec(CITY), "{"),  # every property missing
        (json_spec(CITY), '{"name": "a", "country": "b", "population": 12'),  # mid-number
        (json_spec(NOTE), '{"title": "t", "tags": ["x", "y'),  # mid-array
        (json_spec({"type": "array", "items": {"type": "integer"}, "minItems": 3}), "[1"),
        (json_spec({"type": "object"}), '{"a": [1, {"b": "x'),
        (json_spec(WEATHER), '{"city": "Oslo", "unit": "fa'),  # an enum value
        (json_spec({"type": "string", "pattern": "^[A-Z]{3}$"}), '"A'),
        (tool_spec(parallel=True), ""),
        (tool_spec(parallel=True), '<tool_call>\n{"name": "get_'),  # inside a tool-call tag
        (tool_spec(parallel=False), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'),
        (StructuredOutputs("regex", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"), "ab"),
    ],
)
def test_the_closing_completes_the_grammar_and_leaves_the_matcher_as_it_was(tiny_model, grammars, spec, prefix):
    grammar = grammars.compile(spec)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(prefix)
    tokens = grammars.closer.closing(matcher)
    assert tokens is not None and len(tokens) < 40, tokens
    *body, stop = tokens
    assert stop == 2
    text = tiny_model.tokenizer.decode(body)
    assert matcher.accept_string(text) and matcher.is_completed()  # it had not moved
    replay = xgr.GrammarMatcher(grammar)
    assert replay.accept_string(prefix) and all(replay.accept_token(t) for t in tokens) and replay.is_terminated()
    if spec.kind == "json":
        jsonschema.validate(json.loads(prefix + text), spec.value)


def test_a_complete_output_closes_with_its_stop_token_alone(grammars):
    matcher = xgr.GrammarMatcher(grammars.compile(json_spec(CITY)))
    assert matcher.accept_string('{"name": "a", "country": "b", "population": 1}')
    assert grammars.closer.closing(matcher) == [2]


# the engine


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    num_closing_tokens: int = 0


async def run(engine: Engine, constraint: Constraint, params: list[SamplingParams], prompt: str = "Answer:"):
    """Each ``params``' output for one prompt, all in one batch."""
    ids = engine.tokenizer.encode(prompt)
    outputs = [Output() for _ in params]

    async def one(out: Output, p: SamplingParams) -> None:
        async with engine.submit(EngineRequest.of_tokens(ids, p, engine, constraint)) as stream:
            async for d in stream:
                out.token_ids += d.token_ids
                out.text += d.text
                out.finish = d.finish_reason or out.finish
                out.num_closing_tokens = d.num_closing_tokens or out.num_closing_tokens

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with anyio.create_task_group() as inner:
            for out, p in zip(outputs, params, strict=True):
                inner.start_soon(one, out, p)
        tg.cancel_scope.cancel()
    return outputs


def sampled(max_tokens: int, seeds: Iterable[int] = range(8)) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens) for s in seeds]


# seeds whose notes would run out inside a string (at seeds 1 and 4 the tiny model closes its note by itself)
NOTE_SEEDS = [0, 2, 3, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_free_strings_near_max_tokens_are_closed_into_an_object_that_validates(
    tiny_model, grammars, async_scheduling
):
    engine = Engine(tiny_model, EngineConfig(**SMALL, async_scheduling=async_scheduling))
    outputs = await run(engine, grammars.constraint(json_spec(NOTE)), sampled(40, seeds=NOTE_SEEDS))
    for out in outputs:
        assert out.finish == "stop" and out.num_closing_tokens > 0, out
        assert len(out.token_ids) <= 40
        jsonschema.validate(json.loads(out.text), NOTE)


@pytest.mark.parametrize("parallel", [True, False])
async def test_forced_tool_calls_near_max_tokens_end_with_complete_calls(tiny_model, grammars, parallel):
    engine = Engine(tiny_model, EngineConfig(**SMALL))
    outputs = await run(engine, grammars.constraint(tool_spec(parallel)), sampled(70), "Call a tool.")
    assert any(out.num_closing_tokens for out in outputs)
    for out in outputs:
        assert out.finish == "stop", out
        parser = ToolParser.for_format("hermes")
        content = parser.feed(out.text)[0] + parser.finish()[0]
        assert not content.strip() and parser.calls and (parallel or len(parser.calls) == 1), out
        for call in parser.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])


async def test_speculation_drafts_nothing_for_a_row_winding_down(tiny_model, grammars):
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    constraint = grammars.constraint(json_spec(NOTE))
    engine = Engine(tiny_model, EngineConfig(**SMALL, speculative_config=ngram))
    outputs = await run(engine, constraint, sampled(40, seeds=range(4)))
    assert engine.speculator.num_draft_tokens == 0
    for out in outputs:
        assert out.finish == "stop", out
        jsonschema.validate(json.loads(out.text), NOTE)
    await run(engine, constraint, sampled(200, seeds=range(4)))
    assert engine.speculator.num_draft_tokens > 0  # before its last WIND_DOWN_TOKENS, a row drafts


async def test_a_budget_too_small_for_any_closing_runs_out_as_before(tiny_model, grammars):
    constraint = grammars.constraint(json_spec(CITY))  # its shortest object is 16 tokens
    engine = Engine(tiny_model, EngineConfig(**SMALL))
    short = await run(engine, constraint, sampled(6))
    long = await run(engine, constraint, sampled(400))
    for cut, whole in zip(short, long, strict=True):
        assert cut.finish == "length" and cut.num_closing_tokens == 0
        assert cut.token_ids == whole.token_ids[:6]


async def test_tokens_before_the_wind_down_are_what_the_model_chose(tiny_model, grammars):
    """Greedy: an output with a small budget starts as one with a large budget does, up to its
    last ``WIND_DOWN_TOKENS``; a free row is untouched."""
    constraint = grammars.constraint(json_spec(NOTE))
    greedy = [SamplingParams(temperature=0, max_tokens=m) for m in (100, 1000)]
    engine = Engine(tiny_model, EngineConfig(**SMALL))
    cut, whole = await run(engine, constraint, greedy)
    assert cut.finish == "stop" and cut.num_closing_tokens > 0
    num_free = 100 - WIND_DOWN_TOKENS
    assert cut.token_ids[:num_free] == whole.token_ids[:num_free]
    assert cut.token_ids != whole.token_ids[: len(cut.token_ids)]
    jsonschema.validate(json.loads(cut.text), NOTE)


async def test_a_closed_output_is_on_the_request_line_and_counted(tiny_model):
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": NOTE}}
    body = {"messages": [{"role": "user", "content": "A note."}], "response_format": fmt}
    async with serving_app(tiny_model, kv_cache_gib=0.05, max_model_len=1024) as atom:
        client = atom.quart.test_client()
        with capture_logs() as logs:
            r = await client.post(
                "/v1/chat/completions", json={**body, "max_tokens": 30, "temperature": 1.0, "seed": 1}
            )
        out = await r.get_json()
        metrics = await (await client.get("/metrics")).get_data(as_text=True)
    assert out["choices"][0]["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), NOTE)
    [line] = [e for e in logs if e["event"] == "request.finished"]
    assert line["closed_early"] == 1 and line["finish_reason"] == "stop"
    assert "atom_structured_closed_early_total 1.0" in metrics
