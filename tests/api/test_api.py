"""The OpenAI-compatible HTTP API end to end: the real Quart app, engine and
tokenizer serving the tiny random Llama (SmolLM2 tokenizer and chat template).

Quart runs on asyncio only, so every test here runs on the asyncio backend.
"""

from __future__ import annotations

import gc
import json
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support_fakes import hook_prepare
from support_models import TINY_VOCAB_SIZE
from support_servers import wait_until

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.engine.sequence import Sequence

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 64 * 1024
EOS = 2  # <|im_end|>, the tiny model's eos token

# The SmolLM2 layout plus what the stock template ignores: the tool list and a ``persona`` kwarg.
# (Longer than a file name may be: an inline template must not be mistaken for a path.)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool.function.name }}: {{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% if persona is defined %}<|im_start|>system\nYou are {{ persona }}.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


# servers


@asynccontextmanager
async def serve(tiny_model, **config: Any) -> AsyncIterator[AtomApp]:
    atom = AtomApp(Config.of(**{"max_model_len": MAX_MODEL_LEN, "kv_cache_gib": 0.05, **config}), loaded=tiny_model)
    async with atom.serving():
        yield atom


@pytest.fixture(scope="module")
async def atom(tiny_model):
    """The shared server; tests that need other settings start their own (startup is cheap)."""
    async with serve(tiny_model, max_body_bytes=MAX_BODY_BYTES) as app:
        yield app


@pytest.fixture
def client(atom):
    return atom.quart.test_client()


@pytest.fixture
def tokenizer(tiny_model):
    return tiny_model.tokenizer


# helpers


def chat(content: Any = "Tell me about rivers.", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **fields}


def greedy(max_tokens: int | None = 8, **fields: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **fields}


