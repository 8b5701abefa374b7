"""What the engine reports of itself: one plain record, built when asked (``Engine.stats``), which the
metrics read instead of reaching into the scheduler, the block manager and the speculator."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# a step's seconds: one decode row of a tiny model (a millisecond) to a long prefill chunk
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class HistogramCounts:
    """A fixed-bucket histogram as the metrics export it: ``counts[i]`` of the observations at most
    ``bounds[i]`` and above the bound before, the last past every bound; ``sum`` of them all."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' ``le`` buckets: (bound, count at most it), +Inf last."""
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class Buckets:
    """Observations counted into ``STEP_BUCKETS``: a fixed size whatever the steps served."""

    def __init__(self, bounds: tuple[float, ...] = STEP_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding's counters, as vLLM's ``SpecDecodingProm`` names them."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_per_pos: tuple[int, ...]


@dataclass(frozen=True)
class TierStats:
    """The KV cache's second tier (kv_tier.py); token counters since start."""

    num_blocks: int
    num_used_blocks: int
    num_saved_blocks: int
    num_restored_blocks: int
    num_queried_tokens: int  # prompt tokens looked up there (past the pool's hits)
    num_hit_tokens: int  # prompt tokens restored from there
    copy_seconds: HistogramCounts  # per step that copied blocks: the copies' time, which the step waited for


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences in the running batch
    num_scheduled_waiting: int  # sequences in the scheduler's waiting queue
    num_waiting_seqs: int  # submitted and not yet running (the inbox and unreleased n > 1 choices included)
    kv_usage: float  # fraction of KV blocks in use
    num_free_blocks: int  # free KV blocks, cached ones included
    num_blocks: int
    num_prefix_queried_tokens: int  # counters since start
    num_prefix_hit_tokens: int
    num_leased_blocks: int  # cached blocks held for a finished conversation's next turn
    num_leased_hit_tokens: int  # prefix-cache hits on leased blocks since start
    num_preemptions: int
    num_sequences_alive: int  # Sequence objects alive in the process
    num_kv_events_dropped: int | None  # None: no KV events configured
    spec: SpecStats | None  # None: no speculation configured
    tier: TierStats | None = None  # None: no second KV tier
    step_seconds: HistogramCounts | None = None  # the worker's time per step (the tier's copies, forward, sample)
