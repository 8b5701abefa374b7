"""Soak: many short requests at a fixed concurrency, with ``/metrics`` scraped
once a second (each scrape timed). Per window: requests, latency, server RSS,
the share of wall time in gen-2 GC, and the /metrics p50 latency and size. The
closing numbers: RSS growth from the first window to the last, the gen-2 GC
share, and /metrics p50 last/first. Never fails on a number.

    python benchmarks/soak.py                            # starts atom_anyio (tiny model): 20,000 requests at 64
    python benchmarks/soak.py --num-requests 5000 --window 60
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid PID
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import httpx
from agentic import (
    Target,
    Windowed,
    add_target_arguments,
    measure_each_target,
    percentile,
    print_side_by_side,
    print_table,
    rounded,
    sample_server,
    scrape,
    text,
)
from machine import machine

COLUMNS = [
    ("win", "window", "{:d}"),
    ("requests", "requests", "{:d}"),
    ("req/s", "requests_s", "{:.1f}"),
    ("e2e p50 ms", "e2e_p50_ms", "{:.0f}"),
    ("e2e p99 ms", "e2e_p99_ms", "{:.0f}"),
    ("RSS MiB", "rss_mib", "{:.1f}"),
    ("gen2 GC %", "gc2_share_pct", "{:.4f}"),
    ("/metrics ms", "metrics_p50_ms", "{:.2f}"),
    ("/metrics B", "metrics_bytes", "{:d}"),
    ("lag p99 ms", "lag_p99_ms", "{:.1f}"),
    ("errors", "errors", "{:d}"),
]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> str | None:
    """One chat completion, streamed or not; the error, if any."""
    try:
        if not body["stream"]:
            resp = await client.post(f"{url}/v1/chat/completions", json=body)
            return None if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:200]}"
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    return line[:200]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


async def run_target(target: Target, args: argparse.Namespace) -> list[dict]:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(connect=10, read=600, write=60, pool=600)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        model = args.model or (await client.get(f"{target.url}/v1/models")).json()["data"][0]["id"]
        done: list[tuple[float, float, str | None]] = []  # (end, seconds, error)
        todo = iter(range(args.num_requests))

        async def worker() -> None:
            for i in todo:  # the shared iterator hands each request to one worker
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Request {i}: " + text(args.prompt_tokens, str(i))}],
                    "max_tokens": args.max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": i % 2 == 1,
                }
                start = time.monotonic()
                error = await one_request(client, target.url, body)
                done.append((time.monotonic(), time.monotonic() - start, error))

        w = Windowed(args.window, time.monotonic())
        w.baseline = await scrape(client, target.url)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_server, client, target, w)
            async with anyio.create_task_group() as load:
                for _ in range(args.concurrency):
                    load.start_soon(worker)
            await anyio.sleep(1.1)  # one more sample after the last request
            tg.cancel_scope.cancel()
        elapsed = done[-1][0] - w.start if done else 0.0
    rows = [window_row(i, w, done, elapsed) for i in range(w.index(w.start + elapsed) + 1)]
    return rows


def window_row(i: int, w: Windowed, done: list[tuple[float, float, str | None]], elapsed: float) -> dict:
    mine = [(s, e) for end, s, e in done if w.index(end) == i]
    seconds = [s for s, e in mine if e is None]
    duration = min(w.window_s, elapsed - i * w.window_s)  # the last window is partial
    return {
        "window": i,
        "duration_s": duration,
        "requests": len(seconds),
        "errors": len(mine) - len(seconds),
        "requests_s": len(seconds) / duration if duration > 0 else None,
        "e2e_p50_ms": _ms(percentile(seconds, 0.5)),
        "e2e_p99_ms": _ms(percentile(seconds, 0.99)),
        **w.server_row(i),
        "error_sample": next((e for _, e in mine if e), None),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def closing(rows: list[dict]) -> dict:
    """RSS growth first->last window, gen-2 GC share (worst window), /metrics p50 last/first."""
    first, last = rows[0], rows[-1]
    shares = [r["gc2_share_pct"] for r in rows if r["gc2_share_pct"] is not None]
    return {
        "requests": sum(r["requests"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "rss_first_mib": first["rss_mib"],
        "rss_last_mib": last["rss_mib"],
        "rss_growth_pct": 100 * (last["rss_mib"] / first["rss_mib"] - 1)
        if first["rss_mib"] and last["rss_mib"]
        else None,
        "gc2_share_pct_max": max(shares) if shares else None,
        "gc2_share_pct_mean": sum(shares) / len(shares) if shares else None,
        "metrics_p50_last_over_first": (
            last["metrics_p50_ms"] / first["metrics_p50_ms"]
            if first["metrics_p50_ms"] and last["metrics_p50_ms"]
            else None
        ),
        "metrics_bytes_first": first["metrics_bytes"],
        "metrics_bytes_last": last["metrics_bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(ap)
    ap.add_argument("--num-requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--window", type=float, default=120.0, help="seconds per reported window")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    args.start_atom = args.start_atom or not args.base_url

    results = measure_each_target(
        args, run_target, lambda t: f"soaking {t.label}: {args.num_requests} requests at {args.concurrency}"
    )
    print(
        f"\nsoak: {args.num_requests} chat requests (~{args.prompt_tokens} prompt tokens, {args.max_tokens} output "
        f"tokens, half streamed) at concurrency {args.concurrency}, /metrics scraped every second, "
        f"{args.window:.0f} s windows"
    )
    for label, rows in results.items():
        print_table(label, rows, COLUMNS)
    if len(results) > 1:
        print_side_by_side(results, [COLUMNS[2], COLUMNS[5], COLUMNS[7]])
    summary = {label: closing(rows) for label, rows in results.items()}
    for label, s in summary.items():
        print(
            f"{label}: RSS {_f(s['rss_growth_pct'], '{:+.2f}')}% first->last window, gen-2 GC share "
            f"{_f(s['gc2_share_pct_max'], '{:.4f}')}% (worst window), /metrics p50 last/first "
            f"{_f(s['metrics_p50_last_over_first'], '{:.2f}')}"
        )
    line = {"bench": "soak", "args": vars(args), "machine": machine(), "summary": summary, "windows": results}
    print(json.dumps(rounded(line)))


def _f(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


if __name__ == "__main__":
    main()
