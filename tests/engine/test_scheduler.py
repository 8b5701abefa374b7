"""The scheduler and block manager without a model: hand-built sequences and
hand-built step results (the tokens a step "sampled"), the way vLLM tests its
scheduler. Budgets, chunked prefill, decode-first order, preemption when blocks
run out and resumption from the prefix cache, finish freeing blocks."""

from __future__ import annotations

import dataclasses

from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.scheduler import ScheduledBatch, Scheduler
from atom_anyio.engine.sequence import Sequence, Status
from atom_anyio.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(token_ids: list[int], max_tokens: int = 8) -> Sequence:
    """A sequence as the engine builds one; no stream or detokenizer (the scheduler reads neither)."""
    request = EngineRequest(
        prompt_token_ids=list(token_ids),
        block_hashes=block_hash_chain(token_ids, BLOCK_SIZE),
        params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
    )
    return Sequence(request, stream=None, detokenizer=None)


def prompt(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + num_tokens))


def make_scheduler(
    num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, prefix_caching: bool = True
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE), max_num_seqs, budget, prefix_caching)


def complete_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does with a step's result: the scheduled tokens' KV is computed, full blocks
    are published, each sequence whose tokens are all computed gets its sampled token (1000 + its
    length, so tokens differ), and one at ``max_tokens`` finishes."""
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += n
        if sched.prefix_caching:
            sched.bm.commit(seq)
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(1000 + len(seq))
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq)


def scheduled(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    return list(zip(batch.seqs, batch.num_tokens, strict=True))


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    sched = make_scheduler(budget=16)
    seq = make_seq(prompt(40))
    sched.add(seq)
    chunks = []
    while seq.num_output_tokens == 0:
        batch = sched.schedule()
        chunks += batch.num_tokens
        complete_step(sched, batch)
    assert chunks == [16, 16, 8]
    assert scheduled(sched.schedule()) == [(seq, 1)]  # then one token per step
    assert len(seq.block_table) == 11  # 41 tokens in blocks of 4


def test_decodes_and_prefill_chunks_share_the_budget_decodes_first():
    sched = make_scheduler(budget=10)
    decoding = [make_seq(prompt(3, first=100 * i)) for i in range(3)]
    for seq in decoding:
        sched.add(seq)
    complete_step(sched, sched.schedule())  # three prefills of 3 tokens: now each decodes
    late = make_seq(prompt(20, first=900))
    sched.add(late)
    batch = sched.schedule()
    assert scheduled(batch) == [*((s, 1) for s in decoding), (late, 7)]
    complete_step(sched, batch)
    # the prefill in progress comes after the decodes however it arrived
    assert scheduled(sched.schedule()) == [*((s, 1) for s in decoding), (late, 7)]


def test_waiting_sequences_are_admitted_oldest_first_up_to_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(prompt(5, first=100 * i)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and sched.running == seqs[:2] and list(sched.waiting) == [seqs[2]]
    assert seqs[2].status is Status.WAITING and not seqs[2].block_table
    complete_step(sched, batch)
    sched.finish(seqs[0])
    assert scheduled(sched.schedule()) == [(seqs[1], 1), (seqs[2], 5)]


def test_a_prompt_waits_while_the_blocks_for_its_first_chunk_are_not_free():
    sched = make_scheduler(num_blocks=4)
    first, second = make_seq(prompt(12), max_tokens=2), make_seq(prompt(8, first=500))
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert batch.seqs == [first] and list(sched.waiting) == [second]  # 3 blocks taken, 2 needed, 1 free
    assert batch.num_preempted == 0  # a waiting prompt never preempts a running one
    complete_step(sched, batch)
    complete_step(sched, sched.schedule())  # first's decode fills its 3rd block exactly, then it finishes
    assert first.is_finished and sched.bm.num_free_blocks == 4
    assert scheduled(sched.schedule()) == [(second, 8)]


def test_running_out_of_blocks_preempts_the_newest_which_resumes_from_its_cached_prefix():
    sched = make_scheduler(num_blocks=6)
    older, newer = make_seq(prompt(8), max_tokens=8), make_seq(prompt(8, first=500), max_tokens=8)
    sched.add(older)
    sched.add(newer)
    for _ in range(5):  # prefill (2 blocks each), then decodes: 12 tokens computed each, 3 blocks each
        batch = sched.schedule()
        assert batch.num_preempted == 0
        complete_step(sched, batch)
    assert sched.bm.num_free_blocks == 0 and len(newer) == 13

    batch = sched.schedule()  # older needs a 4th block: the newest running sequence gives its blocks back
    assert scheduled(batch) == [(older, 1)] and batch.num_preempted == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [newer] and newer.status is Status.WAITING
    assert not newer.block_table and newer.num_computed_tokens == 0
    while not older.is_finished:
        complete_step(sched, batch)
        batch = sched.schedule()

    # older took only newer's last block (the LRU evicts a sequence's tail first): newer's first two
    # blocks are still cached, so it recomputes only its generated tokens
    assert scheduled(batch) == [(newer, 5)]
    assert newer.num_computed_tokens == 8 and newer.num_cached_tokens == 8 and newer.num_output_tokens == 5
    while not newer.is_finished:
        complete_step(sched, batch)
        batch = sched.schedule()
    assert newer.output_token_ids == [1000 + n for n in range(8, 16)]  # every token once, none lost
    assert not sched.has_work and sched.bm.num_free_blocks == 6


def test_the_newest_sequences_are_preempted_first_and_only_as_many_as_needed():
    sched = make_scheduler(num_blocks=7)
    seqs = [make_seq(prompt(8, first=100 * i), max_tokens=8) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    complete_step(sched, sched.schedule())  # the prompts: 2 blocks each, 6 of 7 taken
    batch = sched.schedule()  # each needs a 3rd: the oldest takes the free one, the next the newest's
    assert batch.seqs == seqs[:2] and batch.num_preempted == 1
    assert sched.running == seqs[:2] and list(sched.waiting) == [seqs[2]]


def test_a_prefix_cache_hit_skips_the_cached_blocks_but_computes_the_last_token():
    sched = make_scheduler()
    first = make_seq(prompt(12), max_tokens=1)
    sched.add(first)
    complete_step(sched, sched.schedule())
    assert first.is_finished
    again = make_seq(prompt(12))  # a fully cached prompt: its last block is recomputed for the logits
    longer = make_seq([*prompt(12), 77, 78])
    sched.add(again)
    sched.add(longer)
    assert scheduled(sched.schedule()) == [(again, 4), (longer, 2)]
    assert (again.num_cached_tokens, longer.num_cached_tokens) == (8, 12)
    assert again.block_table[:2] == longer.block_table[:2]
    assert sched.bm.blocks[longer.block_table[0]].ref_count == 2  # one block, two readers


def test_a_hash_that_matches_different_tokens_is_not_a_hit():
    sched = make_scheduler()
    first = make_seq(prompt(9), max_tokens=1)
    sched.add(first)
    complete_step(sched, sched.schedule())
    impostor = make_seq(prompt(9, first=50))
    impostor.block_hashes = list(first.block_hashes)  # a collision: same hashes, other tokens
    sched.add(impostor)
    assert scheduled(sched.schedule()) == [(impostor, 9)] and impostor.num_cached_tokens == 0


def test_without_prefix_caching_nothing_is_reused():
    sched = make_scheduler(prefix_caching=False)
    first = make_seq(prompt(12), max_tokens=1)
    sched.add(first)
    complete_step(sched, sched.schedule())
    again = make_seq(prompt(12))
    sched.add(again)
    assert scheduled(sched.schedule()) == [(again, 12)] and not sched.bm.cached


def test_finishing_frees_every_block_and_keeps_full_ones_cached():
    sched = make_scheduler(num_blocks=8)
    seq = make_seq(prompt(10), max_tokens=3)
    sched.add(seq)
    while not seq.is_finished:
        complete_step(sched, sched.schedule())
    assert not seq.block_table and not sched.running and sched.bm.num_free_blocks == 8
    assert len(sched.bm.cached) == 3  # 12 computed tokens of 13 (the last sampled one never ran)


def test_finish_takes_a_sequence_out_of_the_queue_in_any_state():
    sched = make_scheduler()
    running, waiting = make_seq(prompt(6)), make_seq(prompt(6, first=50))
    sched.add(running)
    complete_step(sched, sched.schedule())
    sched.add(waiting)
    sched.finish(waiting)  # aborted before it was scheduled
    sched.finish(running)  # aborted mid-generation
    assert running.is_finished and waiting.is_finished and not sched.has_work
    assert sched.bm.num_free_blocks == sched.bm.num_blocks
    assert sched.schedule().seqs == []


def prioritized(token_ids: list[int], priority: int, max_tokens: int = 8) -> Sequence:
    request = EngineRequest(
        list(token_ids), block_hash_chain(token_ids, BLOCK_SIZE), SamplingParams(max_tokens=max_tokens), max_tokens
    )
    return Sequence(dataclasses.replace(request, priority=priority), stream=None, detokenizer=None)


def test_under_the_priority_policy_the_queue_is_in_priority_then_arrival_order():
    """vLLM's --scheduling-policy priority: lower first, ties by arrival; fcfs ignores priorities."""
    seqs = [prioritized(prompt(4, first=100 * i), priority) for i, priority in enumerate([5, 0, 5, -1, 0])]
    sched = Scheduler(BlockManager(64, BLOCK_SIZE), 2, 64, True, by_priority=True)
    fcfs = make_scheduler(max_num_seqs=2)
    for seq in seqs:
        sched.add(seq)
        fcfs.add(seq)
    assert [s.priority for s in sched.waiting] == [-1, 0, 0, 5, 5]
    assert list(sched.waiting) == [seqs[3], seqs[1], seqs[4], seqs[0], seqs[2]]
    assert list(fcfs.waiting) == seqs
    assert [s for s, _ in scheduled(sched.schedule())] == [seqs[3], seqs[1]]  # max_num_seqs 2: the first two


def test_under_the_priority_policy_the_lowest_priority_running_sequence_is_preempted():
    """Out of blocks, the running sequence of the lowest priority (not the newest) gives its blocks
    back, and it waits in its place in the queue."""
    sched = Scheduler(BlockManager(9, BLOCK_SIZE), 8, 64, True, by_priority=True)
    low, urgent, mid = prioritized(prompt(8), 9), prioritized(prompt(8, 300), 0), prioritized(prompt(8, 600), 1)
    for seq in (urgent, low):  # admitted one step apart: running [urgent, low, mid], urgent the longest
        sched.add(seq)
        complete_step(sched, sched.schedule())
    sched.add(mid)  # the newest: fcfs would preempt it when urgent needs a block
    batch = sched.schedule()
    for _ in range(8):  # prefill, then decodes until the three need a 4th block each and the pool has none
        if batch.num_preempted:
            break
        complete_step(sched, batch)
        batch = sched.schedule()
    assert batch.num_preempted == 1 and list(sched.waiting) == [low] and low.status is Status.WAITING
    assert {s for s, _ in scheduled(batch)} <= {urgent, mid} and low not in sched.running
