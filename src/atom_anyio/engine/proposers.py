"""Draft tokens proposed on the host, without a model: the next tokens after the longest earlier
match of the sequence's last tokens, in its own prompt and output (n-gram, vLLM's prompt lookup)
or also in a bounded store of the model's recent outputs (suffix matching).

    tokens  a b c d e b c d ?          the last n tokens "b c d" (n in [min, max], longest first)
                  ^^^^^ matched        occur earlier, ending at e = 3 (the most recent such place)
    draft         e b c d ...          the up to k tokens that followed it
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

SEPARATOR = -1  # between two outputs in the store's corpus: no match or draft crosses it


def occurrences(hay: np.ndarray, pattern: np.ndarray, limit: int) -> tuple[int, np.ndarray]:
    """The longest suffix of ``pattern`` that occurs in ``hay`` ending before index ``limit``, and
    where every occurrence of it ends (exclusive, ascending); (0, empty) if not even its last token does."""
    ends = np.flatnonzero(hay[:limit] == pattern[-1]) + 1
    length, best = 1, ends
    for j in range(1, len(pattern)):
        ends = ends[ends > j]
        ends = ends[hay[ends - 1 - j] == pattern[-1 - j]]
        if not ends.size:
            break
        length, best = j + 1, ends
    return (length, best) if best.size else (0, best)


def longest_match(hay: np.ndarray, pattern: np.ndarray, min_n: int, limit: int) -> tuple[int, int]:
    """The longest suffix of ``pattern`` (at least ``min_n`` tokens) that occurs in ``hay`` ending
    before index ``limit``, and where its most recent occurrence ends (exclusive); (0, -1) if none."""
    n, ends = occurrences(hay, pattern, limit)
    return (n, int(ends[-1])) if n and n >= min_n else (0, -1)


def continuation(hay: np.ndarray, start: int, k: int) -> list[int]:
    """Up to ``k`` tokens of ``hay`` from ``start``, stopping at a separator."""
    out = hay[start : start + k]
    cut = np.flatnonzero(out == SEPARATOR)
    return (out[: cut[0]] if cut.size else out).tolist()


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """vLLM's prompt lookup: the longest n in [min_n, max_n] whose last n tokens occur earlier in
    ``tokens``, and the up to ``k`` tokens that followed their most recent earlier occurrence.
    Returns (n, draft); (0, []) when nothing matches."""
    if len(tokens) < 2 or k < 1:
        return 0, []
    pattern = tokens[-min(max_n, len(tokens) - 1) :]
    n, start = longest_match(tokens, pattern, min_n, len(tokens) - 1)
    return (n, continuation(tokens, start, k)) if n else (0, [])


class SuffixStore:
    """Recent outputs of one model, for suffix matching: at most ``max_requests`` outputs and
    ``max_tokens`` tokens in all, least recently used (added or matched) out first. Its corpus
    (the outputs joined by separators) is rebuilt only when an output is added or evicted, so its
    memory is bounded by the two limits, whatever the number of requests served."""

    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.outputs: OrderedDict[int, np.ndarray] = OrderedDict()  # by insertion id, LRU first
        self.num_tokens = 0
        self._next_id = 0
        self._corpus: tuple[np.ndarray, np.ndarray, list[int]] | None = None  # corpus, starts, ids

    def add(self, output: list[int]) -> None:
        if not output or len(output) > self.max_tokens or self.max_requests < 1:
            return
        self.outputs[self._next_id] = np.asarray(output, dtype=np.int64)
        self._next_id += 1
        self.num_tokens += len(output)
        while len(self.outputs) > self.max_requests or self.num_tokens > self.max_tokens:
            _, dropped = self.outputs.popitem(last=False)
            self.num_tokens -= len(dropped)
        self._corpus = None

    def corpus(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Every output, each followed by a separator; each output's start; their ids."""
        if self._corpus is None:
            ids = list(self.outputs)
            parts = [p for a in self.outputs.values() for p in (a, np.array([SEPARATOR]))]
            corpus = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            starts = np.cumsum([0, *(len(a) + 1 for a in self.outputs.values())])[:-1]
            self._corpus = (corpus, starts, ids)
        return self._corpus

    def touch(self, position: int) -> None:
        """The output holding ``position`` of the corpus was used: it is evicted last."""
        _, starts, ids = self.corpus()
        self.outputs.move_to_end(ids[int(np.searchsorted(starts, position, side="right")) - 1])


def follow(hay: np.ndarray, ends: np.ndarray, k: int, min_prob: float) -> tuple[float, list[int]]:
    """Suffix decoding's draft from the places after a match (``ends``): token by token the most
    frequent next token there (the most recent on a tie), while its estimated probability (the
    share of the places continuing with it, times the previous token's) is at least ``min_prob``;
    the places that end (the hay's end, a separator) count against it. Returns the draft's score,
    the sum of those probabilities (its expected accepted tokens), and the draft."""
    draft: list[int] = []
    prob = score = 0.0
    for _ in range(k):
        total = ends.size
        ends = ends[ends < len(hay)]
        nxt = hay[ends]
        ends, nxt = ends[nxt != SEPARATOR], nxt[nxt != SEPARATOR]
        if not nxt.size:
            break
        tokens, counts = np.unique(nxt, return_counts=True)
        top = tokens[counts == counts.max()]
        token = nxt[np.flatnonzero(np.isin(nxt, top))[-1]] if top.size > 1 else top[0]
        share = float(counts.max()) / total
        prob = share if not draft else prob * share
        if prob < min_prob:
            break
        draft.append(int(token))
        score += prob
        ends = ends[nxt == token] + 1
    return score, draft


def suffix_draft(
    tokens: np.ndarray, store: SuffixStore, k: int, max_depth: int, spec_factor: float, min_prob: float = 0.0
) -> tuple[int, list[int]]:
    """Suffix decoding over the sequence's own tokens and the store's outputs: in each, the longest
    match of the last tokens (at most ``max_depth``) and ``follow``'s draft from its occurrences,
    at most ``ceil(spec_factor * n)`` of ``k`` tokens for a match of n; the draft of the higher
    score wins (its own on a tie). Returns (the winning match's length, its draft)."""
    if len(tokens) < 2 or k < 1:
        return 0, []
    pattern = tokens[-min(max_depth, len(tokens) - 1) :]
    n, ends = occurrences(tokens, pattern, len(tokens) - 1)
    score, draft = follow(tokens, ends, min(k, math.ceil(spec_factor * n)), min_prob) if n else (0.0, [])
    corpus, _, _ = store.corpus()
    if corpus.size:
        m, ends = occurrences(corpus, tokens[-min(max_depth, len(tokens)) :], len(corpus))
        their_score, theirs = follow(corpus, ends, min(k, math.ceil(spec_factor * m)), min_prob) if m else (0.0, [])
        if their_score > score:
            n, draft = m, theirs
            store.touch(int(ends[-1]) - 1)
    return (n, draft) if draft else (0, [])
