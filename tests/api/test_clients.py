"""What real clients send beyond the basics: vLLM's stream options and chat's reasoning switch,
each honoured or refused (issue 13)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support_fakes import FakeSampler, scripted

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.templates import template_path

pytestmark = pytest.mark.anyio

QWEN3_TEMPLATE = template_path("qwen3_tools")  # a template with an enable_thinking switch
HI = [{"role": "user", "content": "Hi."}]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def atom(tiny_model):
    config = Config.of(max_model_len=2048, kv_cache_gib=0.05, chat_template=QWEN3_TEMPLATE)
    app = AtomApp(config, loaded=tiny_model, sampler=FakeSampler())
    async with app.serving():
        yield app


@pytest.fixture
def client(atom):
    return atom.quart.test_client()


async def sse_events(client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200
    text = (await r.get_data()).decode()
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]


# stream_options.continuous_usage_stats


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": HI}),
        ("/v1/completions", {"prompt": ["Once upon", "a time"], "n": 2}),
    ],
)
async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = await sse_events(client, path, {**body, "max_tokens": 6, "ignore_eos": True, "stream_options": options})
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[0] >= 0
    num_choices = 1 if "messages" in body else 4
    assert counts[-1] == 6 * num_choices and not events[-1]["choices"]  # the final usage chunk
    assert all(u["prompt_tokens"] == usages[-1]["prompt_tokens"] > 0 for u in usages)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


async def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client):
    options = {"include_usage": True}
    events = await sse_events(
        client, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "stream_options": options}
    )
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] >= 1


# chat reasoning_effort: the template's thinking switch, as Responses' reasoning.effort


async def prompt_tokens(client, body: dict[str, Any]) -> int:
    r = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **body})
    data = await r.get_json()
    assert r.status_code == 200, data
    return data["usage"]["prompt_tokens"]


async def tokenized(client, thinking: bool) -> int:
    r = await client.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {"enable_thinking": thinking}})
    return (await r.get_json())["count"]


@pytest.mark.parametrize(("effort", "thinking"), [("none", False), ("minimal", False), ("low", True), ("high", True)])
async def test_chat_reasoning_effort_switches_the_templates_thinking(client, effort, thinking):
    assert await tokenized(client, True) != await tokenized(client, False)  # the switch changes the prompt
    assert await prompt_tokens(client, {"reasoning_effort": effort}) == await tokenized(client, thinking)


async def test_explicit_enable_thinking_wins_over_reasoning_effort(client):
    body = {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert await prompt_tokens(client, body) == await tokenized(client, False)


async def test_an_unknown_reasoning_effort_is_a_400_naming_it(client):
    r = await client.post("/v1/chat/completions", json={"messages": HI, "reasoning_effort": "extreme"})
    data = await r.get_json()
    assert r.status_code == 400 and data["error"]["param"] == "reasoning_effort", data


# Anthropic thinking.budget_tokens: the reasoning block is closed at the budget, then the answer


async def message(client, **fields: Any) -> dict[str, Any]:
    body = {"messages": HI, **fields}
    r = await client.post("/v1/messages", json=body)
    data = await r.get_json()
    assert r.status_code == 200, data
    return data


async def test_thinking_budget_closes_the_reasoning_block_then_the_answer_follows(atom, client):
    tokenizer = atom.runtime.loaded.tokenizer
    script = " river" * 1200  # a thought that never ends by itself
    ids = tokenizer.encode(script, add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    with scripted(atom, script):
        data = await message(
            client,
            model=atom.runtime.model_name,
            max_tokens=1100,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    thinking, text = data["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == tokenizer.decode(ids[:1024]).strip()
    # the end tag took the budget's next positions; the answer is what the model sampled after them
    assert text == {"type": "text", "text": tokenizer.decode(ids[1024 + len(end) : 1100]).strip()}
    assert data["usage"]["output_tokens"] == 1100 and data["stop_reason"] == "max_tokens"


async def test_a_reasoning_block_closed_within_the_budget_is_left_alone(atom, client):
    with scripted(atom, "A short thought.</think>The answer."):
        data = await message(
            client,
            model=atom.runtime.model_name,
            max_tokens=1100,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    assert [b.get("thinking") or b.get("text") for b in data["content"]] == ["A short thought.", "The answer."]
