"""The server under test, as the tests reach it: free ports, bounded polling, an ``AtomApp``
serving in this event loop, real hypercorn in-process, and the server as a subprocess started
and stopped the way an operator would."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from support_fakes import FakeSampler

READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until(predicate: Callable[[], Any], timeout: float = 30) -> None:
    """Poll a condition (bounded), for state with no event to wait on."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


async def wait_healthy(base_url: str, timeout: float = 60) -> None:
    """Until GET /health answers 200: the readiness endpoint, not a fixed sleep."""
    async with httpx.AsyncClient(base_url=base_url) as http:
        with anyio.fail_after(timeout):
            while True:
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.05)


@asynccontextmanager
async def served_over_http(app: Any, port: int | None = None) -> AsyncIterator[str]:
    """Real hypercorn serving ``app`` on 127.0.0.1 in this event loop; yields
    the base URL and shuts down gracefully (the lifespan drains) at exit."""
    port = port or free_port()
    hc = HypercornConfig()
    hc.bind, hc.accesslog = [f"127.0.0.1:{port}"], None
    stop = anyio.Event()
    base_url = f"http://127.0.0.1:{port}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(hypercorn_serve, app, hc, shutdown_trigger=stop.wait))
        await wait_healthy(base_url)
        try:
            yield base_url
        finally:
            stop.set()


@asynccontextmanager
async def serving_app(loaded: Any, sampler: Any = None, **config: Any) -> AsyncIterator[Any]:
    """An ``AtomApp`` over an already loaded model, serving (engine loop running) until the block
    exits; its engine's sampler is ``sampler``, by default a ``FakeSampler`` (the real sampler until
    a test scripts it: support_fakes.scripted)."""
    from atom_anyio.api.app import AtomApp
    from atom_anyio.config import Config

    atom = AtomApp(Config.of(**config), loaded=loaded, sampler=sampler or FakeSampler())
    async with atom.serving():
        yield atom


# the server as a subprocess


@dataclass
class Served:
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running(cmd: list[str], env: dict[str, str], port: int, log_path: Path) -> Iterator[Served]:
    """Start ``cmd``, wait until /health answers 200, yield; then SIGTERM and require exit 0."""
    served = Served(f"http://127.0.0.1:{port}", log_path)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, served)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    try:
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"server did not exit within {EXIT_TIMEOUT_S} s of SIGTERM; its output:\n{served.log()}")
        assert rc == 0, f"server exited {rc} on SIGTERM; its output:\n{served.log()}"


def wait_ready(proc: subprocess.Popen, served: Served) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode} before it was ready; its output:\n{served.log()}")
        try:
            if httpx.get(f"{served.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # poll interval
    pytest.fail(f"server not ready after {READY_TIMEOUT_S} s; its output:\n{served.log()}")


def clean_env(**atom: str) -> dict[str, str]:
    """The environment without the ATOM_ settings, but for ATOM_KERNEL_ISA: the CPU kind the suite
    runs as (with ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY, which pass through), not a setting
    under test; a server without it ran as neither that kind nor this CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_") or k == "ATOM_KERNEL_ISA"}
    return {**env, **{f"ATOM_{k.upper()}": v for k, v in atom.items()}}
