"""Async scheduling on and off: the same offline batch through ``LLM.generate`` with
``async_scheduling`` False (the baseline) and True, on the tiny random Llama (where the loop's
CPU work is a large share of a step) and the default SmolLM2-135M GGUF.

    flock /tmp/atom-bench.lock python benchmarks/async_scheduling.py [--num-prompts 32 --output-len 64]

The two settings alternate ``--repeats`` times per model (the median run of each is reported),
so drift on a shared machine hits both. ``--num-threads 1`` leaves the second core of a 2-core
machine to the loop (by default the forward's OpenMP threads take every core, and the loop's
work then competes with them instead of filling idle time). Per setting: output tok/s, mean step time (wall time / steps), and the
loop's own time per step (schedule + postprocess), and ``idle_ms``, the mean time between one
step's end and the next one's start on the worker's thread (the model waiting for the loop: what
async scheduling removes). ``bound``: the speed-up if that idle time went and nothing else changed
(off's step time over off's step time less its idle time). Also checks that both settings
gave the same tokens. Prints a table and one JSON line. Never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from agentic import write_tiny_model
from machine import machine
from offline_throughput import make_prompts

from atom_anyio import LLM, SamplingParams
from atom_anyio.models.loader import load_model


class StepClock:
    """When each step's ``execute`` began and ended on the worker's thread: the gaps between one
    step's end and the next one's start are the time the model sat idle, waiting for the loop."""

    def __init__(self, llm: LLM):
        self.spans: list[tuple[float, float]] = []
        execute = llm.engine.worker.execute

        def timed(step):
            start = time.perf_counter()
            try:
                return execute(step)
            finally:
                self.spans.append((start, time.perf_counter()))

        llm.engine.worker.execute = timed

    def mean_idle_ms(self) -> float:
        gaps = [b[0] - a[1] for a, b in zip(self.spans, self.spans[1:], strict=False)]
        return 1e3 * sum(gaps) / max(1, len(gaps))


def run_once(llm: LLM, clock: StepClock, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    eng = llm.engine
    eng.step_timings = dict.fromkeys(eng.step_timings, 0.0)
    eng.num_steps = 0
    clock.spans.clear()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(map(len, tokens))
    t = eng.step_timings
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "out_tok_s": n_out / elapsed,
        "steps": eng.num_steps,
        "step_ms": 1e3 * elapsed / eng.num_steps,
        "loop_ms": 1e3 * (t["schedule"] + t["postprocess"]) / eng.num_steps,
        "forward_ms": 1e3 * (t["forward"] + t["sample"]) / eng.num_steps,
        "idle_ms": clock.mean_idle_ms(),
        "tokens": tokens,
    }


def bench_model(name: str, path: str | None, args) -> dict:
    loaded = load_model(path)
    prompts = make_prompts(loaded.tokenizer, args.num_prompts, args.prompt_len)
    cfg = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_threads": args.num_threads,
        "speculative_config": "off",  # auto drafts only beside synchronous steps: the same work in both
    }
    llms = {setting: LLM(loaded, async_scheduling=setting, **cfg) for setting in (False, True)}
    clocks = {setting: StepClock(llm) for setting, llm in llms.items()}
    for llm in llms.values():  # warm-up: kernels, allocator, the first step of each shape
        llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for setting, llm in llms.items():
            r = run_once(llm, clocks[setting], prompts, args.output_len)
            print(f"{name} async_scheduling={setting}: {r['out_tok_s']:.1f} out tok/s", flush=True)
            runs[setting].append(r)
    same = all(r["tokens"] == runs[False][0]["tokens"] for r in (*runs[False], *runs[True]))
    median = {k: sorted(v, key=lambda r: r["out_tok_s"])[len(v) // 2] for k, v in runs.items()}
    for r in median.values():
        del r["tokens"]
    return {"off": median[False], "on": median[True], "identical_tokens": same}


def bound(r: dict) -> float:
    """The on/off ratio if the model never waited for the loop and its steps took no longer."""
    return r["off"]["step_ms"] / (r["off"]["step_ms"] - r["off"]["idle_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads of the forward (default: all)")
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="atom-tiny-") as tmp:
        for name in args.models:
            path = str(write_tiny_model(Path(tmp), hidden_size=64)) if name == "tiny" else None
            rows[name] = bench_model(name, path, args)

    print(
        f"\n{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, "
        f"torch threads {args.num_threads or torch.get_num_threads()}, median of {args.repeats}"
    )
    m = machine()
    print(f"CPU: {m['cpu']} ({' '.join(m['isa'])}), {m['cores']} cores")
    cols = ("out_tok_s", "steps", "step_ms", "loop_ms", "forward_ms", "idle_ms")
    print(f"{'model':<9}{'async':>7}" + "".join(f"{c:>12}" for c in cols) + f"{'on/off':>9}{'bound':>8}{'same':>6}")
    for name, r in rows.items():
        for setting in ("off", "on"):
            ratio = r["on"]["out_tok_s"] / r["off"]["out_tok_s"]
            cells = "".join(
                f"{r[setting][c]:>12.2f}" if isinstance(r[setting][c], float) else f"{r[setting][c]:>12}" for c in cols
            )
            tail = f"{ratio:>9.3f}{bound(r):>8.3f}{r['identical_tokens']!s:>6}" if setting == "on" else ""
            print(f"{name:<9}{setting:>7}{cells}{tail}")
    result = {
        "bench": "async_scheduling",
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "num_threads": args.num_threads or torch.get_num_threads(),
        "machine": m,
        **{
            f"{name}_{setting}_{key}": round(r[setting][key], 3)
            for name, r in rows.items()
            for setting in ("off", "on")
            for key in ("out_tok_s", "step_ms", "loop_ms", "idle_ms")
        },
        **{f"{name}_on_off_ratio": round(r["on"]["out_tok_s"] / r["off"]["out_tok_s"], 3) for name, r in rows.items()},
        **{f"{name}_bound": round(bound(r), 3) for name, r in rows.items()},
        **{f"{name}_identical_tokens": r["identical_tokens"] for name, r in rows.items()},
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
