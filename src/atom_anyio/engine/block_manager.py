"""Paged KV blocks with reference counts, a prefix cache and leases.

    block states                      transitions
    ────────────                      ───────────
    used    ref > 0                   allocate / cache hit: free or leased -> used, ref += 1
    cached  ref == 0, hash set        free(seq): ref -= 1; at 0 -> cached (or empty), or leased
    leased  cached, held by a lease   when its sequence finished (free_seq(seq, lease=True))
    empty   ref == 0, no hash         take: the LRU head, else the earliest-expiring lease's blocks

* ``free`` is an LRU of every unleased ref-0 block (cached and empty), oldest first;
  a new block is taken from its head, evicting that block's hash.
* A finished sequence's cached blocks outlast it under a lease (an agent's history while it runs a
  tool): keyed to its conversation (``KVLease.key``; none given: the sequence alone), for a TTL
  (``kv_lease_ttl_s``, or the request's), at most ``kv_lease_fraction`` of the pool. Leases are
  soft: leased blocks count as free, and when the LRU is empty the lease that expires first goes
  whole to its head. An expired lease goes there too; a conversation's next lease replaces its
  last; a full share refuses new leases (their blocks join the LRU), so a cyclic working set
  larger than the pool keeps part of it whole instead of losing all of it to the LRU.
* A block's hash is set only once all of its tokens' KV has been computed,
  so a hit never reads KV that is still being written.
* A hit is verified against the block's stored tokens: a hash collision can
  never serve another prompt's KV. The tokens live in one preallocated
  ``array('i')`` (``block_size`` slots per block), so the metadata of a full
  prefix cache is a fixed ``4 * num_blocks * block_size`` bytes plus one hash
  int and one dict entry per cached block, and nothing the GC has to walk.
* With ``record_events``, a block's hash being set is a ``BlockStored`` event
  (one per run of consecutive blocks, chained on the block before) and its
  hash being dropped a ``BlockRemoved``: ``take_events`` hands them over once
  per step, for a KV-aware router (engine/kv_events.py).
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable

from atom_anyio.engine import kv_events
from atom_anyio.engine.block_hash import hash_block
from atom_anyio.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None


class Lease:
    """A finished conversation's cached blocks, kept until ``expiry``; ``block_ids`` in eviction order."""

    __slots__ = ("key", "expiry", "block_ids")

    def __init__(self, key: str, expiry: float):
        self.key = key
        self.expiry = expiry
        self.block_ids: dict[int, None] = {}


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        record_events: bool = False,
        lease_ttl_s: float = 0.0,  # 0: finished sequences' blocks join the LRU at once
        lease_fraction: float = 0.5,  # of the pool, at most, under leases
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.block_tokens = array("i", bytes(4 * num_blocks * block_size))  # a cached block's tokens, by block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_hit_tokens = 0  # prefix-cache hits since start (a counter for metrics)
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache since start
        self.events: list | None = [kv_events.all_blocks_cleared()] if record_events else None
        self.lease_ttl_s = lease_ttl_s
        self.max_leased_blocks = int(num_blocks * lease_fraction)
        self.clock = clock
        self.leases: dict[str, Lease] = {}  # by conversation key
        self.lease_of: dict[int, Lease] = {}  # leased block id -> its lease
        self._expiries: list[tuple[float, int, Lease]] = []  # a heap; entries of replaced leases are skipped
        self._lease_order = itertools.count()
        self.num_leased_hit_tokens = 0  # prefix-cache hits on leased blocks since start

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: the LRU's and the leased ones (leases are soft)."""
        return len(self.free) + len(self.lease_of)

    @property
    def num_leased_blocks(self) -> int:
        return len(self.lease_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (at least one
        token is always left to compute, so the last block of a fully cached
        prompt is recomputed)."""
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(seq.block_hashes[: (len(seq) - 1) // bs]):
            block_id = self.cached.get(h)
            if block_id is None or self._tokens(block_id) != array("i", seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def can_admit(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> bool:
        """Enough free blocks for the hit blocks that are free plus the new chunk."""
        num_hit_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return num_hit_free + needed <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Take the cached prefix for ``seq``; its compute starts after it."""
        assert not seq.block_table
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0 and block_id in self.lease_of:
                self._unlease(block_id)
                self.num_leased_hit_tokens += self.block_size
            elif block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
        self.num_hit_tokens += seq.num_computed_tokens
        self.num_queried_tokens += len(seq)

    def _tokens(self, block_id: int) -> array:
        return self.block_tokens[block_id * self.block_size : (block_id + 1) * self.block_size]

    # allocation

    def num_blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add for ``num_new_tokens`` after those computed and those of a step in flight (async scheduling)."""
        num_tokens = seq.num_computed_tokens + seq.num_scheduled_tokens + num_new_tokens
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens."""
        for _ in range(self.num_blocks_to_grow(seq, num_new_tokens)):
            block_id = self._take()
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.append(kv_events.block_removed(block.hash))
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)

    def shrink(self, seq: Sequence) -> None:
        """Free the blocks past ``seq``'s tokens: they held only a rejected draft's KV (never
        committed), so they go back empty."""
        while len(seq.block_table) > self.blocks_needed(len(seq)):
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)  # empty: taken before any cached block

    def commit(self, seq: Sequence) -> None:
        """Publish every block of ``seq`` whose KV is now fully computed."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if len(seq.block_hashes) < num_full:  # generated tokens filled blocks
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.root_hash
            for i in range(len(seq.block_hashes), num_full):
                parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
                seq.block_hashes.append(parent)
        stored = []
        for i in range(seq.num_committed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self.cached:  # else: computed twice, keep the first
                block.hash = h
                self.block_tokens[block.block_id * bs : (block.block_id + 1) * bs] = array(
                    "i", seq.token_ids[i * bs : (i + 1) * bs]
                )
                self.cached[h] = block.block_id
                stored.append(i)
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)
        if self.events is not None and stored:
            self._record_stored(seq, stored)

    def _record_stored(self, seq: Sequence, stored: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive block indices."""
        bs = self.block_size
        start = 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                first, last = stored[start], stored[k - 1]
                parent = seq.block_hashes[first - 1] if first else None
                tokens = seq.token_ids[first * bs : (last + 1) * bs]
                self.events.append(kv_events.block_stored(seq.block_hashes[first : last + 1], parent, tokens, bs))
                start = k

    def take_events(self) -> list:
        """The events since the last call (empty when not recording)."""
        events, self.events = self.events, [] if self.events is not None else None
        return events or []

    def free_seq(self, seq: Sequence, lease: bool = False) -> None:
        """Drop ``seq``'s references; its cached blocks stay reusable (LRU), or under a lease
        (``lease``: it finished, and leases are on) for its next turn."""
        freed = []
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                freed.append(block_id)
        held = self._new_lease(seq) if lease and freed else None
        if held is not None:  # the leading cached blocks, as many as the share has room for
            room = self.max_leased_blocks - len(self.lease_of)
            kept = [b for b in freed if self.blocks[b].hash is not None][:room]
            for block_id in reversed(kept):  # the tail first out
                held.block_ids[block_id] = None
                self.lease_of[block_id] = held
            freed = [b for b in freed if b not in held.block_ids]
        # the tail first, so the LRU evicts a prompt's last blocks before its first
        for block_id in reversed(freed):
            self.free[block_id] = None
        seq.block_table = array("i")
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    # leases

    def _new_lease(self, seq: Sequence) -> Lease | None:
        """The lease for ``seq``'s blocks (its conversation's last one replaced), or None: leases
        are off, the request asked for none, or the share is full."""
        self._expire()
        ttl = self.lease_ttl_s if seq.lease.ttl_s is None else seq.lease.ttl_s
        key = seq.lease.key or f"seq:{seq.seq_id}"
        if (old := self.leases.get(key)) is not None:
            self._release(old)
        if ttl <= 0 or len(self.lease_of) >= self.max_leased_blocks:
            return None
        lease = self.leases[key] = Lease(key, self.clock() + ttl)
        heapq.heappush(self._expiries, (lease.expiry, next(self._lease_order), lease))
        return lease

    def _take(self) -> int:
        """A block for a sequence: the LRU's oldest, else one of the lease that expires first."""
        self._expire()
        while not self.free:
            self._release(self._earliest_lease())
        block_id, _ = self.free.popitem(last=False)
        return block_id

    def _expire(self) -> None:
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            _, _, lease = heapq.heappop(self._expiries)
            if self.leases.get(lease.key) is lease:
                self._release(lease)

    def _earliest_lease(self) -> Lease:
        while True:
            lease = self._expiries[0][2]
            if self.leases.get(lease.key) is lease:
                return lease
            heapq.heappop(self._expiries)

    def _release(self, lease: Lease) -> None:
        """The lease's blocks to the LRU's head, first out, in its order."""
        del self.leases[lease.key]
        for block_id in reversed(lease.block_ids):
            del self.lease_of[block_id]
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        lease.block_ids.clear()

    def _unlease(self, block_id: int) -> None:
        """A leased block hit by its conversation's next turn (or another prompt sharing it)."""
        lease = self.lease_of.pop(block_id)
        del lease.block_ids[block_id]
        if not lease.block_ids:
            del self.leases[lease.key]
