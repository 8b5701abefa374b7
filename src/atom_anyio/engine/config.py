"""The engine's one configuration object."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step, decodes and prefill chunks together
    kv_cache_gib: float = 2.0  # memory budget of the KV pool
    num_kv_blocks: int | None = None  # overrides the budget (tests force preemption with it)
    enable_prefix_caching: bool = True
    max_consecutive_step_failures: int = 3  # then the engine is marked unhealthy
    max_pending_deltas: int = 64  # unread deltas per request before new ones are merged into them
    # torch intra-op threads for the forward on CPU; None: every core. The forward leaves the GIL, and on
    # the 2-core VM two threads served 1.6x the output of one at c16 (docs/performance.md)
    num_threads: int | None = None

    @property
    def cpu_threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1
