"""Disconnect storm: N streaming chat requests, each cancelled at a random
point (while sending, before the first byte, after k chunks, or never), at
a fixed concurrency. Afterwards the server must hold nothing: every KV block
free, running == waiting == 0, no request in flight, no Sequence object
alive, and its RSS within 1% of what it was before the storm. Storms run
``--rounds`` times in a row after a warm-up; the last is the one reported
against the RSS before it, and every round's RSS is printed, so allocator
high-water growth (the first storm) is told apart from a leak (growth
every round).

    python benchmarks/disconnect_storm.py [--requests 1000] [--concurrency 64] [--model DIR_OR_GGUF]
    nox -s bench -- disconnect_storm

Prints a table and one JSON line; never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
from agentic import atom_command, free_port, launched, rss_bytes, write_tiny_model
from machine import machine
from prometheus_client.parser import text_string_to_metric_families

GAUGES = (
    "atom_kv_cache_blocks_free",
    "atom_kv_cache_blocks_total",
    "atom_requests_running",
    "atom_requests_waiting",
    "atom_requests_in_flight",
    "atom_sequences_alive",
)
CUTS = ("while sending", "before the first byte", "after k chunks", "never")


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in GAUGES}


def is_clean(g: dict[str, float]) -> bool:
    return (
        g["atom_kv_cache_blocks_free"] == g["atom_kv_cache_blocks_total"]
        and g["atom_requests_running"] == g["atom_requests_waiting"] == 0
        and g["atom_requests_in_flight"] == 0
        and g["atom_sequences_alive"] == 0
    )


async def storm(url: str, num: int, concurrency: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    cuts = {c: 0 for c in CUTS}
    limiter = anyio.CapacityLimiter(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        cut = rng.choice(CUTS)
        cuts[cut] += 1
        body = {
            "messages": [{"role": "user", "content": f"storm {i} " + "river stone " * rng.randint(1, 50)}],
            "max_tokens": rng.randint(1, 64),
            "ignore_eos": True,
            "stream": True,
        }
        async with limiter:
            with anyio.move_on_after(rng.uniform(0, 0.02) if cut == "while sending" else 120):
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if cut == "before the first byte":
                        return
                    k = rng.randint(1, 20)
                    async for _ in r.aiter_raw():
                        k -= 1
                        if cut == "after k chunks" and k == 0:
                            return

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client, anyio.create_task_group() as tg:
        for i in range(num):
            tg.start_soon(one, i, client)
    return cuts


async def settle(client: httpx.AsyncClient, timeout_s: float = 60) -> tuple[dict[str, float], float]:
    start = time.monotonic()
    g = await gauges(client)
    while not is_clean(g) and time.monotonic() - start < timeout_s:
        await anyio.sleep(0.2)
        g = await gauges(client)
    return g, time.monotonic() - start


async def run(url: str, pid: int, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await storm(url, args.warmup, args.concurrency, seed=1)
        await settle(client)
        rss = [rss_bytes(pid)]
        for r in range(args.rounds):  # the last round is the one reported; earlier ones show the trend
            t = time.perf_counter()
            cuts = await storm(url, args.requests, args.concurrency, seed=2 + r)
            elapsed = time.perf_counter() - t
            g, settle_s = await settle(client)
            rss.append(rss_bytes(pid))
        rss_before, rss_after = rss[-2], rss[-1]
    return {
        "rounds": args.rounds,
        "rss_by_round_mib": [round(x / 2**20, 1) for x in rss],
        "requests": args.requests,
        "concurrency": args.concurrency,
        "storm_s": elapsed,
        "settle_s": settle_s,
        "cuts": cuts,
        **{k.removeprefix("atom_"): v for k, v in g.items()},
        "clean": is_clean(g),
        "rss_before_mib": rss_before / 2**20,
        "rss_after_mib": rss_after / 2**20,
        "rss_change_pct": 100 * (rss_after - rss_before) / rss_before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6, help="storms in a row; RSS is compared across the last")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: a tiny random Llama written here")
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="atom-tiny-") as tmp:
        model = args.model or str(write_tiny_model(Path(tmp), args.max_model_len))
        port = free_port()
        env = {**os.environ, "ATOM_KV_CACHE_GIB": "0.25"}
        with launched("atom_anyio", atom_command(model, port, args.max_model_len), env, port, 300) as target:
            result = anyio.run(run, target.url, target.pid, args)
    rows = [
        ("requests (cancelled at random)", result["requests"]),
        ("cut points", ", ".join(f"{k}: {v}" for k, v in result["cuts"].items())),
        ("storm duration s", f"{result['storm_s']:.1f}"),
        ("settled after s", f"{result['settle_s']:.2f}"),
        ("KV blocks free / total", f"{result['kv_cache_blocks_free']:.0f} / {result['kv_cache_blocks_total']:.0f}"),
        ("running / waiting / in flight", f"{result['requests_running']:.0f} / {result['requests_waiting']:.0f} / "
         f"{result['requests_in_flight']:.0f}"),
        ("Sequence objects alive", f"{result['sequences_alive']:.0f}"),
        ("RSS after warm-up, each storm MiB", " -> ".join(f"{x:.1f}" for x in result["rss_by_round_mib"])),
        ("RSS before -> after last storm MiB", f"{result['rss_before_mib']:.1f} -> {result['rss_after_mib']:.1f} "
         f"({result['rss_change_pct']:+.2f}%)"),
        ("clean", result["clean"]),
    ]  # fmt: skip
    for name, value in rows:
        print(f"{name:32} {value}")
    print(
        json.dumps({"benchmark": "disconnect_storm", "machine": machine(), **{k: _round(v) for k, v in result.items()}})
    )


def _round(v):
    return round(v, 3) if isinstance(v, float) else v


if __name__ == "__main__":
    sys.exit(main())
