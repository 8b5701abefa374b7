"""Replicas behind vllm-router under the agentic load: the prefix-cache hit
ratio and output tok/s of one replica alone, then of two replicas behind
``vllm-router`` with ``round_robin``, ``cache_aware`` and ``kv_aware`` (fed
by the replicas' KV events), in one run.

    flock /tmp/atom-bench.lock python benchmarks/router.py [--router PATH/vllm-router] [--duration 90]

Each configuration starts fresh ``hypercorn atom_anyio:app`` replicas (cold
caches), the router in front of them, and the agents of benchmarks/agentic.py
(each resends its growing history every turn). The hit ratio is
``vllm:prefix_cache_hits / vllm:prefix_cache_queries`` summed over the
replicas, from their ``/metrics``; the share is each replica's part of the
prompt tokens. On a 2-core machine the replicas share the cores, so the hit
ratio is the figure to read; tok/s only compares runs made together.
A table and one JSON line; never fails on a number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
from agentic import Target, Turn, agent, free_port, launched, percentile, write_tiny_model
from machine import machine
from prometheus_client.parser import text_string_to_metric_families

POLICIES = ("round_robin", "cache_aware", "kv_aware")
BLOCK_SIZE = 16


def kv_events_config(port: int, replay_port: int) -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}"}
    )


@contextlib.contextmanager
def replicas(n: int, model: str, tmp: Path, args: argparse.Namespace) -> Iterator[list[tuple[Target, int, int]]]:
    """``n`` fresh ``hypercorn atom_anyio:app`` replicas, each with its KV-event and replay ports."""
    toml = tmp / "hypercorn.toml"
    toml.write_text("startup_timeout = 900\ngraceful_timeout = 5\n")  # start-up on a loaded 2-core VM
    hypercorn = str(Path(sys.executable).with_name("hypercorn"))
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(n):
            port, events, replay = free_port(), free_port(), free_port()
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("ATOM_")},
                "ATOM_MODEL": model,
                "ATOM_MAX_MODEL_LEN": str(args.max_model_len),
                "ATOM_KV_CACHE_GIB": str(args.kv_cache_gib),
                "ATOM_NUM_THREADS": str(args.threads_per_replica),
                "ATOM_LOG_FORMAT": "json",
                "ATOM_KV_EVENTS_CONFIG": kv_events_config(events, replay),
            }
            cmd = [hypercorn, "-c", str(toml), "--bind", f"127.0.0.1:{port}", "atom_anyio:app"]
            target = stack.enter_context(launched(f"replica{i}", cmd, env, port, args.start_timeout))
            out.append((target, events, replay))
        yield out


def router_command(args: argparse.Namespace, policy: str, port: int, reps: list[tuple[Target, int, int]], model: str):
    cmd = [args.router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    cmd += ["--policy", policy, "--worker-urls", *(t.url for t, _, _ in reps)]
    if policy == "kv_aware":
        for t, events, replay in reps:
            cmd += ["--kv-event-source", f"{t.url}=tcp://127.0.0.1:{events}"]
            cmd += ["--kv-event-replay-source", f"{t.url}=tcp://127.0.0.1:{replay}"]
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
    return cmd


@contextlib.contextmanager
def routed(args: argparse.Namespace, policy: str, reps: list[tuple[Target, int, int]], model_dir: str):
    port = free_port()
    model = Path(model_dir).name
    env = {**os.environ, "VLLM_ROUTER_TOKENIZER": model_dir}  # kv_aware tokenizes with it
    with launched(f"router-{policy}", router_command(args, policy, port, reps, model), env, port, 120) as router:
        try:
            yield router
        finally:
            os.kill(router.pid, signal.SIGKILL)  # vllm-router does not exit on SIGTERM/SIGINT


async def prefix_counts(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    out = {"hits": 0.0, "queries": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
                out["hits" if "hits" in s.name else "queries"] += s.value
    return out


async def run_load(url: str, reps: list[tuple[Target, int, int]], args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.agents + 4)
    timeout = httpx.Timeout(connect=10, read=600, write=60, pool=600)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = (await client.get(f"{reps[0][0].url}/v1/models")).json()["data"][0]["id"]
        before = [await prefix_counts(client, t.url) for t, _, _ in reps]
        turns: list[Turn] = []
        start = time.monotonic()
        with anyio.move_on_after(args.duration):
            async with anyio.create_task_group() as tg:
                for n in range(args.agents):
                    tg.start_soon(agent, n, client, url, model, args, turns)
        elapsed = time.monotonic() - start
        after = [await prefix_counts(client, t.url) for t, _, _ in reps]
    queries = [a["queries"] - b["queries"] for a, b in zip(after, before, strict=True)]
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    done = [t for t in turns if t.error is None]
    return {
        "turns": len(done),
        "errors": len(turns) - len(done),
        "output_tok_s": sum(t.num_output_tokens for t in done) / elapsed,
        "hit_ratio": hits / sum(queries) if sum(queries) else None,
        "prompt_share": [q / sum(queries) if sum(queries) else None for q in queries],
        "ttft_p50_ms": _ms(percentile([t.ttft_s for t in done if t.ttft_s is not None], 0.5)),
        "first_error": next((t.error for t in turns if t.error), None),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else 1e3 * s


def measure(args: argparse.Namespace, model_dir: str, tmp: Path) -> dict[str, dict]:
    results = {}
    with replicas(1, model_dir, tmp, args) as reps:
        print("one replica, no router", file=sys.stderr)
        results["1 replica"] = anyio.run(run_load, reps[0][0].url, reps, args)
    for policy in args.policies:
        with replicas(2, model_dir, tmp, args) as reps, routed(args, policy, reps, model_dir) as router:
            print(f"two replicas behind vllm-router --policy {policy}", file=sys.stderr)
            results[f"2 x {policy}"] = anyio.run(run_load, router.url, reps, args)
    return results


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def print_table(results: dict[str, dict]) -> None:
    base = results["1 replica"]["output_tok_s"]
    print(f"\n{'configuration':<18}{'turns':>7}{'errors':>8}{'out tok/s':>11}{'x 1 replica':>13}{'hit ratio':>11}"
          f"{'prompt share':>16}{'TTFT p50 ms':>13}")  # fmt: skip
    for label, r in results.items():
        share = "/".join(fmt(s, "{:.2f}") for s in r["prompt_share"])
        print(
            f"{label:<18}{r['turns']:>7}{r['errors']:>8}{r['output_tok_s']:>11.1f}{r['output_tok_s'] / base:>13.2f}"
            f"{fmt(r['hit_ratio'], '{:.3f}'):>11}{share:>16}{fmt(r['ttft_p50_ms'], '{:.0f}'):>13}"
        )
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", default=shutil.which("vllm-router"), help="the vllm-router executable")
    ap.add_argument("--model", help="HF directory (default: a tiny random Llama written here)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of load per configuration")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--tool-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=float, default=0.1, help="per replica: less than all agents' histories")
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    args = ap.parse_args()
    if not args.router:
        sys.exit("vllm-router not found: pip install vllm-router (its own venv), then pass --router PATH")
    with tempfile.TemporaryDirectory(prefix="atom-router-") as tmp:
        model_dir = args.model or str(write_tiny_model(Path(tmp) / "tiny-llama", args.max_model_len))
        results = measure(args, model_dir, Path(tmp))
    print(
        f"\nrouter: {args.agents} agents, ~{args.system_tokens}-token system prompt, ~{args.tool_tokens}-token tool "
        f"results, {args.max_tokens} output tokens, {args.duration:.0f} s per configuration, "
        f"{args.kv_cache_gib} GiB KV per replica"
    )
    print_table(results)
    print(json.dumps({"bench": "router", "args": vars(args), "machine": machine(), "results": results}))


if __name__ == "__main__":
    main()
