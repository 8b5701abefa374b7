"""The default model's decoder linears on each bfloat16 kernel, by row count: which GEMM a
layout runs, and what batch invariance costs or saves at each size.

    python benchmarks/linears.py [--rows 1 4 8 16 64 555] [--repeats 15] [--rounds 3]
    nox -s bench -- linears

SmolLM2-135M's 30 layers (the default GGUF: Q4_1 blocks, loaded in bfloat16 with dense
copies) run x W^T for every linear at each row count on:

* ``gemv``: the int16 GEMV over the GGUF blocks (``qgemv``), what the default decode runs at 1-4
  rows without batch invariance;
* ``onednn``: oneDNN's packed bfloat16 GEMM over the dense copy, what that default runs past four;
* ``dense_tiles``: the tile GEMM over the dense copy's bfloat16 tiles (AMX where lent, else
  AVX512-BF16's pair products);
* ``blocks_chain``: the tile GEMM over the blocks' quantized tiles, which without AMX is the
  blocks' chain (kernels/csrc/gemm.cpp), what batch invariance runs there at any row count.

Each cell is the median of ``--repeats`` calls, best of ``--rounds`` rounds taken in turn, so a
slow spell of a shared machine falls on every kernel alike. Prints a table (ms for all 30 layers,
and each kernel's time over the default's: ``gemv`` up to four rows, ``onednn`` beyond) and one
JSON line. Needs AVX512-BF16 (the tile GEMM); never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from machine import machine

from atom_anyio import kernels
from atom_anyio.models.loader import load_model
from atom_anyio.models.ops import pack_tile_qweight, pack_tile_weight
from atom_anyio.models.quant import QuantizedWeight

KERNELS = ("gemv", "onednn", "dense_tiles", "blocks_chain")


def layer_weights() -> list[dict]:
    """Each decoder linear of the default model in every form the kernels read."""
    loaded = load_model(None, "bfloat16", "cpu", None, 1, gguf_weights="both", batch_invariant=False)
    amx = kernels.has_amx_linears()
    weights = []
    for layer in loaded.model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            w = lin.weight
            assert isinstance(w, QuantizedWeight), "the default GGUF's layers are quantized"
            dense = w.dequantize(torch.bfloat16)
            weights.append(
                {
                    "w": w,
                    "tiles": pack_tile_weight(dense),
                    "qtiles": pack_tile_qweight(w),
                    "onednn": torch.ops.mkldnn._reorder_linear_weight(dense, None),
                    "amx": amx,
                }
            )
    return weights


def run(kernel: str, weights: list[dict], xs: dict[int, torch.Tensor]) -> None:
    for lw in weights:
        w = lw["w"]
        x = xs[w.shape[1]]
        out = x.new_empty(x.shape[0], w.shape[0])
        if kernel == "gemv":
            torch.ops.atom.qgemv(out, x, w.data, w.qtype.value, None)
        elif kernel == "onednn":
            torch.ops.mkldnn._linear_pointwise(x, lw["onednn"], None, "none", [], "")
        elif kernel == "dense_tiles":
            torch.ops.atom.tile_linear(out, x, lw["tiles"], None, lw["amx"])
        else:
            torch.ops.atom.tile_qlinear(out, x, lw["qtiles"], w.qtype.value, None, lw["amx"])


def median_ms(kernel: str, weights: list[dict], xs: dict[int, torch.Tensor], repeats: int) -> float:
    run(kernel, weights, xs)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(kernel, weights, xs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 555])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if kernels.load_cpu_kernels() is not None or not kernels.has_tile_linears():
        print(json.dumps({"bench": "linears", "skipped": "no tile GEMM here (AVX512-BF16)", "machine": machine()}))
        return
    weights = layer_weights()
    torch.manual_seed(0)
    results: dict[int, dict[str, float]] = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {lw["w"].shape[1] for lw in weights}}
        best = dict.fromkeys(KERNELS, float("inf"))
        for _ in range(args.rounds):
            for kernel in KERNELS:
                best[kernel] = min(best[kernel], median_ms(kernel, weights, xs, args.repeats))
        results[rows] = best
    print(f"\nSmolLM2-135M's 30 layers (Q4_1), bfloat16, ms per call of all 120 linears; {machine()['cpu']}")
    print(f"{'rows':>6}" + "".join(f"{k:>14}" for k in KERNELS) + f"{'chain/default':>15}")
    for rows, cells in results.items():
        default = cells["gemv"] if rows <= 4 else cells["onednn"]
        print(
            f"{rows:>6}" + "".join(f"{cells[k]:>14.2f}" for k in KERNELS) + f"{cells['blocks_chain'] / default:>14.2f}x"
        )
    line = {
        "bench": "linears",
        "machine": machine(),
        "amx": kernels.has_amx_linears(),
        "ms": {str(r): {k: round(v, 3) for k, v in c.items()} for r, c in results.items()},
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
