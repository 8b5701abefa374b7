"""The KV cache's second tier (issue 41): a cached block evicted from the pool is saved to a file on
disk instead of dropped, and a prompt whose prefix goes on past the pool's hits is restored from
there instead of recomputed: the block manager's bookkeeping alone, then the real engine with a
tiny model, whose greedy output must not change when its history comes back from the tier."""

from __future__ import annotations

import os
from array import array

import anyio
import pytest
import torch

from atom_anyio.config import Config
from atom_anyio.engine import kv_events
from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.kv_tier import MEDIUM_DISK, TierIndex, TierStore, whole
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.sequence import Sequence
from atom_anyio.sampling_params import SamplingParams

BLOCK_SIZE = 4


def turn(tokens: list[int]) -> Sequence:
    request = EngineRequest(list(tokens), block_hash_chain(tokens, BLOCK_SIZE), SamplingParams(max_tokens=1), 1)
    return Sequence(request, stream=None, detokenizer=None)


def run(bm: BlockManager, tokens: list[int]) -> tuple[int, int]:
    """Admit ``tokens`` (with its prefix hits), compute and finish it: the blocks hit in the pool and in the tier."""
    seq = turn(tokens)
    hits = bm.match_prefix(seq)
    bm.admit(seq, hits)
    bm.grow(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    bm.free_seq(seq)
    return len(hits.blocks), len(hits.tier_slots)


def tokens(*ids: int) -> array:
    return array("i", ids)


def prompt(first: int, num_blocks: int) -> list[int]:
    return list(range(first, first + num_blocks * BLOCK_SIZE + 1))


def test_an_evicted_prefix_is_saved_to_the_tier_and_restored_from_it_past_the_pools_hits():
    tier = TierIndex(64, BLOCK_SIZE, MEDIUM_DISK)
    bm = BlockManager(10, BLOCK_SIZE, tier=tier)
    assert run(bm, prompt(0, 8)) == (0, 0)  # 9 blocks of the pool's 10
    assert tier.take_transfers() == ([], [])
    assert run(bm, prompt(1000, 6)) == (0, 0)  # 7 blocks: some of the first prompt's cached ones go
    saves, loads = tier.take_transfers()
    assert saves and not loads  # each cached block taken was saved to a slot first
    pool_hits, tier_hits = run(bm, prompt(0, 8))
    assert tier_hits == len(saves) and pool_hits + tier_hits == 8  # the whole prefix, from one tier or the other
    _, loads = tier.take_transfers()
    assert sorted(slot for slot, _ in loads) == sorted(slot for _, slot in saves)
    assert tier.num_restored_blocks == tier_hits and bm.num_tier_hit_tokens == tier_hits * BLOCK_SIZE
    assert bm.num_hit_tokens == pool_hits * BLOCK_SIZE  # the pool's own, as vLLM counts its prefix_cache_hits
    assert run(bm, prompt(0, 8)) == (8, 0)  # restored blocks are the pool's again


def test_the_tier_verifies_tokens_and_never_reuses_a_slot_a_pending_load_reads():
    tier = TierIndex(2, BLOCK_SIZE, MEDIUM_DISK)
    tier.save(11, tokens(1, 2, 3, 4), block_id=0)
    tier.save(12, tokens(5, 6, 7, 8), block_id=1)
    assert tier.match(11, [1, 2, 3, 4]) is not None
    assert tier.match(11, [1, 2, 3, 5]) is None  # a hash collision never serves another prompt's KV
    tier.take_transfers()
    slot = tier.match(11, [1, 2, 3, 4])
    tier.pin([slot])
    tier.load(slot, block_id=7)
    tier.save(13, tokens(9, 9, 9, 9), block_id=2)  # full: the LRU slot that no load reads goes (12's)
    assert tier.match(12, [5, 6, 7, 8]) is None and tier.match(11, [1, 2, 3, 4]) == slot
    tier.save(14, tokens(8, 8, 8, 8), block_id=3)  # every slot pinned or just written: 13's goes, 11's stays
    assert tier.match(11, [1, 2, 3, 4]) == slot
    saves, loads = tier.take_transfers()
    assert loads == [(slot, 7)] and all(s != slot for _, s in saves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_store_copies_whole_blocks_both_ways_through_a_file_it_unlinks(tmp_path, dtype):
    pool = torch.randn(3, 2, 8 * BLOCK_SIZE, 2, 4).to(dtype)
    store = TierStore(4, pool, BLOCK_SIZE, str(tmp_path))
    assert os.listdir(tmp_path) == []  # created, then unlinked: nothing outlives the process
    before = pool.clone()
    store.transfer(pool, saves=[(1, 0), (5, 3)], loads=[])
    store.transfer(pool, saves=[], loads=[(0, 6), (3, 2)])
    blocks, original = (t.view(torch.uint8).view(3, 2, 8, BLOCK_SIZE, 2, -1) for t in (pool, before))
    assert torch.equal(blocks[:, :, 6], original[:, :, 1]) and torch.equal(blocks[:, :, 2], original[:, :, 5])
    assert torch.equal(blocks[:, :, [0, 1, 3, 4, 5, 7]], original[:, :, [0, 1, 3, 4, 5, 7]])
    # a slot is the block's bytes as the pool lays them out (the GPU's pinned slots' layout)
    block_bytes = 3 * 2 * BLOCK_SIZE * 2 * 4 * pool.element_size()
    assert os.pread(store.file.fd, block_bytes, 3 * block_bytes) == original[:, :, 5].contiguous().numpy().tobytes()


def test_the_tier_file_is_not_mapped_into_the_process(tmp_path):
    """The tier's pages are the page cache's, not the process's RSS: no mapping of the file (a mapped
    file's pages counted in RSS as the tier filled, 29.6% over a 20-minute run)."""
    pool = torch.randn(2, 2, 8 * BLOCK_SIZE, 2, 4)
    store = TierStore(4, pool, BLOCK_SIZE, str(tmp_path))
    store.transfer(pool, saves=[(b, b) for b in range(4)], loads=[(0, 7)])
    with open("/proc/self/maps") as maps:
        assert "atom-kv-tier" not in maps.read()


@pytest.mark.parametrize("op", ["pwritev", "preadv"])
def test_short_file_io_goes_on_from_where_it_stopped(op):
    """A regular file's I/O may stop short (a signal): the rest follows from the byte it reached, and
    an end of file is an error, not a block half restored."""
    file = bytearray(range(200))
    calls = []

    def short(fd, buffers, offset):  # at most 7 bytes a call, as os.pwritev / os.preadv count them
        calls.append(offset)
        n = 0
        for b in buffers:
            take = min(len(b), 7 - n, len(file) - offset - n)
            if take <= 0:
                break
            if op == "pwritev":
                file[offset + n : offset + n + take] = b[:take]
            else:
                b[:take] = file[offset + n : offset + n + take]
            n += take
        return n

    buffers = [memoryview(bytearray(bytes([100 + i]) * 10)) for i in range(3)]
    if op == "pwritev":
        whole(short, 0, buffers, 50)
        assert file[50:80] == b"".join(bytes(b) for b in buffers) and file[:50] == bytes(range(50))
    else:
        whole(short, 0, buffers, 150)
        assert b"".join(bytes(b) for b in buffers) == bytes(range(150, 180))
        with pytest.raises(OSError, match="stopped at byte 200"):
            whole(short, 0, buffers, 190)
    assert calls[:2] == [calls[0], calls[0] + 7]


def test_tier_blocks_are_kv_events_on_their_own_medium():
    tier = TierIndex(1, BLOCK_SIZE, MEDIUM_DISK, record_events=True)
    bm = BlockManager(3, BLOCK_SIZE, record_events=True, tier=tier)
    bm.take_events()
    run(bm, prompt(0, 2))
    run(bm, prompt(100, 2))  # evicts the first prompt's blocks: one fits in the tier
    events = bm.take_events()
    tiered = [type(e) for e in events if e.medium == MEDIUM_DISK]  # one slot: the second save drops the first
    assert tiered.count(kv_events.BlockStored) == 2 and tiered.count(kv_events.BlockRemoved) == 1
    assert [type(e) for e in events if e.medium == kv_events.MEDIUM].count(kv_events.BlockRemoved) == 2


def test_bad_tier_settings_are_named():
    with pytest.raises(ValueError, match="kv_offloading_size"):
        Config.of(kv_offloading_size=-1.0)
    with pytest.raises(ValueError, match="kv_offloading_dir"):
        Config.of(kv_offloading_size=1.0, kv_offloading_dir="/no/such/dir")


async def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and cached prompt tokens, one after another."""
    out = []
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        for ids in prompts:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            tokens, cached = [], 0
            async with engine.submit(EngineRequest.of_tokens(ids, params, engine)) as stream:
                async for d in stream:
                    tokens += d.token_ids
                    cached = d.num_cached_tokens
            out.append((tokens, cached))
        tg.cancel_scope.cancel()
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
async def test_a_history_restored_from_the_tier_gives_the_same_greedy_tokens(tiny_model, tmp_path, kv_cache_dtype):
    """A 40-block pool, prompts of 24 blocks: the second prompt evicts most of the first, which
    comes back from the tier (the disk file) and continues exactly as computed afresh; with an
    fp8 pool, the tier's blocks are fp8 too (a quarter of the float32 model's bytes)."""
    history = [(7 * i) % 997 + 3 for i in range(24 * 16)]
    other = [(11 * i) % 991 + 5 for i in range(24 * 16)]
    small = dict(max_model_len=1024, num_kv_blocks=40, block_size=16, kv_cache_dtype=kv_cache_dtype)
    tiered = Engine(tiny_model, EngineConfig(**small, kv_offloading_size=0.01, kv_offloading_dir=str(tmp_path)))
    (first, _), _, (again, cached) = await greedy(tiered, [history, other, history])
    stats = tiered.stats().tier
    assert stats.num_saved_blocks > 0 and stats.num_hit_tokens > 0
    copies = sum(stats.copy_seconds.counts)  # the steps that copied, timed (atom_kv_tier_copy_seconds)
    assert 0 < copies < sum(tiered.stats().step_seconds.counts) and stats.copy_seconds.sum > 0
    assert cached == 23 * 16  # every full block of the prompt but the last: the pool's hits, then the tier's
    assert tiered.worker.tier.dtype == tiered.worker.kv_pool.dtype
    assert tiered.worker.kv_pool.element_size() == (1 if kv_cache_dtype == "fp8" else 4)
    fresh = Engine(tiny_model, EngineConfig(**small, enable_prefix_caching=False))
    ((computed, _),) = await greedy(fresh, [history])
    assert first == again == computed


def test_a_block_the_pool_still_holds_is_never_restored_from_the_tier_beside_it():
    """The pool lost a prompt's first block but kept the next ones, which the tier also holds (the
    tier keeps what it restored): the lookup stops where the pool's blocks resume, so no hash is
    cached in two pool blocks (whose second eviction would find its hash gone)."""
    tier = TierIndex(64, BLOCK_SIZE, MEDIUM_DISK)
    bm = BlockManager(10, BLOCK_SIZE, tier=tier)
    tokens = prompt(0, 3)
    run(bm, tokens)
    for h in turn(tokens).block_hashes:  # the tier holds all three, as after an earlier restore
        block_id = bm.cached[h]
        tier.save(h, bm._tokens(block_id), block_id)
    first = bm.cached[turn(tokens).block_hashes[0]]
    bm.free.move_to_end(first, last=False)  # the first block is the LRU's next: taken, the others kept
    run(bm, prompt(500, 0))
    assert run(bm, tokens) == (0, 1)  # the first block from the tier, then recomputed from where the pool resumes
    assert all(bm.blocks[b].hash == h for h, b in bm.cached.items())
    assert sum(block.hash is not None for block in bm.blocks) == len(bm.cached)
