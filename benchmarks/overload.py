"""Overload: a burst of 4x what the server admits (``max_num_seqs`` running
plus ``max_waiting_seqs`` waiting), sent at once, a quarter of it to
``/v1/messages``. Beyond the limit only 503s (OpenAI routes) and 529s
(Messages) may come back; every accepted request must complete with the
greedy text the same prompt gets alone (a reference run first). Reports
the counts and the p50/p99 latency of accepted requests.

    python benchmarks/overload.py [--max-waiting-seqs 32] [--max-num-seqs 8] [--factor 4] [--model DIR_OR_GGUF]
    nox -s bench -- overload

Prints a table and one JSON line; never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import httpx
from agentic import WORDS, atom_command, free_port, launched, percentile, write_tiny_model
from machine import machine

NUM_PROMPTS = 16
MAX_TOKENS = 24


def prompt(i: int) -> str:
    j = i % NUM_PROMPTS
    return f"Request {j}: " + " ".join(WORDS[(j * 7 + k) % len(WORDS)] for k in range(40))


def request(i: int, model: str) -> tuple[str, dict]:
    messages = [{"role": "user", "content": prompt(i)}]
    if i % 4 == 3:
        return "/v1/messages", {"model": model, "max_tokens": MAX_TOKENS, "messages": messages, "temperature": 0}
    return "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


def text_of(path: str, data: dict) -> str:
    if path == "/v1/messages":
        return "".join(b.get("text", "") for b in data["content"])
    return data["choices"][0]["message"]["content"]


async def run(url: str, args: argparse.Namespace) -> dict:
    admits = args.max_num_seqs + args.max_waiting_seqs
    burst = args.factor * admits
    limits = httpx.Limits(max_connections=burst + 8, max_keepalive_connections=burst + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        reference = {}
        for i in range(2 * NUM_PROMPTS):  # each prompt alone, on both routes
            path, body = request(i, model)
            reference[path, i % NUM_PROMPTS] = text_of(path, (await client.post(path, json=body)).json())
        statuses: Counter[str] = Counter()
        latencies: list[float] = []
        wrong = 0

        async def one(i: int) -> None:
            nonlocal wrong
            path, body = request(i, model)
            t = time.perf_counter()
            r = await client.post(path, json=body)
            elapsed = time.perf_counter() - t
            kind = "messages" if path == "/v1/messages" else "chat"
            statuses[f"{kind} {r.status_code}"] += 1
            if r.status_code == 200:
                latencies.append(elapsed)
                got, want = text_of(path, r.json()), reference[path, i % NUM_PROMPTS]
                if got != want and not wrong:
                    print(
                        f"first wrong output ({path}, prompt {i % NUM_PROMPTS}):\n  got  {got!r}\n  want {want!r}",
                        file=sys.stderr,
                    )
                wrong += got != want
            elif r.status_code in (503, 529):
                assert "Retry-After" in r.headers
            else:
                print(f"unexpected {r.status_code}: {r.text[:300]}", file=sys.stderr)

        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(burst):
                tg.start_soon(one, i)
        elapsed = time.perf_counter() - t
        metrics = (await client.get("/metrics")).text
    rejected = {
        line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("atom_requests_rejected_total{")
    }
    accepted = sum(v for k, v in statuses.items() if k.endswith(" 200"))
    return {
        "admits": admits,
        "burst": burst,
        "statuses": dict(sorted(statuses.items())),
        "accepted": accepted,
        "refused": burst - accepted,
        "wrong_outputs": wrong,
        "rejected_by_reason": rejected,
        "burst_s": elapsed,
        "p50_ms": 1000 * percentile(latencies, 0.5) if latencies else None,
        "p99_ms": 1000 * percentile(latencies, 0.99) if latencies else None,
        "max_ms": 1000 * max(latencies) if latencies else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-waiting-seqs", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--model", default=None, help="default: a tiny random Llama written here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="atom-tiny-") as tmp:
        model = args.model or str(write_tiny_model(Path(tmp), 4096))
        port = free_port()
        env = {
            **os.environ,
            "ATOM_KV_CACHE_GIB": "0.25",
            "ATOM_MAX_NUM_SEQS": str(args.max_num_seqs),
            "ATOM_MAX_WAITING_SEQS": str(args.max_waiting_seqs),
            "ATOM_LOG_LEVEL": "warning",
        }
        with launched("atom_anyio", atom_command(model, port, 4096), env, port, 300) as target:
            r = anyio.run(run, target.url, args)
    rows = [
        ("admits (running + waiting)", f"{args.max_num_seqs} + {args.max_waiting_seqs} = {r['admits']}"),
        ("burst", r["burst"]),
        ("statuses", ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())),
        ("accepted / refused", f"{r['accepted']} / {r['refused']}"),
        ("accepted with wrong output", r["wrong_outputs"]),
        ("refused by reason (/metrics)", r["rejected_by_reason"]),
        ("burst duration s", f"{r['burst_s']:.1f}"),
        ("accepted latency p50 / p99 / max ms", f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} / {r['max_ms']:.0f}"),
    ]
    for name, value in rows:
        print(f"{name:38} {value}")
    print(
        json.dumps(
            {
                "benchmark": "overload",
                "machine": machine(),
                **{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()},
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
