"""Speculative decoding without a draft model: the settings (vLLM's ``speculative_config``), the
host-side ``Speculator`` that proposes each step's drafts, and the verification rule.

A sequence with a draft of d tokens is scheduled for 1 + d positions (its last token and the
draft, like a small prefill chunk); the step makes logits at all of them and samples each one as
a decode would at that point (the same processors and seeded noise: the position's generated
count is its step). Draft token i is accepted while it equals the token sampled at position i;
the first sampled token that differs (or the one after a fully accepted draft) is the bonus.

For a deterministic draft (probability 1 on its token x) this is the standard rejection rule:
x is accepted with probability p(x), and on a rejection the token comes from p with x removed
and renormalised, because it is a sample of p conditioned on not being x. It gives the very
tokens a plain decode gives, seeded runs included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from atom_anyio.engine.proposers import SuffixStore, ngram_draft, suffix_draft
from atom_anyio.engine.wind_down import WIND_DOWN_TOKENS
from atom_anyio.settings import json_object

log = structlog.get_logger("atom_anyio.engine")

if TYPE_CHECKING:
    from atom_anyio.engine.sequence import Sequence

METHODS = ("ngram", "suffix")
MAX_STEPS_WITHOUT_DRAFT = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for the draft-free methods, key for key (plus
    ``suffix_decoding_max_cached_tokens``, the store's token bound)."""

    method: str
    num_speculative_tokens: int | None = None  # the most draft tokens a step verifies per sequence
    prompt_lookup_min: int | None = None  # ngram: the shortest match that proposes
    prompt_lookup_max: int | None = None  # ngram: the longest match tried
    disable_by_batch_size: int | None = 8  # no drafts in a step with more running sequences than this
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest match tried
    suffix_decoding_max_cached_requests: int = 1000  # suffix: outputs kept in the store
    suffix_decoding_max_cached_tokens: int = 262_144  # suffix: tokens kept in the store
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: a match of n tokens drafts at most factor * n
    suffix_decoding_min_token_prob: float = 0.1  # suffix: a draft token's least estimated probability

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, not {self.method!r}")
        k = self.num_speculative_tokens
        if k is None and self.method == "ngram":
            raise ValueError("speculative_config: num_speculative_tokens is required for method ngram")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        set_ = object.__setattr__  # defaults resolved as vLLM resolves them
        set_(self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth if k is None else k)
        set_(self, "prompt_lookup_min", lo if lo is not None else hi if hi is not None else 5)
        set_(self, "prompt_lookup_max", hi if hi is not None else self.prompt_lookup_min)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if (value := getattr(self, name)) is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config: {name} must be a positive integer, not {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) "
                f"is more than prompt_lookup_max ({self.prompt_lookup_max})"
            )
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_tokens"):
            if not isinstance(value := getattr(self, name), int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, not {value!r}")
        requests, factor = self.suffix_decoding_max_cached_requests, self.suffix_decoding_max_spec_factor
        if not isinstance(requests, int) or requests < 0 or not isinstance(factor, int | float) or factor <= 0:
            raise ValueError(
                "speculative_config: suffix_decoding_max_cached_requests must be >= 0 "
                "and suffix_decoding_max_spec_factor > 0"
            )
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], not {prob!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | str | None:
        """From the setting's JSON text (or its object); ``AUTO`` for "auto", None for empty or
        "off". Raises ValueError naming a bad key or value."""
        word = text.strip().lower() if isinstance(text, str) else None
        if word in ("auto", "off", "none", ""):
            return AUTO if word == "auto" else None
        if not text:
            return None
        if word is not None and not word.startswith("{"):
            raise ValueError(f'speculative_config: "auto", "off" or a JSON object, not {text!r}')
        raw = text if isinstance(text, dict) else json_object(text)
        known = [f.name for f in fields(cls)]
        for key in raw:
            if key not in known:
                raise ValueError(f"speculative_config: unknown key {key!r} (known: {', '.join(known)})")
        if "method" not in raw:
            raise ValueError(f"speculative_config: method is required (one of {', '.join(METHODS)})")
        return cls(**raw)


AUTO = "auto"  # the setting's default: AUTO_CONFIG where a verifying step is exact, else off
# auto's speculation (docs/engine.md, "Speculative decoding"): suffix drafts for a lone stream, only
# tokens whose estimated probability is at least one half (a draft token on a CPU costs about a
# fifth of a decode step: 0.1, vLLM's default, slowed prose), at most 24 of them (vLLM's suffix default)
AUTO_CONFIG = {"method": "suffix", "disable_by_batch_size": 1, "suffix_decoding_min_token_prob": 0.5}


def speculator_for(cfg: SpeculativeConfig | str | None, async_scheduling: bool, exact: bool) -> Speculator | None:
    """Speculative decoding, where configured and where it runs: not beside async scheduling, whose
    step in flight would have to guess how many of a draft's tokens its successor starts after.
    ``exact``: a verifying step gives a plain decode's bits (batch-invariant kernels). ``AUTO``:
    ``AUTO_CONFIG`` where exact and not beside async scheduling, else off (logged)."""
    if cfg == AUTO:
        if not exact or async_scheduling:
            why = "async_scheduling" if async_scheduling else "not exact: batch invariance is off"
            log.info("spec_decode.off", reason=f"auto: {why}")
            return None
        cfg = SpeculativeConfig(**AUTO_CONFIG)
        log.info("spec_decode.on", auto=True, exact=exact, **dataclasses.asdict(cfg))
        return Speculator(cfg)
    if cfg is None:
        return None
    if async_scheduling:
        log.warning("spec_decode.off", reason="async_scheduling", method=cfg.method)
        return None
    log.info("spec_decode.on", exact=exact, **dataclasses.asdict(cfg))
    return Speculator(cfg)


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """The rule: draft tokens accepted, the longest prefix of ``draft`` equal to the tokens sampled
    at its positions (``sampled`` has one more, the bonus)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


class Speculator:
    """Proposes each step's drafts on the host and adapts each sequence's draft length to its
    acceptance; counts drafts and acceptance (per position too) for the metrics."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.max_tokens = cfg.num_speculative_tokens
        self.store = (
            SuffixStore(cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_cached_tokens)
            if cfg.method == "suffix"
            else None
        )
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * self.max_tokens

    def is_active(self, num_running: int) -> bool:
        """Speculation steps aside when the batch is large enough that verifying costs throughput."""
        limit = self.cfg.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens to follow ``seq`` (a decode), never past its ``max_tokens``
        or the context, nor where the next tokens depend on more than the model's choice."""
        if seq.num_steps_without_draft:
            seq.num_steps_without_draft -= 1
            return []
        num_left = seq.max_tokens - seq.num_output_tokens
        if seq.matcher is not None:  # the wind-down checks one token a step: no draft reaches into it
            num_left -= WIND_DOWN_TOKENS
        k = min(seq.num_speculative_tokens or self.max_tokens, limit, num_left - 1)
        if k < 1 or seq.reasoning_budget is not None or (seq.matcher is not None and seq.grammar_gate):
            return []
        tokens = draft_context(seq)
        cfg = self.cfg
        if self.store is None:
            _, draft = ngram_draft(tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        else:
            max_depth, factor = cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor
            _, draft = suffix_draft(tokens, self.store, k, max_depth, factor, cfg.suffix_decoding_min_token_prob)
        return within_grammar(seq.matcher, draft) if seq.matcher is not None else draft

    def verified(self, seq: Sequence, num_draft: int, accepted: int) -> None:
        """One draft's result: the counters, and the sequence's next draft length (one more after
        a whole draft was accepted, else one past what was). After n drafts wholly rejected in a
        row it drafts nothing for 2^(n-1) steps (at most 16): a verifying step costs more than a
        decode, and a sequence that is not repeating anything should not pay it every step."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.num_accepted_per_pos[i] += 1
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += accepted
        k = seq.num_speculative_tokens or self.max_tokens
        seq.num_speculative_tokens = min(self.max_tokens, k + 1) if accepted == num_draft else max(1, accepted + 1)
        seq.num_rejected_drafts = 0 if accepted else seq.num_rejected_drafts + 1
        if seq.num_rejected_drafts:
            seq.num_steps_without_draft = min(MAX_STEPS_WITHOUT_DRAFT, 2 ** (seq.num_rejected_drafts - 1))

    def finished(self, seq: Sequence) -> None:
        if self.store is not None:
            self.store.add(seq.output_token_ids)


def draft_context(seq: Sequence) -> np.ndarray:
    """``seq.token_ids`` as int64, from a buffer beside the sequence that takes only what was appended
    since its last draft (and doubles when full): converting a 30k-token conversation took 0.5 ms a step."""
    buf, done, total = seq.draft_context, seq.num_draft_context, len(seq.token_ids)
    if buf is None or total > len(buf):
        grown = np.empty(max(64, 2 * total), dtype=np.int64)
        if buf is not None:
            grown[:done] = buf[:done]
        seq.draft_context = buf = grown
    buf[done:total] = seq.token_ids[done:total]
    seq.num_draft_context = total
    return buf[:total]


def within_grammar(matcher: Any, draft: list[int]) -> list[int]:
    """The longest prefix of ``draft`` the grammar allows, short of the token that ends it (the step
    masks the position after each draft token with the grammar's state there); the matcher is
    left as it was."""
    n, ends = 0, False
    while n < len(draft) and not ends and matcher.accept_token(draft[n]):
        n += 1
        ends = matcher.is_terminated()
    if n:
        matcher.rollback(n)
    return draft[: n - ends]


# in the worker thread, a step with drafts: one sampled row per position, ``1 + len(draft)`` each


def draft_positions(last_rows: list[int], drafts: list[list[int]]) -> list[int]:
    """The flattened rows whose logits a step makes: for each sampling sequence (its last row),
    its draft's positions and the one after them."""
    return [r for last, draft in zip(last_rows, drafts, strict=True) for r in range(last - len(draft), last + 1)]


def verify(drafts: list[list[int]], token_ids: list[int]) -> list[int]:
    """Each draft's accepted length, from the tokens sampled at its positions (``token_ids``: one per position)."""
    accepted, row = [], 0
    for draft in drafts:
        accepted.append(num_accepted(draft, token_ids[row : row + len(draft) + 1]))
        row += len(draft) + 1
    return accepted
