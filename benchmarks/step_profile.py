"""Where a decode step's time goes (attention, GEMMs, the rest), by context
length, for each attention backend in the same run: ``torch`` (the portable
path, the baseline) and ``cpu`` (the C++ kernels). Also the KV bytes one step
reads and the rate the attention reads them at, beside this machine's memory
read bandwidth (a torch reduction over 256 MiB).

    python benchmarks/step_profile.py [--model DIR_OR_GGUF] [--batch 8] [--contexts 2048 32768]

Default model: the agentic benchmark's tiny random Llama with a 64k context.
The ``cpu`` rows are the fused decoder where the model allows it (one C++ call
per step: the profiler sees no op inside it, so its split is empty), and a
``cpu op by op`` row runs the same model without it.
Prints a table and one JSON line; never fails on a number.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import torch
from agentic import write_tiny_model
from machine import add_batch_invariant_option, machine
from torch.profiler import ProfilerActivity, profile

from atom_anyio import kernels
from atom_anyio.models.attention import AttentionMetadata
from atom_anyio.models.attention.metadata import kv_cache_torch_dtype, to_kv_cache
from atom_anyio.models.loader import load_model

# the portable path gathers each context with index_select: that is attention too
ATTENTION_OPS = {
    "atom::paged_attention",
    "aten::scaled_dot_product_attention",
    "aten::index_copy_",
    "aten::index_select",
}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul"}


def decode_step(model, batch: int, context: int, block_size: int = 16, kv_cache_dtype: str = "auto"):
    """A decode step of ``batch`` sequences at ``context`` tokens over a paged cache (blocks scattered),
    the cache in ``kv_cache_dtype`` (EngineConfig's)."""
    cfg = model.config
    per_seq = -(-(context + 1) // block_size)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    shape = (batch * per_seq * block_size, cfg.num_key_value_heads, cfg.head_dim)
    dtype = kv_cache_torch_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    # on huge pages where the OS lends them, as the engine's pool: on 4 KiB pages a scattered block's
    # first read is a TLB miss, and the step's time swung by a third from one allocation to the next
    pool, _ = kernels.empty_on_huge_pages((cfg.num_hidden_layers, 2, *shape), dtype)
    for layer in pool:
        for part in layer:
            part.copy_(to_kv_cache(torch.randn(shape), dtype))
    kv = [(layer[0], layer[1]) for layer in pool]
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    positions = torch.full((batch,), context)

    @torch.inference_mode()
    def step():
        meta = AttentionMetadata.build(tables, [context + 1] * batch, [1] * batch, block_size, torch.device("cpu"))
        return model.compute_logits(model(ids, positions, meta, kv))

    kv_bytes = batch * (context + 1) * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    return step, kv_bytes * dtype.itemsize


def run_as(model, use_fused: bool, step):
    model.use_fused = use_fused
    return step()


def interleaved(steps: dict, repeats: int) -> dict[str, float]:
    """Each step's best time over ``repeats`` rounds, the steps taken in turn within a round, so
    that a slower spell of this shared machine falls on every row alike rather than on one."""
    for step in steps.values():
        step()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def timed(step, repeats: int) -> float:
    step()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def breakdown(step) -> dict[str, float]:
    """Self CPU seconds per step of attention ops, GEMMs and everything else."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    out = {"attention": 0.0, "gemm": 0.0, "rest": 0.0}
    for e in prof.key_averages():
        kind = (
            "attention" if e.key in ATTENTION_OPS or "attention" in e.key else "gemm" if e.key in GEMM_OPS else "rest"
        )
        out[kind] += e.self_cpu_time_total / 1e6 / 3
    return out


def read_bandwidth() -> float:
    x = torch.ones(64 * 2**20)
    x.sum()
    best = min(timed(x.sum, 1) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF directory or GGUF (default: a tiny random Llama, 64k context)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto", help="auto keeps a GGUF's blocks quantized; float32 dequantizes")
    ap.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto"],
        help="each KV cache dtype (kv_cache_dtype) the fused cpu rows also run over, e.g. auto fp8 fp8_e5m2",
    )
    add_batch_invariant_option(ap, "auto: on in bfloat16 with AVX512-BF16; the attention's fixed partitions")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(write_tiny_model(Path(tmp)))
        plans = {
            name: load_model(path, dtype=args.dtype, attention_backend=name, batch_invariant=args.batch_invariant)
            for name in ("torch", "cpu")
        }
    loaded = {name: lm.model for name, lm in plans.items()}
    inv = bool(plans["cpu"].plan.batch_invariant)
    # label -> (model, use_fused, kv_cache_dtype): the cpu backend's steps run fused (models/fused.py) where the
    # model allows
    models = {
        "torch": (loaded["torch"], False, "auto"),
        "cpu": (loaded["cpu"], True, "auto"),
        "cpu op by op": (loaded["cpu"], False, "auto"),
    }
    models |= {f"cpu kv {kv}": (loaded["cpu"], True, kv) for kv in args.kv_cache_dtypes if kv != "auto"}
    bandwidth = read_bandwidth()
    rows = []
    for context in args.contexts:
        steps = {}
        for name, (model, use_fused, kv_cache_dtype) in models.items():
            step, kv_bytes = decode_step(model, args.batch, context, kv_cache_dtype=kv_cache_dtype)
            steps[name] = (functools.partial(run_as, model, use_fused, step), kv_bytes)
        best = interleaved({name: step for name, (step, _) in steps.items()}, args.repeats)
        for name, (step, kv_bytes) in steps.items():
            seconds = best[name]
            parts = breakdown(step)
            rows.append(
                {
                    "context": context,
                    "backend": name,
                    "step_ms": seconds * 1e3,
                    **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
                    "kv_mb_per_step": kv_bytes / 1e6,
                    "attention_gb_s": kv_bytes / parts["attention"] / 1e9 if parts["attention"] else None,
                }
            )
    print(
        f"\ndecode step, {args.batch} sequences, {args.threads} threads, batch_invariant {inv}; "
        f"memory read bandwidth {bandwidth:.1f} GB/s"
    )
    m = machine()
    print(f"CPU: {m['cpu']} ({' '.join(m['isa'])}), {m['cores']} cores")
    cols = ["context", "backend", "step_ms", "attention_ms", "gemm_ms", "rest_ms", "kv_mb_per_step", "attention_gb_s"]
    print("".join(f"{c:>16}" for c in cols))
    for r in rows:
        print("".join(f"{r[c]:>16.1f}" if isinstance(r[c], float) else f"{r[c]!s:>16}" for c in cols))
    speedups = {
        str(c): round(
            next(r["step_ms"] for r in rows if r["context"] == c and r["backend"] == "torch")
            / next(r["step_ms"] for r in rows if r["context"] == c and r["backend"] == "cpu"),
            3,
        )
        for c in args.contexts
    }
    result_fused = {
        str(c): round(
            next(r["step_ms"] for r in rows if r["context"] == c and r["backend"] == "cpu op by op")
            / next(r["step_ms"] for r in rows if r["context"] == c and r["backend"] == "cpu"),
            3,
        )
        for c in args.contexts
    }
    print(f"fused decoder speed-up over op by op, by context: {result_fused}")
    kv_speedups = {
        kv: {
            str(c): round(
                next(r["step_ms"] for r in rows if r["context"] == c and r["backend"] == "cpu")
                / next(r["step_ms"] for r in rows if r["context"] == c and r["backend"] == f"cpu kv {kv}"),
                3,
            )
            for c in args.contexts
        }
        for kv in args.kv_cache_dtypes
        if kv != "auto"
    }
    if kv_speedups:
        print(f"decode step (TPOT) speed-up of each KV cache dtype over the model's, by context: {kv_speedups}")
    result = {"bench": "step_profile", "batch": args.batch, "threads": args.threads, "read_bandwidth_gb_s": bandwidth}
    result["batch_invariant"] = inv
    result["machine"] = m
    result["fused_speedup_vs_op_by_op"] = result_fused
    result["kv_cache_dtype_speedup"] = kv_speedups
    result |= {"rows": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows]}
    print(json.dumps(result | {"cpu_speedup_vs_torch": speedups}))


if __name__ == "__main__":
    main()
