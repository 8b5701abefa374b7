"""Tokenize rendered prompts piece by piece, caching the pieces between special tokens.

A rendered chat is text pieces separated by the tokenizer's special tokens::

    <|im_start|> "system\\n...prompt..." <|im_end|> "\\n" <|im_start|> "user\\n..." <|im_end|> ...
                 └── piece: LRU hit ──┘           └hit┘              └─ new: encoded ─┘

The tokenizer itself splits at added tokens before it normalizes or pre-tokenizes,
so encoding each piece alone gives the same ids as one full encode. A probe at
construction checks that for this tokenizer; where it fails, every encode is a
full encode.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# What the tokenizers library strips next to an lstrip/rstrip added token (Rust's char::is_whitespace).
_WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)
}

_INT32 = array("i").itemsize  # bytes per packed token id

_PROBE_SNIPPETS = (
    "system\nYou are a helpful assistant.",
    "user\n Hello   world!\n\n",
    " leading space",
    "\n",
    "  \n\t two  spaces\t",
    "assistant\n<think>\nok</think>\n\nSure: 1234567 + 89.01 = x",
    "héllo wörld — 你好，世界 🎉👩‍💻 e\u0301 \u00a0nbsp",
    'tool\n{"name": "get", "arguments": {"path": "/tmp/a b.py"}}',
    "<|not_special|> <|im_start <s > [INST] </s",
    "trailing spaces   ",
    "x",
)


@dataclass(frozen=True)
class Tokenized:
    """Token ids of one text, with the boundaries of its pieces for cutting by message."""

    token_ids: list[int]
    num_hit_tokens: int  # tokens that came from the cache instead of the tokenizer
    char_ends: list[int]  # end offset in the text of each piece (text pieces and special tokens)
    token_ends: list[int]  # end offset in token_ids of the same pieces

    def token_offset(self, char_offset: int) -> int:
        """The token index where the text at ``char_offset`` starts, interpolated inside a piece."""
        i = bisect.bisect_right(self.char_ends, char_offset)
        if i == len(self.char_ends):
            return len(self.token_ids)
        char_start = self.char_ends[i - 1] if i else 0
        token_start = self.token_ends[i - 1] if i else 0
        num_chars = self.char_ends[i] - char_start
        num_tokens = self.token_ends[i] - token_start
        return token_start + (char_offset - char_start) * num_tokens // max(num_chars, 1)


class SegmentCache:
    """Thread-safe tokenizer front end with an LRU of text pieces, bounded by total cached tokens.

    An entry is the piece's ``str`` and its ids packed in ``bytes`` (int32): about
    ``len(piece) + 4 * num_tokens + 200`` bytes, and no object the GC tracks (an
    ``array`` is tracked, so a full collection would walk every entry).

    ``encode(text)`` equals ``tokenizer(text, add_special_tokens=False)["input_ids"]``;
    ``encode(text, add_special_tokens=True)`` equals ``tokenizer(text)["input_ids"]``.
    """

    def __init__(self, tokenizer: Any, max_tokens: int = 1 << 22):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._pieces: OrderedDict[str, bytes] = OrderedDict()  # piece -> int32 ids, least recently used first
        self._num_cached_tokens = 0
        specials = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self._special_re = _special_token_pattern(specials)
        self._specials = {t.content: (i, t.lstrip, t.rstrip) for i, t in specials.items()}
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if hasattr(backend, "encode_batch") else None
        self._prefix_ids, self._suffix_ids = _added_special_ids(tokenizer)
        # whether pieces are encoded on their own (and cached): the probe found that exact
        self.is_piecewise = not any(t.single_word for t in specials.values()) and self._probe(list(self._specials))
        if not self.is_piecewise:
            logger.warning(
                "segment cache off for %s: encoding the pieces between special tokens does not "
                "match a full encode, so every prompt is encoded in full",
                getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__,
            )

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens

    def encode(self, text: str, *, add_special_tokens: bool = False) -> Tokenized:
        """Token ids of ``text``, encoding only the pieces the cache has not seen."""
        if not self.is_piecewise:
            return self._full_encode(text, add_special_tokens)
        return self._piecewise_encode(text, add_special_tokens)

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._num_cached_tokens = 0

    def _piecewise_encode(self, text: str, add_special_tokens: bool) -> Tokenized:
        pieces, specials = self._split(text)
        cached = self._lookup(pieces)
        missing = list(dict.fromkeys(p for p in pieces if p and p not in cached))
        encoded = dict(zip(missing, self._encode_batch(missing), strict=True)) if missing else {}
        if encoded:
            self._store(encoded)
        token_ids = list(self._prefix_ids) if add_special_tokens else []
        char_ends, token_ends = [0], [len(token_ids)]
        num_hit_tokens = char_end = 0
        for i, piece in enumerate(pieces):
            if piece:
                ids = cached.get(piece)
                if ids is None:
                    ids = encoded[piece]
                else:
                    num_hit_tokens += len(ids)
                token_ids.extend(ids)
                char_end += len(piece)
                char_ends.append(char_end)
                token_ends.append(len(token_ids))
            if i < len(specials):
                special_id, char_end = specials[i]
                token_ids.append(special_id)
                char_ends.append(char_end)
                token_ends.append(len(token_ids))
        if add_special_tokens and self._suffix_ids:
            token_ids.extend(self._suffix_ids)
            char_ends.append(len(text))
            token_ends.append(len(token_ids))
        return Tokenized(token_ids, num_hit_tokens, char_ends, token_ends)

    def _split(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        """Text pieces and, between each two, a special token as (id, end offset in text)."""
        if self._special_re is None:
            return [text], []
        pieces, specials = [], []
        start = 0
        for match in self._special_re.finditer(text):
            special_start, end = match.span()
            if special_start < start:
                continue  # inside whitespace that an rstrip token took
            special_id, lstrip, rstrip = self._specials[match.group()]
            if lstrip:
                while special_start > start and text[special_start - 1] in _WHITESPACE:
                    special_start -= 1
            if rstrip:
                while end < len(text) and text[end] in _WHITESPACE:
                    end += 1
            pieces.append(text[start:special_start])
            specials.append((special_id, end))
            start = end
        pieces.append(text[start:])
        return pieces, specials

    def _lookup(self, pieces: Sequence[str]) -> dict[str, memoryview]:
        hits = {}
        with self._lock:
            for piece in pieces:
                packed = self._pieces.get(piece)
                if packed is not None:
                    self._pieces.move_to_end(piece)
                    hits[piece] = memoryview(packed).cast("i")
        return hits

    def _store(self, encoded: dict[str, list[int]]) -> None:
        with self._lock:
            for piece, ids in encoded.items():
                if piece not in self._pieces and len(ids) <= self.max_tokens:
                    self._pieces[piece] = array("i", ids).tobytes()
                    self._num_cached_tokens += len(ids)
            while self._num_cached_tokens > self.max_tokens:
                _, packed = self._pieces.popitem(last=False)
                self._num_cached_tokens -= len(packed) // _INT32

    def _encode_batch(self, pieces: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(pieces, add_special_tokens=False)]
        return self.tokenizer(pieces, add_special_tokens=False)["input_ids"]

    def _full_encode(self, text: str, add_special_tokens: bool) -> Tokenized:
        token_ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return Tokenized(token_ids, 0, [len(text)], [len(token_ids)])

    def _probe(self, specials: list[str]) -> bool:
        """Whether piecewise encodes equal full encodes on chat-like texts built around this
        tokenizer's specials: unicode, digits, whitespace runs and leading spaces after specials."""
        texts = list(_PROBE_SNIPPETS)
        for n, special in enumerate(specials[:16]):
            other = specials[(n + 1) % len(specials)]
            texts.append("".join(s + special + other for s in _PROBE_SNIPPETS) + special)
            texts.append(special + " " + special + "\n" + other + " x " + special + special + "  ")
        try:
            for text in texts:
                for add_special_tokens in (False, True):
                    piecewise = self._piecewise_encode(text, add_special_tokens).token_ids
                    if piecewise != self._full_encode(text, add_special_tokens).token_ids:
                        return False
        finally:
            self.clear()
        return True


def _special_token_pattern(specials: dict[int, Any]) -> re.Pattern | None:
    """One regex for all special tokens, longest first. Plain literals keep it fast: re scans
    for their first characters instead of trying every alternative at every position."""
    contents = sorted((t.content for t in specials.values()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, contents))) if contents else None


def _added_special_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer(text)`` puts around the text's own ids (BOS, EOS, ...)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []  # the probe catches a tokenizer that does something else