async def post(client, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = await client.post(path, json=body)
    data = await r.get_json()
    assert r.status_code == status, data
    return data


async def chat_text(client, body: dict[str, Any]) -> str:
    return (await post(client, "/v1/chat/completions", body))["choices"][0]["message"]["content"]


async def sse_events(response) -> list[dict[str, Any]]:
    """The events of an SSE body, each checked to be ``data: <json>\\n\\n``, ending with ``[DONE]``."""
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    body = (await response.get_data()).decode()
    assert body.endswith("\n\n")
    frames = body.split("\n\n")[:-1]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    assert "data: [DONE]" not in frames[:-1]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


async def stream(client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return await sse_events(await client.post(path, json={**body, "stream": True}))


def chat_template_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt as transformers renders and tokenizes it."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def assert_openai_error(data: dict[str, Any], *, param: str | None = None, code: str | None = None) -> None:
    assert set(data) == {"error"}
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


async def requests_total(client) -> dict[tuple[str, str], float]:
    """``atom_requests_total`` by (endpoint, outcome), parsed from /metrics."""
    r = await client.get("/metrics")
    assert r.status_code == 200
    counts = {}
    for family in text_string_to_metric_families((await r.get_data()).decode()):
        for sample in family.samples:
            if sample.name == "atom_requests_total":
                counts[sample.labels["endpoint"], sample.labels["outcome"]] = sample.value
    return counts


def engine_is_idle(atom: AtomApp, num_free_blocks: int) -> Callable[[], bool]:
    engine = atom.runtime.engine
    return lambda: (
        not engine.scheduler.running
        and not engine.scheduler.waiting
        and engine.block_manager.num_free_blocks == num_free_blocks
    )


# chat completions: shape and fields


async def test_chat_response_has_the_openai_shape_and_usage(client, atom, tokenizer):
    body = chat("Name three rivers.", **greedy(6))
    data = await post(client, "/v1/chat/completions", body)
    assert data["id"].startswith("chatcmpl-")
    assert data["object"] == "chat.completion"
    assert isinstance(data["created"], int)
    assert data["model"] == atom.runtime.model_name
    [choice] = data["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(chat_template_ids(tokenizer, body["messages"]))
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


async def test_repeated_prompt_reports_cached_prompt_tokens(client, atom):
    body = chat(f"A unique question about {random.random()} " + "stones and rivers " * 20, **greedy(2))
    first = (await post(client, "/v1/chat/completions", body))["usage"]
    second = (await post(client, "/v1/chat/completions", body))["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > first["prompt_tokens_details"]["cached_tokens"]
    # every full block but the last (recomputed to sample from) comes from the cache
    block_size = atom.runtime.engine.cfg.block_size
    assert second["prompt_tokens"] - 2 * block_size < cached < second["prompt_tokens"]


async def test_text_content_parts_are_joined_into_one_message(client):
    parts = [{"type": "text", "text": "Hello there."}, {"type": "text", "text": "How are rivers made?"}]
    as_parts = await post(client, "/v1/chat/completions", chat(parts, **greedy(6)))
    as_text = await post(client, "/v1/chat/completions", chat("Hello there.\nHow are rivers made?", **greedy(6)))
    assert as_parts["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]


async def test_image_content_part_is_refused_naming_the_part(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
    ]
    data = await post(client, "/v1/chat/completions", {"messages": messages}, status=400)
    assert_openai_error(data, param="messages.1.content.1.type")
    assert "text" in data["error"]["message"]


async def test_n_returns_n_choices_indexed_from_zero(client):
    data = await post(client, "/v1/chat/completions", chat(n=3, max_tokens=4, ignore_eos=True, seed=7))
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 3 * 4


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_ends_with_length_after_exactly_that_many_tokens(client, field):
    body = chat(temperature=0, ignore_eos=True, logprobs=True, **{field: 5})
    data = await post(client, "/v1/chat/completions", body)
    [choice] = data["choices"]
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5
    assert len(choice["logprobs"]["content"]) == 5


async def test_temperature_zero_is_deterministic(client):
    body = chat("Describe a stone.", temperature=0, max_tokens=12, ignore_eos=True)
    assert await chat_text(client, body) == await chat_text(client, body)


async def test_seed_reproduces_sampling_at_temperature_one(client):
    def body(seed: int) -> dict[str, Any]:
        return chat("Describe a cloud.", temperature=1, seed=seed, max_tokens=12, ignore_eos=True)

    first = await chat_text(client, body(1234))
    assert await chat_text(client, body(1234)) == first
    assert await chat_text(client, body(99)) != first


@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
async def test_stop_string_ends_the_output_before_it(client, as_list):
    text = await chat_text(client, chat("Stop me.", **greedy(16)))
    stop = text[len(text) // 2 :][:3]
    expected = text[: text.index(stop)]
    body = chat("Stop me.", **greedy(16), stop=["never-seen-stop", stop] if as_list else stop)
    [choice] = (await post(client, "/v1/chat/completions", body))["choices"]
    assert choice["message"]["content"] == expected
    assert stop not in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


async def test_logit_bias_forces_the_biased_token(client, tokenizer):
    [token] = tokenizer(" river", add_special_tokens=False)["input_ids"]
    body = chat("Anything.", temperature=1, max_tokens=4, ignore_eos=True, logit_bias={str(token): 100})
    assert await chat_text(client, body) == tokenizer.decode([token] * 4)


async def test_logprobs_with_top_logprobs_describe_every_token(client):
    body = chat("Describe a river.", **greedy(5), logprobs=True, top_logprobs=3)
    [choice] = (await post(client, "/v1/chat/completions", body))["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 5
    assert "".join(lp["token"] for lp in content) == choice["message"]["content"]
    for lp in content:
        assert set(lp) == {"token", "logprob", "bytes", "top_logprobs"}
        assert lp["bytes"] == list(lp["token"].encode())
        assert lp["logprob"] <= 0
        top = lp["top_logprobs"]
        assert len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        # greedy: the sampled token is the most likely one
        assert top[0]["token"] == lp["token"] and top[0]["logprob"] == pytest.approx(lp["logprob"])


async def test_logprobs_without_top_logprobs_give_no_alternatives(client):
    body = chat("Describe a river.", **greedy(3), logprobs=True)
    [choice] = (await post(client, "/v1/chat/completions", body))["choices"]
    assert [lp["top_logprobs"] for lp in choice["logprobs"]["content"]] == [[], [], []]


async def test_min_tokens_holds_off_eos(client):
    eos_first = {"logit_bias": {str(EOS): 100}, "temperature": 0, "max_tokens": 16}
    data = await post(client, "/v1/chat/completions", chat(**eos_first))
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["message"]["content"] == ""
    assert data["usage"]["completion_tokens"] == 1  # eos itself
    data = await post(client, "/v1/chat/completions", chat(**eos_first, min_tokens=5))
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == 6  # five tokens, then eos


async def test_sampling_filters_that_keep_only_the_top_token_equal_greedy(client):
    expected = await chat_text(client, chat("Describe the sea.", **greedy(8)))
    for knob in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        body = chat("Describe the sea.", **{**greedy(8), "temperature": 1, "seed": 3, **knob})
        assert await chat_text(client, body) == expected, knob


async def test_penalties_and_filters_in_range_are_accepted(client):
    body = chat(
        "Describe the sea.",
        max_tokens=6,
        presence_penalty=1.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.3,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        user="user-1234",
        seed=5,
    )
    data = await post(client, "/v1/chat/completions", body)
    assert data["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 10**30),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", 11),
        ("n", 0),
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("min_tokens", -1),
        ("top_logprobs", 21),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"five": 1}),
        ("stop", [""]),
        ("seed", "abc"),
        ("user", 5),
        ("tool_choice", "sometimes"),
    ],
)
async def test_out_of_range_field_is_refused_naming_it(client, field, value):
    data = await post(client, "/v1/chat/completions", chat(logprobs=True, **{field: value}), status=400)
    assert_openai_error(data, param=field, code="invalid_value")


async def test_user_field_is_accepted(client):
    data = await post(client, "/v1/chat/completions", chat(user="alice@example.com", max_tokens=2))
    assert len(data["choices"]) == 1


# chat template: kwargs and tools


@pytest.fixture(scope="module")
async def templated(tiny_model):
    async with serve(tiny_model, chat_template=TOOLS_TEMPLATE) as app:
        yield app


async def test_chat_template_kwargs_reach_the_template(templated, tokenizer):
    client = templated.quart.test_client()
    body = {"messages": [{"role": "user", "content": "Hello."}]}
    plain = await post(client, "/tokenize", body)
    pirate = await post(client, "/tokenize", {**body, "chat_template_kwargs": {"persona": "a pirate captain"}})
    assert "a pirate captain" not in tokenizer.decode(plain["tokens"])
    assert "You are a pirate captain." in tokenizer.decode(pirate["tokens"])
    # the completion sees the same prompt /tokenize shows
    body = {**body, "chat_template_kwargs": {"persona": "a pirate captain"}, "max_tokens": 1}
    data = await post(client, "/v1/chat/completions", body)
    assert data["usage"]["prompt_tokens"] == pirate["count"]


async def test_tools_are_rendered_into_the_prompt(templated, tokenizer):
    client = templated.quart.test_client()
    body = chat("What is the weather in Paris?", max_tokens=1)
    without = (await post(client, "/v1/chat/completions", body))["usage"]["prompt_tokens"]
    with_tools = await post(client, "/v1/chat/completions", {**body, "tools": [WEATHER_TOOL], "tool_choice": "auto"})
    assert with_tools["usage"]["prompt_tokens"] > without
    tokenized = await post(client, "/tokenize", {"messages": body["messages"], "tools": [WEATHER_TOOL]})
    assert tokenized["count"] == with_tools["usage"]["prompt_tokens"]
    assert f"get_weather: {json.dumps(WEATHER_TOOL)}" in tokenizer.decode(tokenized["tokens"])
    # a named tool choice is enforced by a grammar over the tool-call format, which this template lacks
    named = {"type": "function", "function": {"name": "get_weather"}}
    body_named = {**body, "tools": [WEATHER_TOOL], "tool_choice": named}
    forced = await post(client, "/v1/chat/completions", body_named, status=400)
    assert forced["error"]["param"] == "tool_choice"
    # tool_choice "none": the tools are left out of the prompt
    none = await post(client, "/v1/chat/completions", {**body, "tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert none["usage"]["prompt_tokens"] == without


async def test_chat_template_is_read_from_a_file_or_taken_inline(tiny_model, tokenizer, tmp_path):
    assert len(TOOLS_TEMPLATE) > 255  # longer than a file name may be: Path.is_file() raises for it
    path = tmp_path / "template.jinja"
    path.write_text(TOOLS_TEMPLATE.replace("You are", "From the file: you are"))
    body = {"messages": [{"role": "user", "content": "Hello."}], "chat_template_kwargs": {"persona": "kind"}}
    async with serve(tiny_model, chat_template=str(path)) as from_file:
        tokens = (await post(from_file.quart.test_client(), "/tokenize", body))["tokens"]
        assert "From the file: you are kind." in tokenizer.decode(tokens)
    async with serve(tiny_model, chat_template=TOOLS_TEMPLATE) as inline:
        tokens = (await post(inline.quart.test_client(), "/tokenize", body))["tokens"]
        assert "<|im_start|>system\nYou are kind.<|im_end|>" in tokenizer.decode(tokens, skip_special_tokens=False)


# streaming


async def test_chat_stream_is_sse_framed_and_joins_to_the_greedy_text(client):
    body = chat("Tell me a story.", **greedy(10))
    expected = await chat_text(client, body)
    chunks = await stream(client, "/v1/chat/completions", body)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


async def test_stream_include_usage_adds_a_final_usage_chunk(client):
    body = chat("Tell me a story.", **greedy(4), stream_options={"include_usage": True})
    chunks = await stream(client, "/v1/chat/completions", body)
    *content, last = chunks
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in content)
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]


async def test_stream_with_n_2_interleaves_both_choices(client):
    body = chat("Tell me a story.", n=2, temperature=1, seed=11, max_tokens=8, ignore_eos=True)
    whole = await post(client, "/v1/chat/completions", body)
    chunks = await stream(client, "/v1/chat/completions", body)
    order = [c["choices"][0]["index"] for c in chunks]
    assert set(order) == {0, 1}
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), "choice 1 starts only after choice 0 ended"
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert mine[-1]["finish_reason"] == "length"
        # seeded per choice: the stream has the same choices as the whole response
        assert "".join(m["delta"].get("content", "") for m in mine) == whole["choices"][i]["message"]["content"]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("fields", "reason"),
    [({"logit_bias": {str(EOS): 100}}, "stop"), ({"ignore_eos": True, "logit_bias": {str(EOS): 100}}, "length")],
    ids=["eos", "max_tokens"],
)
async def test_finish_reason_is_stop_at_eos_and_length_at_max_tokens(client, streaming, fields, reason):
    body = chat("Finish.", max_tokens=3, temperature=0, **fields)
    if streaming:
        chunks = await stream(client, "/v1/chat/completions", body)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finishes == [reason]
        assert chunks[-1]["choices"][0]["finish_reason"] == reason
    else:
        data = await post(client, "/v1/chat/completions", body)
        assert data["choices"][0]["finish_reason"] == reason


async def test_stop_string_finishes_a_stream_with_stop(client):
    text = await chat_text(client, chat("Stop me.", **greedy(16)))
    stop = text[len(text) // 2 :][:3]
    chunks = await stream(client, "/v1/chat/completions", chat("Stop me.", **greedy(16), stop=stop))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# context rules


async def test_max_tokens_past_the_context_is_clamped_in_every_api(tiny_model):
    """Agent CLIs ask max_tokens 32000 whatever the model: the completion gets the rest of the context."""
    async with serve(tiny_model, max_model_len=128) as small:
        client = small.quart.test_client()
        data = await post(client, "/v1/chat/completions", chat(**greedy(32000)))
        usage = data["usage"]
        assert data["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
        data = await post(client, "/v1/completions", {"prompt": list(range(100, 200)), **greedy(32000)})
        assert (data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]) == ("length", 28)
        body = {"input": "Tell me about rivers.", "max_output_tokens": 32000, "temperature": 0}
        usage = (await post(client, "/v1/responses", body))["usage"]
        assert 0 < usage["input_tokens"] + usage["output_tokens"] <= 128
        body = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32000, "temperature": 0}
        usage = (await post(client, "/v1/messages", {**body, "model": small.runtime.model_name}))["usage"]
        assert 0 < usage["input_tokens"] + usage["output_tokens"] <= 128


async def test_max_tokens_past_the_context_is_refused_when_the_setting_says_error(tiny_model):
    async with serve(tiny_model, max_model_len=MAX_MODEL_LEN, max_tokens_past_context="error") as strict:
        client = strict.quart.test_client()
        prompt_tokens = (await post(client, "/tokenize", {"messages": chat()["messages"]}))["count"]
        data = await post(client, "/v1/chat/completions", chat(max_tokens=MAX_MODEL_LEN), status=400)
        assert_openai_error(data, code="context_length_exceeded")
        message = data["error"]["message"]
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message
        assert f"{prompt_tokens + MAX_MODEL_LEN} tokens" in message
        assert f"{prompt_tokens} in the messages" in message
        assert f"{MAX_MODEL_LEN} in the completion" in message


async def test_a_prompt_past_the_context_is_refused_in_anthropics_words_on_messages(client, atom):
    body = {
        "model": atom.runtime.model_name,
        "messages": [{"role": "user", "content": "river " * MAX_MODEL_LEN}],
        "max_tokens": 32000,
    }
    r = await client.post("/v1/messages", json=body)
    data = await r.get_json()
    assert r.status_code == 400 and data["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {MAX_MODEL_LEN - 1} maximum", data["error"]["message"])


async def test_omitted_max_tokens_runs_to_the_end_of_the_context(tiny_model):
    async with serve(tiny_model, max_model_len=128) as small:
        client = small.quart.test_client()
        data = await post(client, "/v1/chat/completions", chat(temperature=0, ignore_eos=True))
        usage = data["usage"]
        assert data["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128
        data = await post(client, "/v1/completions", {"prompt": list(range(100, 200)), **greedy(None)})
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["completion_tokens"] == 128 - 100
        # a prompt that leaves no room for even one token is refused
        data = await post(client, "/v1/completions", {"prompt": list(range(100, 228)), **greedy(None)}, status=400)
        assert_openai_error(data, code="context_length_exceeded")


async def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    ids = list(range(1000, 1040))
    body = {"prompt": ids, **greedy(6), "truncate_prompt_tokens": 7}
    truncated = await post(client, "/v1/completions", body)
    assert truncated["usage"]["prompt_tokens"] == 7
    tail = await post(client, "/v1/completions", {"prompt": ids[-7:], **greedy(6)})
    assert truncated["choices"][0]["text"] == tail["choices"][0]["text"]
    chat_data = await post(client, "/v1/chat/completions", chat("word " * 100, **greedy(2), truncate_prompt_tokens=9))
    assert chat_data["usage"]["prompt_tokens"] == 9


async def test_truncate_prompt_tokens_minus_one_fits_the_prompt_to_the_context(client):
    body = {"prompt": list(range(1000, 1000 + MAX_MODEL_LEN)), **greedy(8), "truncate_prompt_tokens": -1}
    data = await post(client, "/v1/completions", body)
    assert data["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 8


# completions


async def test_completion_prompt_forms_and_choice_numbering(client, tokenizer):
    texts = ["The river", "A stone in the"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    alone = [(await post(client, "/v1/completions", {"prompt": t, **greedy(5)}))["choices"][0]["text"] for t in texts]
    assert alone[0] != alone[1]

    by_ids = await post(client, "/v1/completions", {"prompt": ids[0], **greedy(5)})
    assert by_ids["object"] == "text_completion" and by_ids["id"].startswith("cmpl-")
    assert [c["text"] for c in by_ids["choices"]] == [alone[0]]
    assert by_ids["usage"]["prompt_tokens"] == len(ids[0])

    for prompt in (texts, ids):
        data = await post(client, "/v1/completions", {"prompt": prompt, "n": 2, **greedy(5)})
        # choices numbered prompt by prompt, n per prompt
        assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in data["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
        assert all(c["finish_reason"] == "length" for c in data["choices"])
        assert data["usage"]["completion_tokens"] == 4 * 5
        assert data["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


async def test_completion_echo_prepends_the_prompt(client, tokenizer):
    plain = (await post(client, "/v1/completions", {"prompt": "The river", **greedy(4)}))["choices"][0]["text"]
    echoed = await post(client, "/v1/completions", {"prompt": "The river", **greedy(4), "echo": True})
    assert echoed["choices"][0]["text"] == "The river" + plain
    ids = tokenizer("The river")["input_ids"]
    echoed = await post(client, "/v1/completions", {"prompt": ids, **greedy(4), "echo": True})
    assert echoed["choices"][0]["text"] == tokenizer.decode(ids) + plain


async def test_completion_logprobs_use_the_completions_format(client):
    data = await post(client, "/v1/completions", {"prompt": "The river", **greedy(5), "logprobs": 2})
    [choice] = data["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0
    for i in range(4):
        assert lp["text_offset"][i + 1] == lp["text_offset"][i] + len(lp["tokens"][i])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0
        assert 1 <= len(top) <= 2
        assert top[token] == pytest.approx(value)  # greedy: the sampled token is among the top
        assert max(top.values()) == pytest.approx(value)


async def test_completion_stop_string_ends_the_text_before_it(client):
    text = (await post(client, "/v1/completions", {"prompt": "The river", **greedy(16)}))["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    data = await post(client, "/v1/completions", {"prompt": "The river", **greedy(16), "stop": [stop]})
    assert data["choices"][0]["text"] == text[: text.index(stop)]
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_completion_suffix_is_refused_naming_it(client):
    data = await post(client, "/v1/completions", {"prompt": "def f(", "suffix": "return x"}, status=400)
    assert_openai_error(data, param="suffix", code="invalid_value")


async def test_completion_stream_is_sse_framed_and_joins_to_the_text(client):
    body = {"prompt": ["The river", "A stone"], **greedy(6), "stream_options": {"include_usage": True}}
    whole = await post(client, "/v1/completions", body)
    chunks = await stream(client, "/v1/completions", {**body, "echo": True})
    *content, last = chunks
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in content)
    assert len({c["id"] for c in chunks}) == 1
    for i, prompt in enumerate(body["prompt"]):
        mine = [c["choices"][0] for c in content if c["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == prompt + whole["choices"][i]["text"]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 6


# models, health, tokenize, metrics


async def test_models_lists_the_served_model(client, atom):
    data = await (await client.get("/v1/models")).get_json()
    assert data["object"] == "list"
    [card] = data["data"]
    assert card["id"] == atom.runtime.model_name and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    r = await client.get(f"/v1/models/{card['id']}")
    assert r.status_code == 200 and (await r.get_json())["id"] == card["id"]


async def test_unknown_model_is_404_model_not_found(client):
    r = await client.get("/v1/models/no-such-model")
    assert r.status_code == 404
    assert_openai_error(await r.get_json(), param="model", code="model_not_found")
    data = await post(client, "/v1/chat/completions", chat(model="no-such-model"), status=404)
    assert_openai_error(data, param="model", code="model_not_found")
    data = await post(client, "/v1/completions", {"prompt": "x", "model": "no-such-model"}, status=404)
    assert_openai_error(data, code="model_not_found")


async def test_health_and_version(client):
    r = await client.get("/health")
    assert r.status_code == 200 and (await r.get_json()) == {"status": "ok"}
    r = await client.get("/version")
    assert r.status_code == 200 and isinstance((await r.get_json())["version"], str)


async def test_tokenize_equals_the_tokenizers_own_encoding(client, tokenizer):
    text = "Paged attention keeps the KV cache in blocks."
    data = await post(client, "/tokenize", {"prompt": text})
    assert data["tokens"] == tokenizer(text)["input_ids"]
    assert data["count"] == len(data["tokens"])
    assert data["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    data = await post(client, "/tokenize", {"messages": messages})
    expected = chat_template_ids(tokenizer, messages)
    assert data["tokens"] == expected
    assert data["count"] == len(expected)
    data = await post(client, "/tokenize", {"prompt": text, "messages": messages}, status=400)
    assert_openai_error(data, param="prompt")


async def test_detokenize_round_trips_tokenize(client):
    text = "Round trip: rivers, stones & clouds — ünïcödé."
    tokens = (await post(client, "/tokenize", {"prompt": text}))["tokens"]
    assert (await post(client, "/detokenize", {"tokens": tokens}))["prompt"] == text
    data = await post(client, "/detokenize", {"tokens": [10**9]}, status=400)
    assert_openai_error(data, param="tokens")


async def test_tokenizer_info_gives_the_special_tokens_and_the_served_template(client, tokenizer, tiny_model):
    r = await client.get("/tokenizer_info")
    info = await r.get_json()
    assert r.status_code == 200
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tiny_model.chat_template and info["model_max_length"] == MAX_MODEL_LEN
    assert info["tokenizer_class"] == type(tokenizer).__name__


async def test_metrics_count_requests_by_endpoint_and_outcome(client):
    before = await requests_total(client)
    await post(client, "/v1/chat/completions", chat(max_tokens=2))
    await stream(client, "/v1/chat/completions", chat(max_tokens=2))
    await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    after = await requests_total(client)
    assert after["chat", "ok"] - before.get(("chat", "ok"), 0) == 2
    assert after["completions", "ok"] - before.get(("completions", "ok"), 0) == 1


# errors


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        ("GET", "/v1/chat/completions", {}, 405, "method_not_allowed"),
        ("POST", "/v1/no-such-route", {"json": {}}, 404, "not_found"),
        ("POST", "/v1/chat/completions", {"data": b"{not json", "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", {"data": b"\xff\xfe", "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", {"json": [1, 2]}, 400, "invalid_json"),
        ("POST", "/v1/chat/completions", {"data": b"messages=hi", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
        ("POST", "/v1/chat/completions", {"json": chat("x" * MAX_BODY_BYTES)}, 413, "request_entity_too_large"),
        ("POST", "/v1/chat/completions", {"json": {"model": "m"}}, 400, "invalid_value"),
    ],
    ids=["wrong-method", "unknown-route", "malformed-json", "not-utf8", "not-an-object", "wrong-content-type", "too-large", "missing-field"],
)  # fmt: skip
async def test_client_errors_have_the_openai_error_shape(client, method, path, kwargs, status, code):
    r = await client.open(path, method=method, **kwargs)
    assert r.status_code == status
    assert_openai_error(await r.get_json(), code=code)


async def test_invalid_body_names_the_field(client):
    data = await post(client, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, status=400)
    assert_openai_error(data, param="messages.0.role", code="invalid_value")
    assert "messages.0.role" in data["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "hi"},
        {"messages": []},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
        {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 0},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},  # (10**30: clamped to the context)
        {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [-1]},
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999999999999999": 1}},
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
        {"messages": [{"role": "user", "content": "hi"}], "guided_json": "{not json"},
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"choice": "not a list"}},
        {"messages": [{"role": "user", "content": "hi"}], "response_format": "json"},
        {"prompt": "a", "guided_regex": "("},
        {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": float("nan")},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": ""},
        {"prompt": [-1]},
        {"prompt": [TINY_VOCAB_SIZE]},
        {"prompt": ["a", [1, 2]]},
        {"prompt": "a", "max_tokens": 0},
        {"prompt": "a", "prompt_logprobs": 1, "stream": True},
        {"prompt": "a", "best_of": 3},
        {"prompt": "a", "top_k": 2**63},
    ],
)
async def test_client_input_is_never_a_500(client, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await client.post(path, json={"max_tokens": 2, **body} if "max_tokens" not in body else body)
    assert 400 <= r.status_code < 500, await r.get_data()
    assert_openai_error(await r.get_json())


# auth


async def test_api_key_guards_the_api_but_not_health_or_metrics(tiny_model):
    async with serve(tiny_model, api_key="sekret") as guarded:
        client = guarded.quart.test_client()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", chat())):
                r = await client.open(path, method=method, json=body, headers=headers)
                assert r.status_code == 401, (headers, path)
                assert_openai_error(await r.get_json(), code="invalid_api_key")
                assert (await r.get_json())["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer sekret"}
        assert (await client.get("/v1/models", headers=auth)).status_code == 200
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth)
        assert r.status_code == 200
        for path in ("/health", "/metrics", "/version"):
            assert (await client.get(path)).status_code == 200, path


# cancellation and lifetime


@pytest.fixture
async def budgeted(tiny_model):
    """A server that prefills 32 tokens a step: a long prompt spends many steps before its first token."""
    async with serve(tiny_model, max_model_len=4096, max_num_batched_tokens=32) as app:
        yield app


def long_chat(**fields: Any) -> bytes:
    words = " ".join(random.Random(0).choice(["river", "stone", "cloud", "seven", "blue"]) for _ in range(1500))
    return json.dumps(chat(words, temperature=0, ignore_eos=True, **fields)).encode()


async def test_client_disconnect_mid_stream_aborts_and_frees_kv_blocks(budgeted):
    engine = budgeted.runtime.engine
    client = budgeted.quart.test_client()
    num_free = engine.block_manager.num_free_blocks
    before = await requests_total(client)
    body = json.dumps(chat("Talk for a long time.", max_tokens=3000, ignore_eos=True, stream=True)).encode()
    async with client.request(
        "/v1/chat/completions", method="POST", headers={"content-type": "application/json"}
    ) as conn:
        await conn.send(body)
        await conn.send_complete()
        received = b""
        with anyio.fail_after(20):
            while received.count(b'"content":"') < 4:  # the role chunk, then three tokens
                received += await conn.receive()
        [seq] = engine.scheduler.running
        assert engine.block_manager.num_free_blocks < num_free
        await conn.disconnect()
    await wait_until(engine_is_idle(budgeted, num_free), timeout=20)
    assert 3 <= seq.num_output_tokens < 3000
    assert seq.is_finished and not seq.block_table
    after = await requests_total(client)
    assert after["chat", "cancelled"] - before.get(("chat", "cancelled"), 0) == 1


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
async def test_client_disconnect_before_the_first_token_aborts_and_frees_kv_blocks(budgeted, streaming):
    engine = budgeted.runtime.engine
    client = budgeted.quart.test_client()
    num_free = engine.block_manager.num_free_blocks
    async with client.request(
        "/v1/chat/completions", method="POST", headers={"content-type": "application/json"}
    ) as conn:
        await conn.send(long_chat(max_tokens=8, stream=streaming))
        await conn.send_complete()
        # wait until the prompt is part-way through its prefill
        await wait_until(
            lambda: bool(engine.scheduler.running) and engine.scheduler.running[0].num_computed_tokens > 0, timeout=20
        )
        [seq] = engine.scheduler.running
        assert seq.num_output_tokens == 0
        await conn.disconnect()
    await wait_until(engine_is_idle(budgeted, num_free), timeout=20)
    assert seq.is_finished and seq.num_output_tokens == 0
    assert not conn.response_data  # not one chunk went out


async def run_mixed_requests(client, count: int) -> None:
    """``count`` concurrent requests: chat and completions, streamed and whole, n of 1 or 2, some with stop strings."""
    rng = random.Random(42)
    words = ["river", "stone", "cloud", "seven", "blue", "runs", "over"]

    def request(i: int) -> tuple[str, dict[str, Any]]:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
        fields = {"max_tokens": rng.randint(1, 8), "stream": i % 2 == 0, "n": 1 + (i % 3 == 0)}
        if i % 4 == 0:
            fields["stop"] = [rng.choice(["e", "a", " ", "er"])]
        if i % 5 == 0:
            return "/v1/completions", {"prompt": [text, text[::-1]], **fields}
        return "/v1/chat/completions", chat(text, **fields)

    num_ok = 0

    async def run(path: str, body: dict[str, Any]) -> None:
        nonlocal num_ok
        r = await client.post(path, json=body)
        if body["stream"]:
            chunks = await sse_events(r)
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        else:
            assert r.status_code == 200
            finishes = [c["finish_reason"] for c in (await r.get_json())["choices"]]
        assert sum(f in ("stop", "length") for f in finishes) == body["n"] * len(body.get("prompt", [None]))
        num_ok += 1

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(run, *request(i))
    assert num_ok == count


async def test_no_sequence_survives_100_mixed_requests(client, atom):
    engine = atom.runtime.engine
    num_free = engine.block_manager.num_free_blocks
    gc.collect()
    existing = {o.seq_id for o in gc.get_objects() if type(o) is Sequence}
    await run_mixed_requests(client, 100)
    await wait_until(engine_is_idle(atom, num_free), timeout=20)
    gc.collect()
    survivors = [o for o in gc.get_objects() if type(o) is Sequence and o.seq_id not in existing]
    assert survivors == []


async def test_prepare_runs_off_the_event_loop_which_stays_responsive(tiny_model):
    """A ~30k-token chat prompt is rendered and tokenized (~0.3 s here) while
    a probe task ticks on the event loop: the ticks go on during prepare, and
    none is late by 50 ms or by a quarter of prepare's time, whichever is more.
    On an idle 2-core machine the prepare thread's Python work holds the GIL
    and a tick waits for a few 5 ms hand-offs (measured 10-20 ms late); when
    other processes load the CPU everything stretches, prepare included, so
    the bound scales with it. Prepare run on the loop would stall one tick
    for all of prepare's time. Nothing else polls the loop meanwhile: a busy
    poller would compete for the GIL and distort the probe."""
    loop_thread = threading.get_ident()
    preparing = threading.Event()
    prepare_threads: list[int] = []
    prepare_started: list[float] = []
    prepare_seconds: list[float] = []  # until the prompt reached the engine

    def recording_prepare(text: str) -> None:
        prepare_threads.append(threading.get_ident())
        prepare_started.append(time.perf_counter())
        preparing.set()

    async with serve(tiny_model, max_model_len=40_000, kv_cache_gib=0.1) as atom:
        hook_prepare(atom, recording_prepare)
        engine = atom.runtime.engine
        client = atom.quart.test_client()
        num_free = engine.block_manager.num_free_blocks
        words = ["river", "stone", "rain", "sea", "blue", "fast", "under", "light"]  # one token each: under 40k
        text = f"{random.random()} " + " ".join(random.choice(words) for _ in range(29_000))
        body = json.dumps(chat(text, max_tokens=1, stream=True)).encode()

        def submitted() -> bool:
            return bool(engine.scheduler.running or engine.scheduler.waiting)

        lags: list[float] = []
        num_ticks_in_prepare = 0

        async def probe() -> None:
            nonlocal num_ticks_in_prepare
            while not submitted():
                start = anyio.current_time()
                await anyio.sleep(0.001)
                lags.append(anyio.current_time() - start - 0.001)
                num_ticks_in_prepare += preparing.is_set()
            prepare_seconds.append(time.perf_counter() - prepare_started[0])

        async with client.request(
            "/v1/chat/completions", method="POST", headers={"content-type": "application/json"}
        ) as conn:
            async with anyio.create_task_group() as tg:
                tg.start_soon(probe)  # ticks until the prepared prompt reaches the engine
                await conn.send(body)
                await conn.send_complete()
            # prefilling 30k tokens on CPU takes seconds; the point was prepare
            await conn.disconnect()
        await wait_until(engine_is_idle(atom, num_free), timeout=20)

    assert num_ticks_in_prepare >= 5, "the event loop did not run while the prompt was prepared"
    bound = max(0.05, prepare_seconds[0] / 4)
    assert max(lags) < bound, f"event-loop lag {max(lags) * 1000:.1f} ms; prepare took {prepare_seconds[0]:.3f} s"
    assert len(prepare_threads) == 1 and prepare_threads[0] != loop_thread


async def test_prompt_cache_key_and_session_headers_key_the_kv_lease(client, atom):
    """A finished request's KV is leased for its conversation: OpenAI's prompt_cache_key, else the
    session header of Codex (session-id); a request with neither leases its own blocks alone."""
    bm = atom.runtime.engine.block_manager
    long_question = "Tell me about rivers. " * 20
    await post(client, "/v1/chat/completions", chat(long_question, **greedy(4), prompt_cache_key="conv-1"))
    assert bm.leases["conv-1"].block_ids
    r = await client.post(
        "/v1/completions", json={"prompt": long_question, **greedy(4)}, headers={"session-id": "codex-2"}
    )
    assert r.status_code == 200 and bm.leases["codex-2"].block_ids
    # the conversation's next turn hits its leased history and leases the new one in its place
    before = bm.num_leased_hit_tokens
    data = await post(client, "/v1/chat/completions", chat(long_question, **greedy(4), prompt_cache_key="conv-1"))
    assert bm.num_leased_hit_tokens - before == data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert bm.leases["conv-1"].block_ids


async def test_cache_salt_keeps_one_tenants_prefix_hits_from_anothers(client):
    question = "Tell me about mountains. " * 20

    def cached(data: dict[str, Any]) -> int:
        return data["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = await post(client, "/v1/chat/completions", chat(question, **greedy(2), cache_salt="tenant-a"))
    again = await post(client, "/v1/chat/completions", chat(question, **greedy(2), cache_salt="tenant-a"))
    other = await post(client, "/v1/chat/completions", chat(question, **greedy(2), cache_salt="tenant-b"))
    unsalted = await post(client, "/v1/chat/completions", chat(question, **greedy(2)))
    assert cached(first) == 0 and cached(again) > 0  # a tenant's repeated prompt still hits
    assert cached(other) == 0  # another tenant's does not
    assert cached(unsalted) < cached(again)  # nor an unsalted one's (it shares only the default system prompt's block)
    data = await post(client, "/v1/chat/completions", chat(question, **greedy(2), cache_salt=""), status=400)
    assert_openai_error(data, param="cache_salt")


async def test_priority_is_refused_under_fcfs_and_orders_the_queue_under_the_priority_policy(client, tiny_model):
    """vLLM's ``priority``: under the default fcfs policy any priority but 0 is a 400 naming it; under
    ``scheduling_policy=priority`` the waiting requests run lowest priority value first."""
    assert_openai_error(
        await post(client, "/v1/chat/completions", chat(**greedy(2), priority=1), 400), param="priority"
    )
    assert (await post(client, "/v1/completions", {"prompt": "Hi", **greedy(2), "priority": 0}))["choices"]
    async with serve(tiny_model, scheduling_policy="priority", max_num_seqs=1) as atom:
        c, engine, finished = atom.quart.test_client(), atom.runtime.engine, []

        async def one(priority: int, max_tokens: int = 4) -> None:
            await post(
                c, "/v1/completions", {"prompt": f"Request {priority}.", **greedy(max_tokens), "priority": priority}
            )
            finished.append(priority)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0, 200)  # runs alone (max_num_seqs 1) while the others queue behind it
            await wait_until(lambda: engine.scheduler.running)
            for priority in (5, -3, 2):
                tg.start_soon(one, priority)
            await wait_until(lambda: len(engine.scheduler.waiting) == 3)
        assert finished == [0, -3, 2, 5]
