"""Which weight layout and activation dtype is fastest on this CPU: the
numbers ``dtype=auto`` and ``gguf_weights=auto`` should follow.

    python benchmarks/layouts.py [--batch 16] [--prompt-len 512] [--output-len 32]

Each layout (``dtype`` + ``gguf_weights``) loads the default model in this
process, one after the other, and runs a batch of prompts (prefill included)
and then one stream alone, with ``LLM.generate`` and greedy decoding. Prints a
table and one JSON line with the machine; never fails on a number.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from machine import machine
from words import WORDS

from atom_anyio import LLM, SamplingParams
from atom_anyio.models.loader import load_model

LAYOUTS = [
    ("auto", "auto"),
    ("bfloat16", "both"),
    ("bfloat16", "packed"),
    ("bfloat16", "dequantize"),
    ("float32", "both"),
    ("float32", "packed"),
    ("float32", "dequantize"),
]


def prompts(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(length)) for i in range(n)]


def out_tok_s(llm: LLM, texts: list[str], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def measure(dtype: str, weights: str, args) -> dict:
    loaded = load_model(None, dtype, "cpu", None, 1, gguf_weights=weights)
    llm = LLM(loaded, speculative_config="off")  # auto drafts only where invariant: layouts alone here
    out_tok_s(llm, prompts(2, 32, seed=99), 4)  # warm-up
    batched = out_tok_s(llm, prompts(args.batch, args.prompt_len, seed=1), args.output_len)
    single = out_tok_s(llm, prompts(1, 200, seed=2), args.single_len)
    row = {
        "resolved": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "batched": batched,
        "single": single,
    }
    del llm, loaded
    gc.collect()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--single-len", type=int, default=64)
    ap.add_argument("--layouts", nargs="*", help="dtype+weights pairs, e.g. bfloat16+both (default: all)")
    args = ap.parse_args()
    layouts = [tuple(x.split("+")) for x in args.layouts] if args.layouts else LAYOUTS
    rows = {f"{d}+{w}": measure(d, w, args) for d, w in layouts}
    print(f"\n| dtype + gguf_weights | resolved dtype | batch of {args.batch}, out tok/s | one stream, out tok/s |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['resolved']} | {r['batched']:.1f} | {r['single']:.1f} |")
    rounded = {k: {"batched": round(r["batched"], 2), "single": round(r["single"], 2)} for k, r in rows.items()}
    print(json.dumps({"bench": "layouts", "machine": machine(), "batch": args.batch, "layouts": rounded}))


if __name__ == "__main__":
    main()
