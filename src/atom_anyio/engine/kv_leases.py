"""KV leases: a finished conversation's cached blocks outlast its turn (an agent's history while it
runs a tool), keyed to the conversation (``KVLease.key``; none given: the sequence alone), for a
TTL (``kv_lease_ttl_s``, or the request's), at most ``kv_lease_fraction`` of the pool.

Leases are soft: leased blocks count as free, and when the block manager's LRU is empty one lease
goes whole to its head: of the least important ``priority`` (vLLM's, the highest value; all equal
under the fcfs policy), the one that expires first, as the scheduler preempts the least important
running sequence first. An expired lease goes there too; a conversation's next
lease replaces its last; a full share refuses new leases (their blocks join the LRU), so a cyclic
working set larger than the pool keeps part of it whole instead of losing all of it to the LRU.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from atom_anyio.engine.sequence import Sequence


class Lease:
    """A finished conversation's cached blocks, kept until ``expiry``; ``block_ids`` in eviction order."""

    __slots__ = ("key", "expiry", "priority", "block_ids")

    def __init__(self, key: str, expiry: float, priority: int = 0):
        self.key = key
        self.expiry = expiry
        self.priority = priority  # its request's (vLLM's: lower is more important)
        self.block_ids: dict[int, None] = {}


class Leases:
    """The leases of one block manager; a lease released (expired, replaced, or taken when the LRU
    is empty) hands its blocks to ``release`` (the LRU's head, first out, in its order)."""

    def __init__(self, ttl_s: float, max_blocks: int, clock: Callable[[], float], release: Callable[[list[int]], None]):
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.clock = clock
        self.release_blocks = release
        self.by_key: dict[str, Lease] = {}
        self.lease_of: dict[int, Lease] = {}  # leased block id -> its lease
        # heaps; entries of released leases are skipped, and dropped when they outnumber the live ones
        self._expiries: list[tuple[float, int, Lease]] = []  # by expiry
        self._evictions: list[tuple[int, float, int, Lease]] = []  # least important first, then by expiry
        self._order = itertools.count()

    def __len__(self) -> int:
        """Leased blocks."""
        return len(self.lease_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.lease_of

    def hold(self, seq: Sequence, cached: list[int]) -> set[int]:
        """``seq`` finished, its ``cached`` blocks freed (prompt order): the leading ones it leases,
        as many as the share has room for (none: leases are off, the request asked for none, or the
        share is full)."""
        lease = self._new(seq)
        if lease is None:
            return set()
        for block_id in reversed(cached[: self.max_blocks - len(self.lease_of)]):  # the tail first out
            lease.block_ids[block_id] = None
            self.lease_of[block_id] = lease
        return set(lease.block_ids)

    def unlease(self, block_id: int) -> None:
        """A leased block hit by its conversation's next turn (or another prompt sharing it)."""
        lease = self.lease_of.pop(block_id)
        del lease.block_ids[block_id]
        if not lease.block_ids:
            del self.by_key[lease.key]

    def expire(self) -> None:
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            _, _, lease = heapq.heappop(self._expiries)
            if self.by_key.get(lease.key) is lease:
                self._release(lease)

    def release_next(self) -> None:
        """The LRU is empty: the lease of the least important priority that expires first, released."""
        while True:
            lease = self._evictions[0][-1]
            if self.by_key.get(lease.key) is lease:
                return self._release(lease)
            heapq.heappop(self._evictions)

    def _new(self, seq: Sequence) -> Lease | None:
        self.expire()
        ttl = self.ttl_s if seq.lease.ttl_s is None else seq.lease.ttl_s
        key = seq.lease.key or f"seq:{seq.seq_id}"
        if (old := self.by_key.get(key)) is not None:
            self._release(old)
        if ttl <= 0 or len(self.lease_of) >= self.max_blocks:
            return None
        lease = self.by_key[key] = Lease(key, self.clock() + ttl, seq.priority)
        order = next(self._order)
        heapq.heappush(self._expiries, (lease.expiry, order, lease))
        heapq.heappush(self._evictions, (-lease.priority, lease.expiry, order, lease))
        if len(self._evictions) > 2 * len(self.by_key) + 64:  # released leases' entries: bounded
            self._expiries, self._evictions = self._live(self._expiries), self._live(self._evictions)
        return lease

    def _live(self, heap: list[tuple]) -> list[tuple]:
        """``heap`` without the entries of released leases."""
        live = [entry for entry in heap if self.by_key.get(entry[-1].key) is entry[-1]]
        heapq.heapify(live)
        return live

    def _release(self, lease: Lease) -> None:
        del self.by_key[lease.key]
        for block_id in lease.block_ids:
            del self.lease_of[block_id]
        self.release_blocks(list(lease.block_ids))
        lease.block_ids.clear()
