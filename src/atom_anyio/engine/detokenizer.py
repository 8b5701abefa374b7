"""Token ids to text deltas, one token at a time, with stop strings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_NUM_PROMPT_CONTEXT_TOKENS = 5  # decoded ahead of the output so its first token reads as in a full decode
_MAX_HELD_TOKENS = 8  # past this many tokens without visible text, release what can no longer change
_NUM_UNSETTLED_TOKENS = 4  # at least 3 bytes: enough to complete or break any open UTF-8 character


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas at O(1) cost per token.

    Each step decodes only a small window of tokens, ``tokens[prefix_offset:]``, and returns
    the text it adds to ``tokens[prefix_offset:read_offset]``. A delta is held back while it
    ends in an incomplete UTF-8 character ("\\ufffd"), so no delta ever splits a character.

    What the deltas join to (plus ``flush()``): for byte-level BPE tokenizers, exactly
    ``tokenizer.decode(output_ids, skip_special_tokens=...)``, whatever the prompt. The window
    is seeded with the last prompt tokens, so for tokenizers whose decoder looks at the token
    before (SentencePiece strips the leading space of the first token) the output reads as it
    does after the prompt: ``decode(prompt + output)[len(decode(prompt)):]``. The seed is dropped
    when the prompt ends inside a character, so the output never completes a prompt character.

    Stop strings: the output ends before the stop string that completes first (or after it with
    ``include_stop_str_in_output``); nothing after it is ever returned. Text that could still be
    the start of a stop string is held back until it cannot, or until ``flush()``. Empty stop
    strings are ignored.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        # the context starts and ends on whole characters, or the window would decode them differently
        context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).startswith("\ufffd"):
            del context[0]
        if self._decode(context).endswith("\ufffd"):
            context = []
        # tokens[prefix_offset:read_offset] decodes to text already passed on; tokens[read_offset:] are held
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []  # the deltas returned
        self._tail = ""  # the last max_stop_len - 1 characters decoded, to find stop strings split across steps
        self._num_held = 0  # trailing characters of _tail not yet returned: they may start a stop string
        self._stop_matched: str | None = None

    @property
    def stop_matched(self) -> str | None:
        return self._stop_matched

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._pieces)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly visible text (possibly "")."""
        if self._stop_matched is not None:
            return ""
        self._token_ids.append(token_id)
        return self._accept(self._decode_step(is_final=False), is_final=False)

    def flush(self) -> str:
        """At finish: return the text still held back (incomplete characters included)."""
        if self._stop_matched is not None:
            return ""
        return self._accept(self._decode_step(is_final=True), is_final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, *, is_final: bool) -> str:
        """Advance the window; return the text the held tokens add, once it is complete."""
        token_ids = self._token_ids
        prefix_text = self._decode(token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(token_ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (is_final or not new_text.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
            return new_text[len(prefix_text) :]
        if len(token_ids) - self._read_offset > _MAX_HELD_TOKENS:
            return self._release_settled(prefix_text, new_text)
        return ""

    def _release_settled(self, prefix_text: str, new_text: str) -> str:
        """Release the text of all but the last few held tokens, if it can no longer change.

        Keeps the window bounded when tokens never complete a character (repeated lone lead
        bytes) or add no text (skipped special tokens).
        """
        split = len(self._token_ids) - _NUM_UNSETTLED_TOKENS
        settled = self._decode(self._token_ids[self._prefix_offset : split])
        # each character decodes from at least one byte, so 3 characters after the split are >= 3 bytes
        is_open = settled.endswith("\ufffd") and len(self._decode(self._token_ids[split:])) < 3
        if is_open or len(settled) < len(prefix_text) or not new_text.startswith(settled):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, split
        return settled[len(prefix_text) :]

    def _accept(self, new: str, *, is_final: bool) -> str:
        """Check ``new`` text for stop strings; record and return the part that may be shown now."""
        if not self._stop:
            self._pieces.append(new)
            return new
        # a stop string ending in `new` starts at most max_stop_len - 1 characters before it
        window = self._tail + new
        first_unsent = len(self._tail) - self._num_held
        match = _first_stop(window, self._stop)
        if match is not None:
            stop, start = match
            end = start + len(stop) if self._include_stop else start
            assert end >= first_unsent, "text after a stop string's start was already returned"
            self._stop_matched = stop
            visible = window[first_unsent:end]
        else:
            self._num_held = 0 if is_final or self._include_stop else _partial_stop_len(window, self._stop)
            self._tail = window[max(0, len(window) - self._max_stop_len + 1) :]
            visible = window[first_unsent : len(window) - self._num_held]
        self._pieces.append(visible)
        return visible


def _first_stop(text: str, stop: list[str]) -> tuple[str, int] | None:
    """The stop string that completes first in ``text`` (the longest if several end together), and its start."""
    found = [(start + len(s), start, s) for s in stop if (start := text.find(s)) >= 0]
    if not found:
        return None
    _, start, s = min(found)
    return s, start


def _partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    for n in range(min(len(text), max(map(len, stop)) - 1), 0, -1):
        suffix = text[-n:]
        if any(s.startswith(suffix) for s in stop):
            return n
    return 0
