"""The KV cache's second tier: blocks evicted from the pool are copied there instead of dropped,
and a prefix hit there is copied back into the pool instead of recomputed (vLLM's
``--kv-offloading-size``; SGLang's HiCache).

    loop side (TierIndex)                          worker side (TierStore)
    ─────────────────────                          ───────────────────────
    grow() evicts a cached block -> save(hash)     each step, before its forward:
    match_prefix() past the pool -> match(hash)      saves: pool block -> tier slot
    admit() takes a pool block   -> load(slot)       loads: tier slot -> pool block
    schedule() ends -> take_transfers() -> StepInput.kv_saves / kv_loads

On the CPU, where the pool already is host memory, the tier is a file on local disk, written
from the pool and read back into it by ``pwritev``/``preadv`` (its space reserved up front): the
page cache holds what fits and the disk the rest, so capacity goes past RAM, and none of it is the
process's memory. On a GPU it is pinned host memory.
The copies are whole blocks, a few hundred KB each (SmolLM2 in bfloat16: 368 KiB), run by the
worker at the start of the step that needs them: a step's saves first (a block is saved before
the forward, or a load, writes it), then its loads. A slot a load reads is not reused before that
step is sent. Restoring 4,000 tokens is ~90 MB of copies, against seconds of prefill.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from array import array
from collections import OrderedDict

import torch

MEDIUM_CPU, MEDIUM_DISK = "CPU", "DISK"  # the tier in KV events: pinned host memory, or a file


def tier_medium(device: torch.device) -> str:
    """Where a pool on ``device`` keeps its tier: pinned host memory for a GPU's, a file for the CPU's."""
    return MEDIUM_CPU if device.type == "cuda" else MEDIUM_DISK


class TierIndex:
    """Which block hashes the tier holds, in which slot, least recently used first; the transfers
    the next step runs. Lives with the block manager, in the loop."""

    def __init__(self, num_slots: int, block_size: int, medium: str, record_events: bool = False):
        self.num_slots = num_slots
        self.record_events = record_events
        self.block_size = block_size
        self.medium = medium
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self.hash_of: dict[int, int] = {}  # slot -> hash
        self.slot_tokens = array("i", bytes(4 * num_slots * block_size))  # a hit is verified, as in the pool
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()  # slots the next step's loads read: not reused before it is sent
        self.saves: list[tuple[int, int]] = []  # (pool block, slot)
        self.loads: list[tuple[int, int]] = []  # (slot, pool block)
        self.removed: list[int] = []  # hashes dropped from the tier since the last take (KV events)
        self.stored: list[tuple[int, array]] = []  # hashes (and tokens) saved since the last take
        self.num_saved_blocks = 0
        self.num_restored_blocks = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    def save(self, h: int, tokens: array, block_id: int) -> None:
        """Pool block ``block_id`` (hash ``h``, its ``tokens``) is evicted: copied to a slot, unless
        the tier holds ``h`` already (it was restored from there) or every slot is pinned."""
        if h in self.slot_of:
            self.slot_of.move_to_end(h)
            return
        slot = self._free_slot()
        if slot is None:
            return
        self.slot_of[h] = slot
        self.hash_of[slot] = h
        bs = self.block_size
        self.slot_tokens[slot * bs : (slot + 1) * bs] = tokens
        self.saves.append((block_id, slot))
        if self.record_events:
            self.stored.append((h, tokens))
        self.num_saved_blocks += 1

    def match(self, h: int, tokens: list[int]) -> int | None:
        """The slot holding block hash ``h`` with exactly these ``tokens``, or None."""
        slot = self.slot_of.get(h)
        bs = self.block_size
        if slot is None or self.slot_tokens[slot * bs : (slot + 1) * bs] != array("i", tokens):
            return None
        return slot

    def pin(self, slots: list[int]) -> None:
        """Keep ``slots`` (a prompt's hits, about to be loaded) from reuse until the next step is sent."""
        self.pinned.update(slots)

    def load(self, slot: int, block_id: int) -> None:
        """Copy ``slot`` into pool block ``block_id`` in the next step (the tier keeps its copy)."""
        self.slot_of.move_to_end(self.hash_of[slot])
        self.pinned.add(slot)
        self.loads.append((slot, block_id))
        self.num_restored_blocks += 1

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The saves and loads since the last call, for the step being built."""
        saves, loads = self.saves, self.loads
        self.saves, self.loads = [], []
        self.pinned.clear()
        return saves, loads

    def take_events(self) -> tuple[list[tuple[int, array]], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for h, slot in self.slot_of.items():  # the least recently used slot no load of this step reads
            if slot not in self.pinned:
                del self.slot_of[h]
                if self.record_events:
                    self.removed.append(h)
                return slot
        return None


class TierStore:
    """The tier's bytes, ``num_slots`` blocks, and the copies a step asks for. Lives with the worker.

    On a GPU the slots are one pinned host tensor laid out as the pool's blocks (layers, K/V,
    block_size tokens, KV heads, head dim). On the CPU they are slots of a file on local disk
    (``TierFile``), each written from the pool's memory and read back into it by one system call."""

    def __init__(self, num_slots: int, pool: torch.Tensor, block_size: int, directory: str | None = None):
        layers, kv, _, heads, dim = pool.shape
        self.block_size = block_size
        self.dtype = pool.dtype
        self.slots: torch.Tensor | None = None
        self.file: TierFile | None = None
        if tier_medium(pool.device) == MEDIUM_CPU:
            shape = (num_slots, layers, kv, block_size, heads, dim)
            self.slots = torch.empty(shape, dtype=pool.dtype, pin_memory=True)
        else:
            self.file = TierFile(num_slots, pool, block_size, directory)

    def transfer(self, pool: torch.Tensor, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """A step's saves (pool block -> slot), then its loads (slot -> pool block)."""
        if self.file is not None:
            for block_id, slot in saves:
                self.file.save(block_id, slot)
            for slot, block_id in loads:
                self.file.load(slot, block_id)
            return
        bs = self.block_size
        for block_id, slot in saves:
            self.slots[slot].copy_(pool[:, :, block_id * bs : (block_id + 1) * bs], non_blocking=True)
        if saves:
            torch.cuda.current_stream(pool.device).synchronize()  # the host copy is read by a later load
        for slot, block_id in loads:
            pool[:, :, block_id * bs : (block_id + 1) * bs].copy_(self.slots[slot], non_blocking=True)


class TierFile:
    """The CPU's tier: a file on local disk (``directory``, the system's temp dir by default) of
    ``num_slots`` slots of one block each, as the pool lays a block out (layer by layer, K then V:
    ``layers * 2`` runs of ``block_size`` tokens). A save is one ``pwritev`` from the pool's memory,
    a load one ``preadv`` into it: the kernel's copy and nothing else, the GIL released. The file's
    pages live in the page cache, where the kernel writes them back and drops them under memory
    pressure, and are not the process's: its RSS does not grow as the tier fills (a mapped file's
    pages counted in it once touched: 29.6% over a 20-minute run with a 4 GiB tier, 2026-12-07).
    Its space is reserved up front (a write past a full disk fails here, not at some later step)
    and its name unlinked at once: it goes with the process, however that ends."""

    def __init__(self, num_slots: int, pool: torch.Tensor, block_size: int, directory: str | None):
        if pool.device.type != "cpu" or not pool.is_contiguous():
            raise ValueError("the tier file copies a contiguous CPU pool")
        layers, kv, num_tokens, _, _ = pool.shape
        self.num_runs = layers * kv  # a block's runs in the pool, one per layer and K/V
        self.run_bytes = pool[0, 0, :block_size].numel() * pool.element_size()
        self.run_stride = num_tokens * self.run_bytes // block_size  # from one layer's (or K/V's) run to the next
        self.block_bytes = self.num_runs * self.run_bytes
        if self.num_runs > os.sysconf("SC_IOV_MAX"):
            raise ValueError(f"a block's {self.num_runs} runs exceed the system's IOV_MAX")
        self.pool = pool  # kept: the memoryview below points into it
        self.memory = memoryview(pool.view(-1).view(torch.uint8).numpy())
        fd, path = tempfile.mkstemp(prefix="atom-kv-tier-", dir=directory)
        try:
            os.posix_fallocate(fd, 0, num_slots * self.block_bytes)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)
        self.fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def runs(self, block_id: int) -> list[memoryview]:
        """Pool block ``block_id``'s bytes, run by run."""
        start = block_id * self.run_bytes
        return [
            self.memory[o : o + self.run_bytes]
            for o in range(start, start + self.num_runs * self.run_stride, self.run_stride)
        ]

    def save(self, block_id: int, slot: int) -> None:
        whole(os.pwritev, self.fd, self.runs(block_id), slot * self.block_bytes)

    def load(self, slot: int, block_id: int) -> None:
        whole(os.preadv, self.fd, self.runs(block_id), slot * self.block_bytes)


def whole(op, fd: int, buffers: list[memoryview], offset: int) -> None:
    """``op`` (``os.pwritev`` or ``os.preadv``) until every byte of ``buffers`` is done: a regular
    file's I/O can stop short (a signal), and a read that reaches the file's end is an error."""
    total = sum(len(b) for b in buffers)
    done = op(fd, buffers, offset)
    while done < total:
        skip, rest = done, []
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
            else:
                rest.append(b[skip:])
                skip = 0
        n = op(fd, rest, offset + done)
        if n == 0:
            raise OSError(f"the KV tier file stopped at byte {offset + done}")
        done += n


def num_tier_slots(size_gib: float, bytes_per_block: int) -> int:
    return int(size_gib * 2**30) // bytes_per_block
