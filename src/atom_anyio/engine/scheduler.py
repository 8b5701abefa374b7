"""Continuous batching under a token budget.

Policy, each step: every running sequence first, in arrival order (a decode
takes one token, an unfinished prefill the next chunk the budget allows);
then waiting sequences, oldest first, while the budget, ``max_num_seqs`` and
free blocks allow. A running sequence that needs a block when none is free
preempts the newest running sequence (recompute: its blocks are freed and it
goes back to the head of the queue; its prefix is usually still cached).

Speculative decoding: a running decode may take its last token and a draft (1 + d positions,
``ScheduledBatch.drafts``); when blocks run short the draft is dropped before anyone is preempted.

Async scheduling: the next step is scheduled while the step in flight runs. A
sequence of that step is scheduled again only if ``runs_ahead`` (its next input
is the token being sampled, which the worker fills in); it is never preempted
and its blocks are not freed until the step's result is back.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from dataclasses import dataclass, field

from atom_anyio.engine.block_manager import BlockManager, PrefixHit
from atom_anyio.engine.logits_processors import has_penalty
from atom_anyio.engine.sequence import Sequence, Status
from atom_anyio.engine.speculative import Speculator


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decodes first, then prefill chunks
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    drafts: dict[int, list[int]] = field(default_factory=dict)  # by seq_id: tokens verified after its last
    # the second tier's copies this step runs before its forward (kv_tier.py): (pool block, slot)
    # saves, then (slot, pool block) loads
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_caching: bool,
        speculator: Speculator | None = None,
        by_priority: bool = False,  # scheduling_policy=priority: the waiting queue in (priority, arrival) order
    ):
        self.bm = block_manager
        self.by_priority = by_priority
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue ``seq``: last (``front``: first, a preempted one or a released choice), or under
        ``by_priority`` in (priority, arrival) order, as vLLM's priority policy keeps its queue."""
        seq.status = Status.WAITING
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, _order(seq), key=_order), seq)
        else:
            (self.waiting.appendleft if front else self.waiting.append)(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        speculates = self.speculator is not None and self.speculator.is_active(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_scheduled_tokens and not runs_ahead(seq):  # it waits for its step's result
                i += 1
                continue
            n = min(seq.num_unscheduled_tokens, budget)
            draft = self._draft(seq, budget) if speculates else []
            if draft and self.bm.num_blocks_to_grow(seq, n + len(draft)) <= self.bm.num_free_blocks:
                batch.drafts[seq.seq_id] = draft
                n += len(draft)
            while (
                self.bm.num_blocks_to_grow(seq, n) > self.bm.num_free_blocks and (victim := self._victim(i)) is not None
            ):
                self.running.remove(victim)
                self._preempt(victim)
                batch.num_preempted += 1
            if self.bm.num_blocks_to_grow(seq, n) > self.bm.num_free_blocks:
                if seq.num_scheduled_tokens:  # never preempted in flight: it waits for its step's result
                    i += 1
                    continue
                self._preempt(self.running.pop(i))
                batch.num_preempted += 1
                break
            self.bm.grow(seq, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.num_preempted:
            seq = self.waiting[0]
            hits = (
                self.bm.match_prefix(seq) if self.prefix_caching and not seq.computes_prompt_logprobs else PrefixHit()
            )
            n = min(len(seq) - len(hits) * self.bm.block_size, budget)
            if not self.bm.can_admit(seq, n, hits):
                break
            self.waiting.popleft()
            self.bm.admit(seq, hits)
            self.bm.grow(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        self._decodes_first(batch)
        if self.bm.tier is not None:
            batch.kv_saves, batch.kv_loads = self.bm.tier.take_transfers()
        return batch

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """A draft for a decode (its last token is all it has left to compute), within the budget."""
        is_decode = seq.num_uncomputed_tokens == 1 and not seq.num_scheduled_tokens
        return self.speculator.propose(seq, budget - 1) if is_decode and budget > 1 else []

    def _victim(self, i: int) -> Sequence | None:
        """The newest running sequence after ``running[i]`` that is in no step in flight; under
        ``by_priority``, of those, the one of the lowest priority (then the newest), and only one that
        ``running[i]`` outranks (else ``running[i]`` itself is preempted)."""
        candidates = [s for s in self.running[i + 1 :] if not s.num_scheduled_tokens]
        if not self.by_priority:
            return candidates[-1] if candidates else None
        victim = max(candidates, key=_order, default=None)
        return victim if victim is not None and _order(victim) > _order(self.running[i]) else None

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        self.add(seq, front=True)
        self.num_preemptions += 1

    @staticmethod
    def _decodes_first(batch: ScheduledBatch) -> None:
        def is_decode(j: int) -> bool:
            seq = batch.seqs[j]
            return batch.num_tokens[j] == 1 and seq.num_computed_tokens + seq.num_scheduled_tokens > 0

        order = sorted(range(len(batch)), key=lambda j: not is_decode(j))
        batch.seqs = [batch.seqs[j] for j in order]
        batch.num_tokens = [batch.num_tokens[j] for j in order]

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence in any state and free its blocks, unless a step in flight still writes
        them (async scheduling: the loop frees them when that step's result is back)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            with contextlib.suppress(ValueError):  # a sibling not yet released to the queue
                self.waiting.remove(seq)
        if not seq.num_scheduled_tokens:
            self.bm.free_seq(seq, lease=True)
        seq.status = Status.FINISHED


def _order(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival_time, seq.seq_id


def runs_ahead(seq: Sequence) -> bool:
    """Async scheduling's one eligibility rule: may ``seq``, in the step in flight, be scheduled into
    the next step before that step's result is back? Only when the next step needs nothing of the
    token being sampled but its id, which the worker takes from its own record of the sampled ids.
    Not so with a grammar (the mask needs the matcher advanced by it), a repetition, frequency or
    presence penalty (the sampler counts the generated tokens), a reasoning budget (the loop may
    replace the token), unreleased n > 1 siblings (released on the first token), prompt logprobs not
    yet all computed, nor when the token in flight is its last (``max_tokens``): such a sequence
    waits for the result and joins the step after it."""
    return (
        seq.matcher is None
        and not has_penalty(seq.params)
        and seq.reasoning_budget is None
        and not seq.siblings
        and not seq.computes_prompt_logprobs
        and seq.num_output_tokens + seq.num_placeholders < seq.max_tokens
    )
