"""A request's token counts and timings, folded from its deltas as they arrive."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from atom_anyio.engine.stream import ChoiceDelta


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    inter_token_gaps: list[float] = field(default_factory=list)  # between deltas, as the client sees them
    finish_reason: str | None = None  # the last choice to finish
    num_draft_tokens: int = 0  # speculative decoding, every choice's
    num_accepted_tokens: int = 0
    num_closed_early: int = 0  # choices whose grammar the wind-down closed to end within max_tokens
    _last_delta_at: float | None = None

    def add(self, d: ChoiceDelta) -> None:
        """Fold one delta in (prompt counts are per choice, the same for all)."""
        self.prompt_tokens = max(self.prompt_tokens, d.num_prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, d.num_cached_tokens)
        self.completion_tokens += len(d.token_ids)
        if d.token_ids:
            at = time.perf_counter()
            if self._last_delta_at is not None:
                self.inter_token_gaps.append(at - self._last_delta_at)
            self._last_delta_at = at
        if d.metrics:
            self.timings = d.metrics
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.num_draft_tokens += d.num_draft_tokens
            self.num_accepted_tokens += d.num_accepted_tokens
            self.num_closed_early += d.num_closing_tokens > 0

    @property
    def spec_acceptance(self) -> float | None:
        """The share of draft tokens accepted (speculative decoding); None when nothing was drafted."""
        return round(self.num_accepted_tokens / self.num_draft_tokens, 3) if self.num_draft_tokens else None

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
