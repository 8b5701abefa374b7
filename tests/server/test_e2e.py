"""End to end: the server as a real process (``hypercorn`` and ``atom-anyio serve``)
on the tiny model, driven over HTTP by the official OpenAI SDK."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import openai
import pytest
from support_servers import Served, clean_env, free_port, running

API_KEY = "test-key"
MAX_MODEL_LEN = 4096
EOS = 2  # <|im_end|>, the tiny model's end token
STORY = [{"role": "user", "content": "Tell me a story about a river and a stone."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    env = clean_env(
        model=str(tiny_model_dir),
        max_model_len=str(MAX_MODEL_LEN),
        kv_cache_gib="0.25",
        api_key=API_KEY,
        log_format="json",
    )
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}", "--access-logfile", "-"]
    with running(cmd, env, port, tmp_path_factory.mktemp("e2e") / "hypercorn.log") as served:
        yield served


@pytest.fixture(scope="module")
def client(server: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def greedy_chat(client: openai.OpenAI, model: str, messages=STORY, max_tokens: int = 24, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens, **kw)


# chat completions


def test_chat_completion_has_text_finish_reason_usage_and_id(client, model) -> None:
    resp = greedy_chat(client, model, max_tokens=16, extra_body={"ignore_eos": True})
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.model == model
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 16
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streamed_chat_deltas_concatenate_to_the_greedy_text(client, model) -> None:
    whole = greedy_chat(client, model)
    chunks = list(greedy_chat(client, model, stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_without_include_usage_sends_no_usage_chunk(client, model) -> None:
    chunks = list(greedy_chat(client, model, max_tokens=4, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


# completions


def test_completion_of_a_string_prompt(client, model) -> None:
    resp = client.completions.create(
        model=model, prompt="The river", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    (choice,) = resp.choices
    assert choice.text and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8


def test_completion_of_a_list_of_prompts_matches_each_alone(client, model) -> None:
    prompts = ["The river", "A stone lay in the"]
    kw = {"model": model, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    resp = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == alone
    assert resp.usage.completion_tokens == 16


def test_completion_echo_prepends_the_prompt(client, model) -> None:
    kw = {"model": model, "prompt": "The river", "max_tokens": 6, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == "The river" + plain


def test_streamed_completion_concatenates_to_the_whole_text(client, model) -> None:
    kw = {"model": model, "prompt": ["The river", "A stone"], "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**kw)
    texts = ["", ""]
    finish: list[str | None] = [None, None]
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


# models


def test_models_list_and_retrieve(client, model, tiny_model_dir) -> None:
    (card,) = client.models.list().data
    assert card.id == model == Path(tiny_model_dir).name
    assert card.object == "model"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# errors


def test_unknown_model_is_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=STORY)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_out_of_range_parameter_is_a_bad_request_naming_the_field(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=STORY, temperature=5)
    assert info.value.param == "temperature"
    assert info.value.code == "invalid_value"
    assert "temperature" in info.value.body["message"]


def test_prompt_longer_than_the_context_is_context_length_exceeded(client, model) -> None:
    long_story = [{"role": "user", "content": "river " * MAX_MODEL_LEN}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=long_story, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in info.value.body["message"]


def test_max_tokens_beyond_the_context_is_clamped_to_the_rest_of_it(client, model) -> None:
    prompt = "river " * (MAX_MODEL_LEN - 40)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=32000, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_MODEL_LEN


def test_wrong_api_key_is_an_authentication_error(server, model) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=model, messages=STORY)
    assert info.value.code == "invalid_api_key"


# vLLM-style extra fields


def test_ignore_eos_generates_exactly_max_tokens(client, model) -> None:
    eos_first = {"logit_bias": {str(EOS): 100}, "max_tokens": 7}
    stops = greedy_chat(client, model, **eos_first)
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == 1
    ignored = greedy_chat(client, model, extra_body={"ignore_eos": True}, **eos_first)
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 7


def test_min_tokens_holds_back_the_end_token(client, model) -> None:
    greedy = greedy_chat(client, model).choices[0].message.content
    resp = greedy_chat(client, model, logit_bias={str(EOS): 100}, max_tokens=20, extra_body={"min_tokens": 5})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 6  # five greedy tokens, then the end token
    assert greedy.startswith(resp.choices[0].message.content)


def test_top_k_one_samples_the_greedy_text(client, model) -> None:
    greedy = greedy_chat(client, model).choices[0].message.content
    for seed in (1, 2):
        sampled = client.chat.completions.create(
            model=model, messages=STORY, temperature=1.0, max_tokens=24, seed=seed, extra_body={"top_k": 1}
        )
        assert sampled.choices[0].message.content == greedy


# concurrency


def served_dtype(server: Served) -> str:
    """The dtype the server loaded the model in, from its ``model.loaded`` log line."""
    for line in server.log_path.read_text().splitlines():
        if '"model.loaded"' in line:
            return json.loads(line)["dtype"]
    raise AssertionError("no model.loaded line in the server log")


def greedy_tokens(choice_logprobs) -> list[tuple[str, set[str]]]:
    """Each generated token of a chat choice with its top-5 alternatives (``logprobs.content``)."""
    return [(t.token, {alt.token for alt in t.top_logprobs}) for t in choice_logprobs]


def assert_greedy_texts_close(
    ours: list[list[tuple[str, set[str]]]], ref: list[list[tuple[str, set[str]]]], exact: bool
) -> None:
    """Greedy runs compared: equal in float32 (batching never changes a greedy result there), and
    in bfloat16, which ``auto`` picks on an AVX512-BF16 CPU, the standard way for low precision
    (the suite's ``assert_greedy_close`` over the API's logprobs): equal, or where they first
    diverge each side's token is among the other's top logprobs there, since a GEMM over more rows
    may round differently and a near tie of the random tiny model may flip."""
    for i, (a_run, b_run) in enumerate(zip(ours, ref, strict=True)):
        assert len(a_run) == len(b_run) == 24, f"stream {i}: {len(a_run)} tokens against {len(b_run)}"
        for j, ((a, a_top), (b, b_top)) in enumerate(zip(a_run, b_run, strict=True)):
            if a != b:
                assert not exact, f"stream {i} token {j}: {a!r} batched, {b!r} alone"
                assert a in b_top and b in a_top, f"stream {i} token {j}: {a!r} / {b!r} outside the other's top 5"
                break


def test_concurrent_streams_match_their_greedy_text_alone(server, client, model) -> None:
    prompts = [[{"role": "user", "content": f"Story {i}: " + "the river " * (3 * i)}] for i in range(8)]
    top = {"logprobs": True, "top_logprobs": 5}
    alone = [greedy_chat(client, model, messages=m, extra_body={"ignore_eos": True}, **top) for m in prompts]

    async def stream_all() -> list[list[tuple[str, set[str]]]]:
        runs: list[list[tuple[str, set[str]]]] = [[] for _ in prompts]
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

        async def one(i: int) -> None:
            stream = await aclient.chat.completions.create(
                model=model,
                messages=prompts[i],
                temperature=0,
                max_tokens=24,
                stream=True,
                extra_body={"ignore_eos": True},
                **top,
            )
            async for chunk in stream:
                for c in chunk.choices:
                    runs[i] += greedy_tokens(c.logprobs.content if c.logprobs else [])

        async with aclient, anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return runs

    exact = served_dtype(server).startswith("float32")
    alone_runs = [greedy_tokens(r.choices[0].logprobs.content) for r in alone]
    assert_greedy_texts_close(anyio.run(stream_all), alone_runs, exact)


# operations


def test_every_line_hypercorn_prints_is_json_with_the_documented_keys(server, client, model) -> None:
    greedy_chat(client, model, max_tokens=2)
    # hypercorn writes the access line after the response has gone out: poll until it is there
    deadline = time.monotonic() + 10
    while True:
        events = [json.loads(line) for line in server.log().splitlines()]  # stdout and stderr, every line
        finished = [e for e in events if e.get("event") == "request.finished" and e.get("endpoint") == "chat"]
        access = {e["request_id"]: e for e in events if e.get("event") == "http.access"}
        if all(e["request_id"] in access for e in finished) or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # poll interval
    assert all({"event", "level", "timestamp", "logger"} <= set(e) for e in events), server.log()
    assert any(e["event"] == "model.loaded" for e in events)
    assert any(e["logger"] == "hypercorn.error" and e["event"].startswith("Running on") for e in events)
    assert finished and all(e["outcome"] in ("ok", "refused") for e in finished)
    for e in finished:
        assert (access[e["request_id"]]["path"], access[e["request_id"]]["status"]) == (
            "/v1/chat/completions",
            e["status"],
        )


@pytest.mark.slow
def test_atom_anyio_serve_answers_and_exits_zero_on_sigterm(tiny_model_dir, tmp_path) -> None:
    port = free_port()
    script = Path(sys.executable).with_name("atom-anyio")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "atom_anyio.cli"]
    cmd = [
        *cli,
        "serve",
        f"--port={port}",
        f"--model={tiny_model_dir}",
        f"--max-model-len={MAX_MODEL_LEN}",
        "--kv-cache-gib=0.25",
        "--api-key=cli-key",
        "--served-model-name=tiny-cli",
        "--log-format=json",
    ]
    with (
        running(cmd, clean_env(), port, tmp_path / "serve.log") as served,
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="cli-key", max_retries=0, timeout=60) as cli_client,
    ):
        assert [m.id for m in cli_client.models.list().data] == ["tiny-cli"]
        resp = greedy_chat(cli_client, "tiny-cli", max_tokens=4, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 4 and resp.model == "tiny-cli"
