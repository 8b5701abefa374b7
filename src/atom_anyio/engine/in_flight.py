"""The loop's record of a step sent to the worker and not yet processed, and what sending it and
getting its result back change on its sequences (the loop's own changes: ``build_step`` changes none)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from atom_anyio.engine.scheduler import ScheduledBatch
from atom_anyio.engine.step import StepInput


@dataclass
class InFlight:
    """A step sent to the worker whose result is not yet processed. Until it is, its sequences count
    its tokens as scheduled and each token it samples as a placeholder: the scheduler plans past them
    (async scheduling), and nothing preempts them or frees their blocks."""

    batch: ScheduledBatch
    step: StepInput
    schedule_s: float
    failed: bool = False  # its sequences failed with the step before it: its result is dropped

    def hold(self) -> None:
        """It is sent: its tokens are scheduled, and its sampled tokens pending."""
        now = time.monotonic()
        for seq in self.batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        self._count(1)

    def settle(self) -> None:
        """Its result is back (or the loop ended): ``hold`` undone."""
        self._count(-1)

    def _count(self, sign: int) -> None:
        for seq, n in zip(self.batch.seqs, self.batch.num_tokens, strict=True):
            seq.num_scheduled_tokens += sign * n
        for row in self.step.sample_rows:
            self.batch.seqs[row].num_placeholders += sign

    def sample_rows(self) -> dict[int, int]:
        """Each sampling sequence's sample row in this step, by ``seq_id``."""
        return {self.batch.seqs[row].seq_id: j for j, row in enumerate(self.step.sample_rows)}
