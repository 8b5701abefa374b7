"""An agent framework, the OpenAI Agents SDK, running its multi-turn tool loop against atom_anyio over HTTP
(issue 13): the user asks, the model calls a tool, the SDK runs it and sends the result back, the model
calls it again, then answers.

A random tiny model never writes a tool call by itself, so the model boundary is scripted (``AgentScript``,
one reply per request); the engine, the template, the tool-call parser, the Quart app, real hypercorn and
the SDK's client, tool runner and history all stay real. The last test drives the real sampler under the
grammar that a forced tool choice sets.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from openai.types.shared import Reasoning
from pydantic import Field
from support_fakes import FakeSampler, fake_sampler
from support_servers import served_over_http

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.engine.sampler import SamplerOutput, SamplingInputs
from atom_anyio.templates import template_path

pytestmark = pytest.mark.anyio

WEATHER = {"Paris": "sunny, 24 C", "London": "rain, 12 C"}
QUESTION = "Is it warmer in Paris or in London?"
ANSWER = "Paris is warmer: 24 C against 12 C."
NO_TRACING = RunConfig(tracing_disabled=True)  # the SDK would export traces to api.openai.com
MODELS = {"chat_completions": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}
# settings, and what the model writes before each reply
TEMPLATES = {
    # a template with its own tool markup; its prompt opens a <think> block, which the model closes
    "qwen3_tools": ({"chat_template": template_path("qwen3_tools")}, "I need the weather.\n</think>\n\n"),
    # default flags: the tokenizer's own template (SmolLM2's, which renders no tools), the default Hermes path
    "default_flags": ({}, ""),
}


def tool_call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


class AgentScript:
    """The model boundary as an agent's policy: the ``k``-th request gets the ``k``-th reply (token by
    token, then EOS), whatever the logits say. An agent sends one request at a time."""

    def __init__(self, tokenizer: Any, replies: list[str]):
        self.replies = [tokenizer.encode(r, add_special_tokens=False) for r in replies]
        self.num_requests = 0

    def __call__(self, logits: Any, inputs: SamplingInputs, finite: Any = None) -> SamplerOutput:
        # the one sequence's rows: one, or a verifying step's, each position's output so far (drafts included)
        outs = inputs.output_token_ids
        self.num_requests += not outs[0]
        reply = self.replies[self.num_requests - 1]
        ids = [reply[len(out)] if len(out) < len(reply) else inputs.eos_token_ids[0] for out in outs]
        return SamplerOutput(ids, [None] * len(ids))


@contextmanager
def agent_script(atom: AtomApp, replies: list[str]) -> Iterator[AgentScript]:
    sampler = fake_sampler(atom.runtime.engine)
    sampler.fake = script = AgentScript(atom.runtime.loaded.tokenizer, replies)
    try:
        yield script
    finally:
        sampler.restore()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # Quart is asyncio-only


@pytest.fixture(scope="module", params=list(TEMPLATES))
async def served(request, tiny_model):
    """Real hypercorn serving atom_anyio (its lifespan starts the engine); yields (app, base URL, thought)."""
    config, thought = TEMPLATES[request.param]
    atom = AtomApp(Config.of(kv_cache_gib=0.05, **config), loaded=tiny_model, sampler=FakeSampler())
    async with served_over_http(atom) as url:
        yield atom, url, thought


@pytest.fixture
async def client(served):
    async with openai.AsyncOpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0) as client:
        yield client


def weather_agent(model: Any, asked: list[str], **settings: Any) -> Agent:
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        asked.append(city)
        return WEATHER.get(city, f"no data for {city}")

    # the SDK asks for usage on streamed chat runs only from api.openai.com
    settings.setdefault("model_settings", ModelSettings(include_usage=True))
    return Agent(
        name="weather", instructions="Answer with the tool's data.", model=model, tools=[get_weather], **settings
    )


async def run(agent: Agent, stream: bool) -> tuple[Any, str | None]:
    """The run's result and, streamed, the text its deltas spelled."""
    if not stream:
        return await Runner.run(agent, QUESTION, run_config=NO_TRACING), None
    result = Runner.run_streamed(agent, QUESTION, run_config=NO_TRACING)
    deltas = [
        event.data.delta
        async for event in result.stream_events()
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
    ]
    return result, "".join(deltas)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", list(MODELS))
async def test_agent_calls_the_tool_twice_then_answers_with_its_results(served, client, api, stream):
    atom, _, thought = served
    asked: list[str] = []
    agent = weather_agent(MODELS[api](model=atom.runtime.model_name, openai_client=client), asked)
    replies = [thought + r for r in (tool_call("Paris"), tool_call("London"), ANSWER)]
    with agent_script(atom, replies) as script:
        result, streamed = await run(agent, stream)
    assert asked == ["Paris", "London"] and script.num_requests == 3
    assert result.final_output == ANSWER and streamed in (None, ANSWER)
    items = [item.to_input_item() for item in result.new_items]
    outputs = [i for i in items if i["type"] in ("function_call_output", "function_call_result")]
    assert [o["output"] for o in outputs] == [WEATHER["Paris"], WEATHER["London"]]
    calls = [i for i in items if i["type"] == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "London"}]
    assert [c["call_id"] for c in calls] == [o["call_id"] for o in outputs]
    # reasoning_content (chat) becomes a summary, a Responses reasoning item keeps it as content
    reasonings = [i for i in items if i["type"] == "reasoning"]
    thoughts = [p["text"] for r in reasonings for p in (r.get("content") or r["summary"])]
    assert thoughts == [thought.split("\n")[0]] * 3 if thought else not thoughts
    # each request carried the history so far: the previous prompt, the call written, and its result
    usages = [r.usage for r in result.raw_responses]
    assert len(usages) == 3 and all(u.output_tokens > 0 for u in usages)
    for before, after in zip(usages, usages[1:], strict=False):
        assert after.input_tokens > before.input_tokens + before.output_tokens


@pytest.mark.parametrize("api", list(MODELS))
async def test_a_forced_tool_choice_makes_the_unscripted_model_call_the_tool(served, client, api):
    """The real sampler under the grammar of the named tool's schema: a random model still writes a valid call."""
    atom, _, _ = served
    asked: list[str] = []
    model = MODELS[api](model=atom.runtime.model_name, openai_client=client)
    settings = ModelSettings(
        tool_choice="get_weather",
        reasoning=Reasoning(effort="none"),  # the qwen3 template's thinking off: the grammar holds from the start
        temperature=0,
        max_tokens=200,
        include_usage=True,
    )
    agent = weather_agent(model, asked, model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, QUESTION, run_config=NO_TRACING)
    assert len(asked) == 1 and len(asked[0]) <= 12  # the tool's schema (maxLength) held
    assert result.final_output == WEATHER.get(asked[0], f"no data for {asked[0]}")
