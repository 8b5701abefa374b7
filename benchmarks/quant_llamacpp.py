"""A quantized GGUF (default: SmolLM2-135M-Instruct Q4_1) served kept quantized
against the dequantized float32 path and llama.cpp's server on the same file:

* greedy agreement on the exactness prompts, quantized against dequantized (in process);
* weights memory: the bytes the model holds beside the file's tensor bytes, and each server's RSS;
* single-stream streaming chat: TTFT and inter-token latency, the three servers one after the other.

    flock /tmp/atom-bench.lock python benchmarks/quant_llamacpp.py [--llamacpp-python /work/llamacpp-venv/bin/python]

llama.cpp: ``pip install 'llama-cpp-python[server]'`` into its own venv (it builds from source in minutes).
Prints a table and one JSON line; never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable

import anyio
import gguf
import httpx
import psutil
from agentic import atom_command, free_port, launched
from machine import machine
from serve import _fmt, _ratio, make_prompts, one_request, summarize

from atom_anyio import LLM, SamplingParams
from atom_anyio.models import quant
from atom_anyio.models.loader import default_model_path

# questions with short factual answers: greedy tokens that a wrong matmul changes early
EXACTNESS_PROMPTS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to play the guitar.",
    "What does CPU stand for?",
    "Describe the water cycle briefly.",
]
END_TOKENS = (0, 2)  # <|endoftext|>, <|im_end|>: blocked for fixed-length runs (llama.cpp ignores ignore_eos)


def greedy_agreement(model: str, max_tokens: int) -> dict:
    """Greedy completions of the exactness prompts, quantized (dtype auto) against dequantized (float32)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    runs, weights = {}, {}
    for label, dtype in (("quantized", "auto"), ("dequantized", "float32")):
        llm = LLM(model, dtype=dtype, kv_cache_gib=0.25)
        outs = [llm.chat([{"role": "user", "content": p}], params)[0].outputs[0] for p in EXACTNESS_PROMPTS]
        runs[label] = [o.token_ids for o in outs]
        weights[label] = quant.weight_bytes(llm.loaded.model)
        if label == "quantized":
            texts = [o.text for o in outs]
        del llm
    pairs = list(zip(runs["quantized"], runs["dequantized"], strict=True))
    return {
        "num_prompts": len(pairs),
        "identical": sum(a == b for a, b in pairs),
        "mean_common_prefix": sum(common_prefix(a, b) / max(len(a), len(b), 1) for a, b in pairs) / len(pairs),
        "weights_mb": {k: v / 1e6 for k, v in weights.items()},
        "file_tensor_mb": sum(int(t.n_bytes) for t in gguf.GGUFReader(model).tensors) / 1e6,
        "sample": texts[0],
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# servers


def atom_cmd(dtype: str, threads: int) -> Callable[[argparse.Namespace, int], list[str]]:
    extra = ["--dtype", dtype, "--num-threads", str(threads), "--kv-cache-gib", "0.25"]  # small KV: RSS is weights
    return lambda args, port: atom_command(args.model, port, args.max_model_len) + extra


def llamacpp_cmd(threads: int) -> Callable[[argparse.Namespace, int], list[str]]:
    return lambda args, port: [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.model, "--host", "127.0.0.1"] + [
        "--port", str(port), "--n_ctx", str(args.max_model_len), "--n_threads", str(threads),
        "--n_threads_batch", str(threads), "--interrupt_requests", "False", "--logits_all", "False",
    ]  # fmt: skip


async def single_stream(url: str, prompts: list[str], args: argparse.Namespace) -> dict:
    """The prompts one at a time (a warm-up first), each streamed for exactly ``max_tokens`` tokens."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        def body(prompt: str, max_tokens: int) -> dict:
            return {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logit_bias": {str(t): -100 for t in END_TOKENS},
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        chat = f"{url}/v1/chat/completions"
        await one_request(client, chat, body("Warm up.", 8), {})
        start = time.perf_counter()
        results = [await one_request(client, chat, body(p, args.max_tokens), {}) for p in prompts]
        return summarize(model, results, time.perf_counter() - start)


def measure_servers(args: argparse.Namespace) -> dict[str, dict]:
    cores = os.cpu_count()
    targets = [("atom quantized", atom_cmd("auto", cores), "/health")]
    targets += [(f"atom quantized {t}t", atom_cmd("auto", t), "/health") for t in args.threads if t != cores]
    targets.append(("atom float32", atom_cmd("float32", cores), "/health"))
    if shutil.which(args.llamacpp_python):
        for threads in args.threads:
            label = "llama.cpp" if threads == cores else f"llama.cpp {threads}t"
            targets.append((label, llamacpp_cmd(threads), "/v1/models"))
    else:
        print(f"skipping llama.cpp: no Python at {args.llamacpp_python!r}", file=sys.stderr)
    prompts = make_prompts(args.num_requests, args.prompt_len, args.seed)
    rows = {}
    for label, command, health in targets:
        port = free_port()
        try:
            with launched(label, command(args, port), dict(os.environ), port, args.start_timeout, health) as target:
                rows[label] = anyio.run(single_stream, target.url, prompts, args)
                rows[label]["rss_mb"] = psutil.Process(target.pid).memory_info().rss / 1e6
        except (RuntimeError, httpx.HTTPError) as exc:  # one target down must not lose the others
            print(f"skipping {label}: {exc}", file=sys.stderr)
    return rows


# report

ROWS = [
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p90 ms", "itl_p90_ms", "{:.1f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("output tok/s", "output_tok_s", "{:.1f}"),
    ("server RSS MB", "rss_mb", "{:.0f}"),
    ("errors", "errors", "{:d}"),
]


def print_report(agreement: dict, rows: dict[str, dict], args: argparse.Namespace) -> None:
    a, w = agreement, agreement["weights_mb"]
    print(f"\ngreedy ({args.agreement_tokens} tokens), quantized vs dequantized, {a['num_prompts']} exactness prompts:")
    print(f"  identical {a['identical']}/{a['num_prompts']}, mean common prefix {a['mean_common_prefix']:.0%}")
    print(f"  e.g. {a['sample']!r}")
    print(f"weights held, MB: quantized {w['quantized']:.1f} ({w['quantized'] / a['file_tensor_mb']:.2f}x the file's")
    print(f"  {a['file_tensor_mb']:.1f} MB of tensors), dequantized float32 {w['dequantized']:.1f}")
    if not rows:
        return
    labels = list(rows)
    peer = "llama.cpp" if "llama.cpp" in rows else labels[-1]
    print(f"\nsingle stream: {args.num_requests} chats, ~{args.prompt_len} prompt words, {args.max_tokens} tokens each")
    print(f"{'':<15}" + "".join(f"{label:>20}" for label in labels) + f"{'quantized / ' + peer:>26}")
    for name, key, fmt in ROWS:
        cells = "".join(f"{_fmt(rows[label].get(key), fmt):>20}" for label in labels)
        ratio = _ratio(rows.get("atom quantized", {}).get(key), rows[peer].get(key))
        print(f"{name:<15}{cells}{_fmt(ratio, '{:.2f}x'):>26}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a quantized GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--llamacpp-python", default="/work/llamacpp-venv/bin/python")
    ap.add_argument(
        "--threads",
        type=lambda v: [int(t) for t in v.split(",")],
        default=[os.cpu_count()],
        help="thread counts, a quantized atom_anyio and a llama.cpp target each (default: every core)",
    )
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt length in words, approximately")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--agreement-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--skip-servers", action="store_true", help="only the in-process agreement and memory")
    args = ap.parse_args()
    args.model = args.model or default_model_path()

    agreement = greedy_agreement(args.model, args.agreement_tokens)
    rows = {} if args.skip_servers else measure_servers(args)
    print_report(agreement, rows, args)
    peer = rows.get("llama.cpp", {})
    result = {
        "bench": "quant_llamacpp",
        "model": os.path.basename(args.model),
        "machine": machine(),
        "agreement": {k: v for k, v in agreement.items() if k != "sample"},
        "targets": {label: {k: _round(v) for k, v in r.items()} for label, r in rows.items()},
        "itl_p50_ratio_quantized_vs_llamacpp": _round(
            _ratio(rows.get("atom quantized", {}).get("itl_p50_ms"), peer.get("itl_p50_ms"))
        ),
    }
    result["itl_p50_ratio_best_vs_best"] = _round(_ratio(best_itl(rows, "atom quantized"), best_itl(rows, "llama.cpp")))
    print(
        f"best ITL p50, atom quantized / llama.cpp (each at its best thread count): {result['itl_p50_ratio_best_vs_best']}"
    )
    print(json.dumps(result))
    sys.stdout.flush()


def best_itl(rows: dict[str, dict], prefix: str) -> float | None:
    itls = [r["itl_p50_ms"] for label, r in rows.items() if label.startswith(prefix) and r.get("itl_p50_ms")]
    return min(itls, default=None)


def _round(value):
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    main()
