"""The CPU's KV tier: what saving and restoring blocks costs, the tier file's system calls
(``TierFile``: one ``pwritev`` / ``preadv`` a block, the engine's) against the same file mapped
into memory and copied with torch (the engine's way until 2026-12-08, whose pages counted in
the server's RSS once written).

    python benchmarks/kv_tier_copies.py [--blocks 256] [--repeats 5] [--rounds 2]
    nox -s bench -- kv_tier_copies

SmolLM2-135M's pool layout (30 layers, K and V, 3 KV heads of 64) in bfloat16 or fp8, blocks of
16 tokens: ``--blocks`` pool blocks saved to as many slots, then as many slots restored into other
blocks, as one step's copies. Each cell is the best of ``--repeats`` after a first pass that
faults every page in, best of ``--rounds`` rounds taken in turn. Prints a table (ms, GB/s) and
one JSON line, with each mapped file's resident pages: what the old way added to RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from machine import machine

from atom_anyio import kernels
from atom_anyio.engine.kv_tier import TierStore

LAYERS, HEADS, DIM, BLOCK = 30, 3, 64, 16


class MappedTier:
    """The baseline: the tier's file mapped into memory, blocks copied with torch."""

    def __init__(self, num_slots: int, pool: torch.Tensor, directory: str):
        layers, kv, _, heads, dim = pool.shape
        shape = (num_slots, layers, kv, BLOCK, heads, dim)
        nbytes = torch.Size(shape).numel() * pool.element_size()
        fd, path = tempfile.mkstemp(prefix="atom-kv-tier-bench-", dir=directory)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        finally:
            os.close(fd)
            os.unlink(path)
        self.slots = flat.view(pool.dtype).view(shape)

    def transfer(self, pool: torch.Tensor, saves, loads) -> None:
        for block_id, slot in saves:
            self.slots[slot].copy_(pool[:, :, block_id * BLOCK : (block_id + 1) * BLOCK])
        for slot, block_id in loads:
            pool[:, :, block_id * BLOCK : (block_id + 1) * BLOCK].copy_(self.slots[slot])


def resident_mapped_mib() -> float:
    """Resident pages of this process's mappings of a tier file (both ways' names)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = "atom-kv-tier" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total / 1024


def time_one(store, pool: torch.Tensor, n: int, repeats: int) -> tuple[float, float]:
    saves = [(2 * i, i) for i in range(n)]
    loads = [(i, 2 * n + i) for i in range(n)]
    store.transfer(pool, saves, loads)  # every page faulted in, the file's blocks allocated
    best_save = best_load = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        store.transfer(pool, saves, [])
        best_save = min(best_save, time.perf_counter() - t)
        t = time.perf_counter()
        store.transfer(pool, [], loads)
        best_load = min(best_load, time.perf_counter() - t)
    if not torch.equal(pool[:, :, 2 * n * BLOCK : 2 * n * BLOCK + BLOCK], pool[:, :, :BLOCK]):
        raise AssertionError("a restored block is not the saved one")
    return best_save, best_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks saved, and restored, in one step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "fp8"], choices=["bfloat16", "fp8"])
    ap.add_argument("--dir", default=None, help="where the tier files go (the temp dir by default)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the worker's copies run on its one thread
    n = args.blocks
    results = {}
    for name in args.dtypes:
        dtype = torch.bfloat16 if name == "bfloat16" else torch.float8_e4m3fn
        pool, _ = kernels.empty_on_huge_pages((LAYERS, 2, 3 * n * BLOCK, HEADS, DIM), dtype)
        pool.copy_(torch.randn(pool.shape).to(dtype))
        mib = n * pool[:, :, :BLOCK].numel() * pool.element_size() / 2**20
        cells: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for way in ("mapped", "file"):
                store = MappedTier(n, pool, args.dir) if way == "mapped" else TierStore(n, pool, BLOCK, args.dir)
                save, load = time_one(store, pool, n, args.repeats)
                resident = resident_mapped_mib()
                del store
                best = cells.setdefault(way, [float("inf"), float("inf"), 0.0])
                best[0], best[1], best[2] = min(best[0], save), min(best[1], load), resident
        results[name] = {
            "mib": mib,
            **{way: dict(zip(("save_s", "load_s", "mapped_rss_mib"), v, strict=True)) for way, v in cells.items()},
        }

    print(f"{n} blocks a step, SmolLM2's layout, one thread")
    print(
        f"{'KV':>9} {'way':>7} {'MiB':>6} {'save ms':>8} {'load ms':>8} {'save GB/s':>10} {'load GB/s':>10} {'mapped RSS MiB':>15}"
    )
    for name, r in results.items():
        for way in ("mapped", "file"):
            c = r[way]
            gb = r["mib"] * 2**20 / 1e9
            print(
                f"{name:>9} {way:>7} {r['mib']:>6.0f} {c['save_s'] * 1e3:>8.1f} {c['load_s'] * 1e3:>8.1f} "
                f"{gb / c['save_s']:>10.1f} {gb / c['load_s']:>10.1f} {c['mapped_rss_mib']:>15.0f}"
            )
        print(
            f"{name:>9} {'file/mapped':>18} save {r['file']['save_s'] / r['mapped']['save_s']:.2f}x, "
            f"load {r['file']['load_s'] / r['mapped']['load_s']:.2f}x"
        )
    print(json.dumps({"benchmark": "kv_tier_copies", "machine": machine(), "blocks": n, "results": results}))


if __name__ == "__main__":
    main()
