"""A replica behind vllm-router (docs/operations.md): streaming, errors in the
API's shape and Retry-After pass through. Skipped when no ``vllm-router``
executable is found (``VLLM_ROUTER`` or the PATH; it lives in its own venv)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support_servers import Served, clean_env, free_port, running, wait_ready, wait_until

ROUTER = os.environ.get("VLLM_ROUTER") or shutil.which("vllm-router")
pytestmark = [
    pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (set VLLM_ROUTER to its executable)"),
    pytest.mark.anyio,
]
BODY = {"messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    """One served replica that admits one running and one waiting sequence; past that, 503 + Retry-After."""
    port = free_port()
    env = clean_env(
        model=str(tiny_model_dir), max_model_len="2048", kv_cache_gib="0.05", max_num_seqs="1", max_waiting_seqs="1"
    )
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    with running(cmd, env, port, tmp_path_factory.mktemp("replica") / "hypercorn.log") as served:
        yield served


@pytest.fixture(scope="module")
def router(replica: Served, tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    cmd += ["--worker-urls", replica.url, "--policy", "round_robin", "--disable-retries"]
    served = Served(f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("router") / "router.log")
    with served.log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, served)
        yield served
    finally:
        proc.send_signal(signal.SIGKILL)  # vllm-router does not exit on SIGTERM
        proc.wait()


async def sse_text(client: httpx.AsyncClient, url: str) -> tuple[str, list[str]]:
    async with client.stream("POST", f"{url}/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    deltas = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    return "".join(c["delta"].get("content") or "" for d in deltas for c in d["choices"]), frames


async def test_a_stream_through_the_router_is_the_replicas_stream(replica, router):
    async with httpx.AsyncClient(timeout=60) as client:
        direct, _ = await sse_text(client, replica.url)
        routed, frames = await sse_text(client, router.url)
    assert routed == direct and routed
    assert frames[-1] == "data: [DONE]"


async def test_an_api_error_passes_through_in_the_apis_shape(replica, router):
    bad = {**BODY, "max_tokens": 10**6}
    async with httpx.AsyncClient(timeout=60) as client:
        direct = await client.post(f"{replica.url}/v1/chat/completions", json=bad)
        routed = await client.post(f"{router.url}/v1/chat/completions", json=bad)
    assert direct.status_code == routed.status_code == 400
    assert routed.json() == direct.json()
    assert set(routed.json()["error"]) >= {"message", "type", "param", "code"}


async def test_an_overloaded_replicas_503_and_retry_after_pass_through(replica, router):
    long = {**BODY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:

        async def occupy() -> None:  # one running, then one waiting: the replica's admission is full
            async with client.stream("POST", f"{replica.url}/v1/chat/completions", json=long) as r:
                async for _ in r.aiter_bytes():
                    pass

        async def gauge(name: str) -> float:
            text = (await client.get(f"{replica.url}/metrics")).text
            return float(next(x for x in text.splitlines() if x.startswith(f"{name} ")).split()[-1])

        async def until(name: str) -> None:
            with anyio.fail_after(120):
                while await gauge(name) < 1:
                    await anyio.sleep(0.05)  # poll interval: the scrape is async, so not support_servers.wait_until

        async with anyio.create_task_group() as tg:
            tg.start_soon(occupy)
            await until("atom_requests_running")
            tg.start_soon(occupy)
            await until("atom_queue_waiting_seqs")
            direct = await client.post(f"{replica.url}/v1/chat/completions", json=BODY)
            routed = await client.post(f"{router.url}/v1/chat/completions", json=BODY)
            tg.cancel_scope.cancel()
    assert direct.status_code == routed.status_code == 503
    assert routed.headers["retry-after"] == direct.headers["retry-after"]
    assert routed.json() == direct.json()


# kv_aware: the router reads the replicas' KV events (docs/operations.md)


@pytest.fixture(scope="module")
def kv_replicas(tiny_model_dir, tmp_path_factory) -> Iterator[list[tuple[Served, int, int]]]:
    """Two replicas publishing KV events, each with its event and replay ports."""
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(2):
            port, events, replay = free_port(), free_port(), free_port()
            config = {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            env = clean_env(
                model=str(tiny_model_dir),
                max_model_len="4096",
                kv_cache_gib="0.05",
                num_threads="1",
                kv_events_config=json.dumps(config),
            )
            cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
            log_path = tmp_path_factory.mktemp(f"kv-replica{i}") / "hypercorn.log"
            out.append((stack.enter_context(running(cmd, env, port, log_path)), events, replay))
        yield out


@pytest.fixture(scope="module")
def kv_router(kv_replicas, tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port := free_port())]
    cmd += ["--policy", "kv_aware", "--disable-retries", "--worker-urls", *(r.url for r, _, _ in kv_replicas)]
    for r, events, replay in kv_replicas:
        cmd += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{events}"]
        cmd += ["--kv-event-replay-source", f"{r.url}=tcp://127.0.0.1:{replay}"]
    cmd += ["--kv-event-block-size", "16", "--kv-event-model", "tiny"]
    # the subscriber logs each event batch it applies ("kv_index live sequence advanced") at debug
    env = {
        **os.environ,
        "VLLM_ROUTER_TOKENIZER": str(tiny_model_dir),
        "RUST_LOG": "info,vllm_router_rs::kv_index=debug",
    }
    served = Served(f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("kv-router") / "router.log")
    served.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with served.log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, served)
        yield served
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


async def metric_sum(client: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    """A counter's value summed over its series (those with ``labels``), from a Prometheus text page."""
    text = (await client.get(url)).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def applied_from(url: str, line: str) -> bool:
    return "kv_index live sequence advanced" in line and url in line


async def test_kv_aware_routes_a_shared_prefix_to_the_replica_whose_events_hold_it(kv_replicas, kv_router):
    """The first request goes where the load is least; its prompt's blocks come back as BlockStored
    events, and every later request with that prefix is routed to the same replica as a prefix hit."""
    history = " ".join(f"step {i} of the plan" for i in range(120))  # ~600 tokens: dozens of full blocks
    urls = [r.url for r, _, _ in kv_replicas]

    def body(turn: int) -> dict:
        return {"messages": [{"role": "user", "content": f"{history}\nturn {turn}"}], "max_tokens": 2}

    async with httpx.AsyncClient(timeout=120) as client:

        async def queried() -> list[float]:
            return [await metric_sum(client, f"{u}/metrics", "vllm:prefix_cache_queries_total") for u in urls]

        before = await queried()
        assert (await client.post(f"{kv_router.url}/v1/chat/completions", json=body(0))).status_code == 200
        first = [a - b for a, b in zip(await queried(), before, strict=True)]
        owner = first.index(max(first))
        # the router has the prompt's blocks once it has read the owner's first event batch
        await wait_until(lambda: any(applied_from(urls[owner], line) for line in kv_router.log().splitlines()))
        for turn in range(1, 4):
            before = await queried()
            assert (await client.post(f"{kv_router.url}/v1/chat/completions", json=body(turn))).status_code == 200
            delta = [a - b for a, b in zip(await queried(), before, strict=True)]
            assert delta[owner] > 0 and delta[1 - owner] == 0, (turn, delta)
        hits = await metric_sum(client, kv_router.metrics_url, "vllm_router_kv_placement_lookups_total", result="hit")
    assert hits >= 3
