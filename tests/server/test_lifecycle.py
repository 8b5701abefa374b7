"""Lifetime: step failures, an engine crash, drain on shutdown, the CLI's exit code."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
from support_fakes import FakeSampler
from support_servers import free_port, wait_healthy, wait_until

from atom_anyio.api.app import AtomApp
from atom_anyio.cli import serve
from atom_anyio.config import Config
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.request import EngineRequest
from atom_anyio.sampling_params import SamplingParams

CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_failed_step_ends_its_batch_with_an_error_and_the_next_request_succeeds(tiny_model):
    sampler = FakeSampler()
    engine = Engine(tiny_model, EngineConfig(kv_cache_gib=0.05), sampler)
    free = engine.block_manager.num_free_blocks
    ids = tiny_model.tokenizer("a failing prompt")["input_ids"]
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        sampler.fail(RuntimeError("injected kernel error"))
        async with engine.submit(EngineRequest.of_tokens(ids, SamplingParams(max_tokens=4), engine)) as stream:
            deltas = [d async for d in stream]
        assert deltas[-1].finish_reason == "error" and "injected kernel error" in deltas[-1].error
        sampler.restore()
        async with engine.submit(
            EngineRequest.of_tokens(ids, SamplingParams(max_tokens=4, ignore_eos=True), engine)
        ) as stream:
            deltas = [d async for d in stream]
        assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 4
        assert engine.is_running and engine.block_manager.num_free_blocks == free
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_repeated_step_failures_mark_the_server_unhealthy(tiny_model):
    sampler = FakeSampler()
    atom = AtomApp(Config.of(kv_cache_gib=0.05), loaded=tiny_model, sampler=sampler)
    async with atom.serving():
        client = atom.quart.test_client()
        assert (await client.get("/health")).status_code == 200
        sampler.fail(RuntimeError("injected step failure"))
        for _ in range(atom.runtime.engine.cfg.max_consecutive_step_failures):
            r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
            assert r.status_code in (500, 503)
            body = await r.get_json()
            assert set(body["error"]) == {"message", "type", "param", "code"}
        await wait_until(lambda: not atom.runtime.engine.is_running)
        health = await client.get("/health")
        assert health.status_code == 503 and "consecutive" in (await health.get_json())["error"]
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert r.status_code == 503 and (await r.get_json())["error"]["code"] == "engine_dead"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_crash_ends_in_flight_streams_with_an_error_event(tiny_model):
    sampler = FakeSampler()
    atom = AtomApp(Config.of(kv_cache_gib=0.05, max_consecutive_step_failures=1), loaded=tiny_model, sampler=sampler)
    async with atom.serving():
        engine = atom.runtime.engine
        client = atom.quart.test_client()
        result: dict = {}

        async def stream_request() -> None:
            r = await client.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            )
            result["status"], result["body"] = r.status_code, await r.get_data(as_text=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_request)
            await wait_until(lambda: engine.scheduler.running and engine.scheduler.running[0].num_output_tokens > 2)
            sampler.fail(RuntimeError("device lost"))
        assert result["status"] == 200
        events = [e[len("data: ") :] for e in result["body"].split("\n\n") if e]
        assert "[DONE]" not in events
        last = json.loads(events[-1])
        assert "device lost" in last["error"]["message"] and last["error"]["type"] == "server_error"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_shutdown_stops_admitting_and_drains_in_flight_requests(tiny_model):
    atom = AtomApp(Config.of(kv_cache_gib=0.05, drain_timeout_s=60), loaded=tiny_model)
    stop = anyio.Event()
    results: dict = {}

    async def run_server(*, task_status) -> None:
        async with atom.serving():
            task_status.started()
            await stop.wait()

    async def long_request() -> None:
        r = await atom.quart.test_client().post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 40, "ignore_eos": True}
        )
        results["long"] = (r.status_code, await r.get_json())

    async with anyio.create_task_group() as tg:
        await tg.start(run_server)
        tg.start_soon(long_request)
        engine = atom.runtime.engine
        await wait_until(lambda: engine.scheduler.running and engine.scheduler.running[0].num_output_tokens > 0)
        stop.set()
        await wait_until(lambda: not atom.runtime.is_admitting)
        refused = await atom.quart.test_client().post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert (await refused.get_json())["error"]["code"] == "shutting_down"
    status, body = results["long"]
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 40


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_exits_non_zero_when_the_engine_crashes(tiny_model):
    port = free_port()
    sampler = FakeSampler()
    atom = AtomApp(Config.of(kv_cache_gib=0.05, port=port), loaded=tiny_model, sampler=sampler)
    code: list[int] = []

    async def run() -> None:
        code.append(await serve(atom))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        base_url = f"http://127.0.0.1:{port}"
        await wait_healthy(base_url)
        async with httpx.AsyncClient(base_url=base_url) as http:
            sampler.fail(RuntimeError("injected"))
            for _ in range(atom.runtime.engine.cfg.max_consecutive_step_failures):
                await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert code == [1]
