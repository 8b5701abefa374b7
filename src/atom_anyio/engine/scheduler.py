"""Continuous batching under a token budget.

Policy, each step: every running sequence first, in arrival order (a decode
takes one token, an unfinished prefill the next chunk the budget allows);
then waiting sequences, oldest first, while the budget, ``max_num_seqs`` and
free blocks allow. A running sequence that needs a block when none is free
preempts the newest running sequence (recompute: its blocks are freed and it
goes back to the head of the queue; its prefix is usually still cached).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decodes first, then prefill chunks
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool
    ):
        self.bm = block_manager
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
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while self.bm.num_blocks_to_grow(seq, n) > self.bm.num_free_blocks and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                batch.num_preempted += 1
            if self.bm.num_blocks_to_grow(seq, n) > self.bm.num_free_blocks:
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
            hits = self.bm.match_prefix(seq) if self.prefix_caching and not seq.computes_prompt_logprobs else []
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
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        self.add(seq, front=True)
        self.num_preemptions += 1

    @staticmethod
    def _decodes_first(batch: ScheduledBatch) -> None:
        order = sorted(
            range(len(batch)), key=lambda j: not (batch.num_tokens[j] == 1 and batch.seqs[j].num_computed_tokens > 0)
        )
        batch.seqs = [batch.seqs[j] for j in order]
        batch.num_tokens = [batch.num_tokens[j] for j in order]

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence in any state and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            with contextlib.suppress(ValueError):  # a sibling not yet released to the queue
                self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = Status.FINISHED
