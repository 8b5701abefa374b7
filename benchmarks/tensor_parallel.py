"""Tensor parallelism against one rank, in one run: the offline ``LLM`` at
``tensor_parallel_size`` 1 and N on the same model and prompts (greedy,
``ignore_eos``), each generating a batch of B sequences of T tokens once to warm
up and then timed. Prints a table (output tok/s, mean decode step time from the
engine's own timings) and one JSON line; never fails on a number.

    python benchmarks/tensor_parallel.py                    # the default SmolLM2 GGUF, float32
    python benchmarks/tensor_parallel.py --model DIR --size 2 --batch 8 --tokens 64

Run it under ``flock /tmp/atom-bench.lock`` on a shared machine. On a CPU the
ranks split the cores (``num_threads / N`` each), so this measures the cost of
the collectives more than a speed-up.
"""

from __future__ import annotations

import argparse
import json
import time

from machine import machine

from atom_anyio.llm import LLM
from atom_anyio.sampling_params import SamplingParams


def measure(args: argparse.Namespace, size: int) -> dict[str, float]:
    llm = LLM(args.model, dtype=args.dtype, kv_cache_gib=0.25, tensor_parallel_size=size)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [f"Write a story number {i} about a river and a stone." for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm up
    engine = llm.engine
    steps, forward = engine.num_steps, engine.step_timings["forward"]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    num_steps = engine.num_steps - steps
    if size > 1:
        llm.engine.worker.close()
    return {
        "size": size,
        "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "step_ms": 1000 * (engine.step_timings["forward"] - forward) / num_steps,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2 GGUF)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--size", type=int, default=2, help="tensor_parallel_size to compare with 1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    one, many = measure(args, 1), measure(args, args.size)
    print(f"{'tensor_parallel_size':>22} {'out tok/s':>10} {'forward ms/step':>16}")
    for r in (one, many):
        print(f"{r['size']:>22} {r['out_tok_s']:>10.1f} {r['step_ms']:>16.2f}")
    same = one["token_ids"] == many["token_ids"]
    ratio = many["out_tok_s"] / one["out_tok_s"]
    print(f"tok/s ratio {args.size}/1: {ratio:.2f}; same greedy tokens: {same}")
    summary = {k: v for k, v in vars(args).items()}
    summary |= {"tok_s_1": one["out_tok_s"], f"tok_s_{args.size}": many["out_tok_s"], "ratio": ratio}
    summary |= {"step_ms_1": one["step_ms"], f"step_ms_{args.size}": many["step_ms"], "same_tokens": same}
    summary["machine"] = machine()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
