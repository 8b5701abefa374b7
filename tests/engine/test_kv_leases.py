"""KV leases (issue 41): a finished conversation's cached blocks outlast its turn, so an agent that
runs a tool and comes back finds its history in the pool, where one LRU of every unreferenced block
would evict each agent's blocks just before it returns (a cyclic working set larger than the pool)."""

from __future__ import annotations

from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.request import EngineRequest, KVLease
from atom_anyio.engine.sequence import Sequence
from atom_anyio.sampling_params import SamplingParams

BLOCK_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(tokens: list[int], lease: KVLease = KVLease(), priority: int = 0) -> Sequence:
    request = EngineRequest(list(tokens), block_hash_chain(tokens, BLOCK_SIZE), SamplingParams(max_tokens=1), 1)
    fields = {**request.__dict__, "lease": lease, "priority": priority}
    return Sequence(EngineRequest(**fields), stream=None, detokenizer=None)


def run(bm: BlockManager, seq: Sequence) -> int:
    """Admit (with its prefix hits), compute and finish ``seq``; the tokens its prefix hits covered."""
    hits = bm.match_prefix(seq)
    bm.admit(seq, hits)
    bm.grow(seq, len(seq) - seq.num_computed_tokens)
    num_hit = seq.num_computed_tokens
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    bm.free_seq(seq, lease=True)
    return num_hit


def history(agent: int, num_blocks: int) -> list[int]:
    return [1000 * (agent + 1) + i for i in range(num_blocks * BLOCK_SIZE + 1)]


def cyclic_hit_rate(bm: BlockManager, num_agents: int, num_rounds: int) -> float:
    """Agents taking turns in a fixed order, each resending its own history (16 blocks)."""
    num_hit = num_sent = 0
    for _ in range(num_rounds):
        for agent in range(num_agents):
            seq = turn(history(agent, 16), KVLease(key=f"agent-{agent}"))
            num_hit += run(bm, seq)
            num_sent += len(seq)
    return num_hit / num_sent


def test_a_cyclic_working_set_larger_than_the_pool_keeps_hitting_under_leases():
    """Six agents of 16 blocks over a pool of 80: the LRU evicts each agent's history just before
    it comes back (no hit at all after the first round); leases keep part of the set whole."""
    lru = cyclic_hit_rate(BlockManager(80, BLOCK_SIZE, lease_ttl_s=0), num_agents=6, num_rounds=5)
    leased = cyclic_hit_rate(BlockManager(80, BLOCK_SIZE, lease_ttl_s=60, lease_fraction=0.5), 6, 5)
    assert lru == 0.0
    assert leased > 0.3


def test_the_lru_is_taken_before_any_leased_block_and_leases_go_by_expiry():
    clock = Clock()
    bm = BlockManager(14, BLOCK_SIZE, lease_ttl_s=10, lease_fraction=1.0, clock=clock)
    run(bm, turn(history(0, 4), KVLease(key="a")))  # 5 blocks: 4 full ones leased, the partial one free
    clock.now = 1
    run(bm, turn(history(1, 4), KVLease(key="b")))
    assert bm.num_leased_blocks == 8 and bm.num_free_blocks == 14  # leased blocks still count as free
    other = turn(history(2, 4), KVLease(ttl_s=0))  # asks for no lease: it runs and its blocks join the LRU
    run(bm, other)
    assert set(bm.leases) == {"a", "b"} and len(bm.free) == 6
    # a newcomer of 7 blocks takes the 6 LRU blocks first, then the lease that expires first ("a"), not "b"
    newcomer = turn(history(3, 7))
    bm.grow(newcomer, len(newcomer) - 1)
    assert "a" not in bm.leases and len(bm.leases["b"].block_ids) == 4
    assert len(bm.match_prefix(turn(history(1, 4)))) == 4  # "b"'s history is whole


def test_an_expired_lease_goes_first_and_a_conversations_next_lease_replaces_its_last():
    clock = Clock()
    bm = BlockManager(16, BLOCK_SIZE, lease_ttl_s=10, lease_fraction=1.0, clock=clock)
    run(bm, turn(history(0, 4), KVLease(key="agent")))
    assert run(bm, turn(history(0, 4), KVLease(key="agent"))) == 16  # the next turn hits its whole history
    assert list(bm.leases) == ["agent"]
    clock.now = 11  # past the renewed lease's expiry
    bm.grow(turn(history(5, 1)), 4)
    assert not bm.leases and bm.num_leased_blocks == 0


def test_a_full_share_refuses_new_leases_instead_of_evicting_the_held_ones():
    bm = BlockManager(20, BLOCK_SIZE, lease_ttl_s=60, lease_fraction=0.5)  # 10 blocks may be leased
    run(bm, turn(history(0, 8), KVLease(key="held")))
    run(bm, turn(history(1, 8), KVLease(key="late")))
    assert len(bm.leases["held"].block_ids) == 8
    assert len(bm.leases["late"].block_ids) == 2  # its leading blocks, as many as the share had room for
    assert bm.leases["late"].block_ids.keys() == set(bm.match_prefix(turn(history(1, 8))).blocks[:2])
    run(bm, turn(history(2, 8), KVLease(key="refused")))
    assert "refused" not in bm.leases and bm.num_leased_blocks == 10


def test_requests_without_a_key_lease_their_own_blocks_and_leases_off_is_the_plain_lru():
    bm = BlockManager(8, BLOCK_SIZE, lease_ttl_s=0)
    run(bm, turn(history(0, 4)))
    assert bm.num_leased_blocks == 0 and len(bm.free) == 8
    bm = BlockManager(8, BLOCK_SIZE, lease_ttl_s=5, lease_fraction=1.0)
    run(bm, turn(history(0, 2)))
    run(bm, turn(history(1, 2)))
    assert len(bm.leases) == 2 and bm.num_leased_blocks == 4


def test_under_priority_the_least_important_lease_goes_first_whatever_its_expiry():
    """vLLM's ``priority`` (lower first) orders which lease the pool takes when its LRU is empty, as
    it orders preemption: the least important conversation's, even if a more important one expires sooner."""
    clock = Clock()
    bm = BlockManager(12, BLOCK_SIZE, lease_ttl_s=10, lease_fraction=1.0, clock=clock)
    run(bm, turn(history(0, 4), KVLease(key="important", ttl_s=5), priority=-1))
    run(bm, turn(history(1, 4), KVLease(key="background"), priority=3))
    run(bm, turn(history(2, 2), KVLease(key="default")))
    assert set(bm.leases) == {"important", "background", "default"} and len(bm.free) == 2  # the partial blocks
    newcomer = turn(history(3, 8))
    bm.grow(newcomer, 3 * BLOCK_SIZE)  # the LRU's 2 blocks, then a lease's: "background" goes whole
    assert set(bm.leases) == {"important", "default"} and len(bm.free) == 3
    bm.grow(newcomer, 7 * BLOCK_SIZE)  # 4 more: the LRU's 3, then "default" (0), not "important" that expires first
    assert set(bm.leases) == {"important"}
    assert len(bm.match_prefix(turn(history(0, 4)))) == 4


def test_released_leases_leave_no_heap_entries_behind():
    """A conversation's leases replaced turn after turn with no pressure on the pool: the heaps hold
    a bounded number of entries, not one per turn served."""
    bm = BlockManager(64, BLOCK_SIZE, lease_ttl_s=3600, lease_fraction=1.0)
    for _ in range(500):
        run(bm, turn(history(0, 2), KVLease(key="agent")))
    assert len(bm.leases) == 1
    assert len(bm._leases._expiries) <= 66 and len(bm._leases._evictions) <= 66
