"""The same request gives the same answer, through the real server on the default model with
``batch_invariant`` on: a seeded request at temperature 1 twice, alone and under a concurrent load,
in every API; ``n`` seeded choices as a set; a greedy answer cold and then from the prefix cache.
Where auto turns invariance on (bfloat16 with AVX512-BF16: the tile GEMM; float32 on an AVX2-only CPU:
the float32 tile GEMM), the server runs at its defaults; elsewhere (float32 with AVX512 but no
AVX512-BF16) it is asked for."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import anthropic
import openai
import pytest
from support_servers import Served, clean_env, free_port, running

from atom_anyio import kernels

STORY = [{"role": "user", "content": "Tell me a short story."}]
COLORS = [{"role": "user", "content": "What is the most obvious color? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    # at the defaults where auto turns invariance on: the bfloat16 tiles (AVX512-BF16), the float32 ones (AVX2 only)
    by_default = kernels.has_tile_linears() or kernels.f32_tile_linears_reason() is not None
    env = clean_env(max_model_len="2048", kv_cache_gib="0.25", log_format="json")
    if not by_default:
        env["ATOM_BATCH_INVARIANT"] = "1"
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    with running(cmd, env, port, tmp_path_factory.mktemp("reproducible") / "hypercorn.log") as served:
        plan = next(line for line in served.log().splitlines() if '"model.plan"' in line)
        assert '"batch_invariant": true' in plan and ('"batch_invariant_requested": null' in plan) == by_default
        yield served


@pytest.fixture(scope="module")
def client(server: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def seeded_story(client: openai.OpenAI, model: str, seed: int = 1234) -> str:
    resp = client.chat.completions.create(model=model, messages=STORY, temperature=1.0, max_tokens=24, seed=seed)
    return resp.choices[0].message.content


class Load:
    """Streams that run beside the request under test: each has produced its first token (so it
    is in the engine's batch) before ``__enter__`` returns, and is still generating."""

    def __init__(self, client: openai.OpenAI, model: str, streams: int = 4):
        self.client, self.model = client, model
        self.started = threading.Barrier(streams + 1)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(streams)]

    def _stream(self, i: int) -> None:
        messages = [{"role": "user", "content": f"Count from {i} to one thousand, one number per line."}]
        stream = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        with stream:
            for n, _ in enumerate(stream):
                if n == 1:
                    self.started.wait(timeout=120)
                if self.stop.is_set():
                    break

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        self.started.wait(timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def test_a_seeded_chat_request_repeats_alone_cached_and_under_load(client, model):
    first = seeded_story(client, model)
    assert seeded_story(client, model) == first  # the second one hits the prefix cache
    with Load(client, model):
        assert seeded_story(client, model) == first
    assert seeded_story(client, model, seed=99) != first  # the seed is what decides


def test_seeded_completions_responses_and_messages_repeat(client, model, server):
    def completion() -> str:
        resp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=7)
        return resp.choices[0].text

    def response() -> str:
        resp = client.responses.create(
            model=model, input="Tell me a short story.", max_output_tokens=24, temperature=1.0, extra_body={"seed": 7}
        )
        return resp.output_text

    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as claude:

        def message() -> str:
            resp = claude.messages.create(  # this SDK takes no temperature argument: the body field it was
                model=model, max_tokens=24, messages=STORY, extra_body={"seed": 7, "temperature": 1.0}
            )
            return resp.content[0].text

        for call in (completion, response, message):
            first = call()
            assert first and call() == first, call.__name__
            with Load(client, model, streams=2):
                assert call() == first, f"{call.__name__} under load"


def test_seeded_choices_repeat_as_a_set(client, model):
    def choices() -> list[str]:
        resp = client.chat.completions.create(model=model, messages=STORY, temperature=1.0, max_tokens=16, seed=5, n=3)
        return [c.message.content for c in resp.choices]

    first = choices()
    assert len(set(first)) > 1  # each choice its own seed
    assert choices() == first


def test_a_greedy_answer_is_the_same_cold_warm_and_streamed(client, model):
    def greedy(**kw) -> str:
        return client.chat.completions.create(model=model, messages=COLORS, temperature=0, max_tokens=32, **kw)

    cold = greedy().choices[0].message.content
    assert greedy().choices[0].message.content == cold  # from the prefix cache
    stream = greedy(stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == cold
