"""Paged KV blocks with reference counts, a prefix cache and leases.

    block states                      transitions
    ────────────                      ───────────
    used    ref > 0                   allocate / cache hit: free or leased -> used, ref += 1
    cached  ref == 0, hash set        free(seq): ref -= 1; at 0 -> cached (or empty), or leased
    leased  cached, held by a lease   when its sequence finished (free_seq(seq, lease=True))
    empty   ref == 0, no hash         take: the LRU head, else a lease's blocks (kv_leases.py's order)

* ``free`` is an LRU of every unleased ref-0 block (cached and empty), oldest first;
  a new block is taken from its head, evicting that block's hash.
* A finished sequence's cached blocks outlast it under a lease (an agent's history while it runs a
  tool; kv_leases.py): leased blocks count as free, and when the LRU is empty a lease (the least
  important priority's, then the one that expires first) goes whole to its head.
* A block's hash is set only once all of its tokens' KV has been computed,
  so a hit never reads KV that is still being written.
* A hit is verified against the block's stored tokens: a hash collision can
  never serve another prompt's KV. The tokens live in one preallocated
  ``array('i')`` (``block_size`` slots per block), so the metadata of a full
  prefix cache is a fixed ``4 * num_blocks * block_size`` bytes plus one hash
  int and one dict entry per cached block, and nothing the GC has to walk.
* With a second tier (``kv_tier.TierIndex``), a cached block taken for another use is saved there
  first, and a prefix that goes on past the pool's hits continues with the tier's: each such
  block is restored into a fresh pool block (``PrefixHit.tier_slots``) by the step's copies.
* With ``record_events``, a block's hash being set is a ``BlockStored`` event
  (one per run of consecutive blocks, chained on the block before) and its
  hash being dropped a ``BlockRemoved``: ``take_events`` hands them over once
  per step, for a KV-aware router (engine/kv_events.py).
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from atom_anyio.engine import kv_events
from atom_anyio.engine.block_hash import hash_block
from atom_anyio.engine.kv_leases import Lease, Leases
from atom_anyio.engine.kv_tier import TierIndex
from atom_anyio.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None


@dataclass
class PrefixHit:
    """A prompt's cached prefix: blocks in the pool, then slots of the second tier to restore."""

    blocks: list[int] = field(default_factory=list)
    tier_slots: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks) + len(self.tier_slots)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        record_events: bool = False,
        lease_ttl_s: float = 0.0,  # 0: finished sequences' blocks join the LRU at once
        lease_fraction: float = 0.5,  # of the pool, at most, under leases
        clock: Callable[[], float] = time.monotonic,
        tier: TierIndex | None = None,  # a second tier that evicted blocks go to (kv_tier.py)
    ):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.block_tokens = array("i", bytes(4 * num_blocks * block_size))  # a cached block's tokens, by block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_hit_tokens = 0  # prefix-cache hits since start (a counter for metrics)
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache since start
        self.events: list | None = [kv_events.all_blocks_cleared()] if record_events else None
        self.clock = clock
        self._leases = Leases(lease_ttl_s, int(num_blocks * lease_fraction), clock, self._to_lru_head)
        self.num_leased_hit_tokens = 0  # prefix-cache hits on leased blocks since start
        self.tier = tier
        self.num_tier_hit_tokens = 0  # prompt tokens restored from the tier since start
        self.num_tier_queried_tokens = 0  # prompt tokens looked up in the tier (past the pool's hits)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take: the LRU's and the leased ones (leases are soft)."""
        return len(self.free) + len(self._leases)

    @property
    def num_leased_blocks(self) -> int:
        return len(self._leases)

    @property
    def leases(self) -> dict[str, Lease]:
        """The leases by conversation key."""
        return self._leases.by_key

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of ``seq``: in the pool, then in the tier (at least one token
        is always left to compute, so the last block of a fully cached prompt is recomputed)."""
        hits = PrefixHit()
        bs = self.block_size
        hashes = seq.block_hashes[: (len(seq) - 1) // bs]
        for i, h in enumerate(hashes):
            block_id = self.cached.get(h)
            if block_id is None or self._tokens(block_id) != array("i", seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.blocks.append(block_id)
        if self.tier is not None:
            for i in range(len(hits.blocks), len(hashes)):
                if hashes[i] in self.cached:  # the pool's (past a block it lost): computed again, never cached twice
                    break
                slot = self.tier.match(hashes[i], seq.token_ids[i * bs : (i + 1) * bs])
                if slot is None:
                    break
                hits.tier_slots.append(slot)
        return hits

    def can_admit(self, seq: Sequence, num_new_tokens: int, hits: PrefixHit) -> bool:
        """Enough free blocks for the pool's hit blocks that are free plus the tier's and the new chunk."""
        num_hit_free = sum(1 for b in hits.blocks if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits.blocks)
        return num_hit_free + needed <= self.num_free_blocks

    def admit(self, seq: Sequence, hits: PrefixHit) -> None:
        """Take the cached prefix for ``seq`` (the tier's blocks restored into fresh ones by the
        next step's copies, before its forward); its compute starts after it."""
        assert not seq.block_table
        for block_id in hits.blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0 and block_id in self._leases:
                self._leases.unlease(block_id)
                self.num_leased_hit_tokens += self.block_size
            elif block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if self.tier is not None:
            self._restore(seq, hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
        self.num_hit_tokens += len(hits.blocks) * self.block_size  # the pool's (the tier's: num_tier_hit_tokens)
        self.num_queried_tokens += len(seq)

    def _restore(self, seq: Sequence, hits: PrefixHit) -> None:
        """The tier's hit blocks into fresh pool blocks, cached under their hashes at once (the
        copies run before any forward that reads them)."""
        bs, first = self.block_size, len(hits.blocks)
        self.num_tier_queried_tokens += len(seq) - first * bs
        self.num_tier_hit_tokens += len(hits.tier_slots) * bs
        self.tier.pin(hits.tier_slots)  # the blocks taken below may save others to the tier: not into these
        for i, slot in enumerate(hits.tier_slots, start=first):
            block_id = self._take_fresh()
            self.blocks[block_id].ref_count = 1
            self._cache(block_id, seq, i)
            self.tier.load(slot, block_id)
            seq.block_table.append(block_id)
        if self.events is not None and hits.tier_slots:
            self._record_stored(seq, list(range(first, len(hits))))

    def _cache(self, block_id: int, seq: Sequence, i: int) -> None:
        """Pool block ``block_id`` holds ``seq``'s block ``i``: cached under its hash, with its tokens."""
        bs = self.block_size
        self.blocks[block_id].hash = h = seq.block_hashes[i]
        self.block_tokens[block_id * bs : (block_id + 1) * bs] = array("i", seq.token_ids[i * bs : (i + 1) * bs])
        self.cached[h] = block_id

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
            block_id = self._take_fresh()
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def _take_fresh(self) -> int:
        """A block to write: taken as ``_take`` chooses, its hash (if any) evicted, to the tier when there is one."""
        block_id = self._take()
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.tier is not None:
                self.tier.save(block.hash, self._tokens(block_id), block_id)
            del self.cached[block.hash]
            if self.events is not None:
                self.events.append(kv_events.block_removed(block.hash))
            block.hash = None
        return block_id

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
            block_id = seq.block_table[i]
            # a block computed twice (another sequence cached it meanwhile): the first is kept
            if self.blocks[block_id].hash is None and seq.block_hashes[i] not in self.cached:
                self._cache(block_id, seq, i)
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
        """The events since the last call (empty when not recording): the pool's, then the tier's."""
        events, self.events = self.events, [] if self.events is not None else None
        if events is not None and self.tier is not None:
            stored, removed = self.tier.take_events()
            medium = self.tier.medium
            events += [kv_events.block_stored([h], None, list(tokens), self.block_size, medium) for h, tokens in stored]
            events += [kv_events.block_removed(h, medium) for h in removed]
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
        if lease and freed:
            held = self._leases.hold(seq, [b for b in freed if self.blocks[b].hash is not None])
            freed = [b for b in freed if b not in held]
        # the tail first, so the LRU evicts a prompt's last blocks before its first
        for block_id in reversed(freed):
            self.free[block_id] = None
        seq.block_table = array("i")
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def _take(self) -> int:
        """A block for a sequence: the LRU's oldest, else one of the lease that goes next (kv_leases.py)."""
        self._leases.expire()
        while not self.free:
            self._leases.release_next()
        block_id, _ = self.free.popitem(last=False)
        return block_id

    def _to_lru_head(self, block_ids: list[int]) -> None:
        """A released lease's blocks, first out in its order."""
        for block_id in reversed(block_ids):
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
