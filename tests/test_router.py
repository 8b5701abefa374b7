"""A replica behind vllm-router (docs/operations.md): streaming, errors in the
API's shape and Retry-After pass through. Skipped when no ``vllm-router``
executable is found (``VLLM_ROUTER`` or the PATH; it lives in its own venv)."""

from __future__ import annotations

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
from support import Served, clean_env, free_port, running, wait_ready

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
                    await anyio.sleep(0.05)  # poll interval: the scrape is async, so not support.wait_until

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
