"""What the engine reports of itself: one plain record, built when asked (``Engine.stats``), which the
metrics read instead of reaching into the scheduler, the block manager and the speculator."""

from __future__ import annotations

from dataclasses import dataclass


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
