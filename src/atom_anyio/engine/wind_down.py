"""Constrained output near its max_tokens: room kept to close the grammar.

Sampled freely, a constrained output can spend its whole ``max_tokens`` inside a string or a list
and end cut (``"length"``) with nothing that parses. Within ``WIND_DOWN_TOKENS`` of its budget, a
constrained row's sampled token is kept only if the ending the ``Closer`` finds after it (its
tokens and a stop token) still fits in the tokens left; else the row takes the first token of
the ending it had before the step. The closer is deterministic, so the steps after follow the
rest of that ending: the output ends with ``"stop"``, complete, a string perhaps cut short. A row
whose ending is already longer than the tokens it has left is left to run out as before.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr


WIND_DOWN_TOKENS = 64  # tokens left from which a constrained row keeps room to close its grammar
MAX_CLOSING_CHARS = 256
MAX_PIECE_BYTES = 32  # the longest vocabulary piece a closing is cut into
# where the grammar branches: closers first, then a separator (before a digit that would only
# lengthen a number), the shortest values, anything else
_PRIORITY = tuple(dict.fromkeys('}]",0tfn[{' + string.ascii_letters + string.digits + string.punctuation + " \n"))
# where a space is allowed too (inside a string, most likely), a quote ends the string rather
# than a brace or bracket being taken in as text
_IN_TEXT = ('"', *_PRIORITY)


class Closer:
    """A short grammar-valid ending of a constrained output, as tokens. One per server, built from
    the vocabulary as xgrammar decodes it; it reads matchers and never changes them."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.token_of: dict[bytes, int] = {}
        for token_id, piece in enumerate(info.decoded_vocab):
            if piece:
                self.token_of.setdefault(bytes(piece), token_id)  # the first of equal pieces

    def closing(self, matcher: Any) -> list[int] | None:
        """Tokens that complete ``matcher``'s grammar, the last a stop token; None when the search
        finds none within ``MAX_CLOSING_CHARS``."""
        text = _closing_text(matcher.fork())
        return None if text is None else self._tokens(matcher.fork(), text.encode())

    def _tokens(self, fork: Any, data: bytes) -> list[int] | None:
        """``data`` cut into the longest pieces ``fork`` accepts one by one, then a stop token."""
        tokens: list[int] = []
        while data:
            for n in range(min(len(data), MAX_PIECE_BYTES), 0, -1):
                token = self.token_of.get(data[:n])
                if token is not None and fork.accept_token(token):
                    tokens.append(token)
                    data = data[n:]
                    break
            else:
                return None
        stop = next((t for t in fork.stop_token_ids if fork.accept_token(t)), None)
        return None if stop is None else [*tokens, stop]


def _closing_text(fork: Any) -> str | None:
    """Characters that complete ``fork``'s grammar (advancing it); None past ``MAX_CLOSING_CHARS``."""
    text = ""
    while not fork.is_completed():
        step = _next_step(fork)
        if step is None or len(text) + len(step) > MAX_CLOSING_CHARS:
            return None
        text += step
    return text


def _next_step(fork: Any) -> str | None:
    """``fork`` advanced by the characters its grammar forces, or else by the first candidate it accepts."""
    forced = fork.find_jump_forward_string()
    if forced:
        return forced if fork.accept_string(forced) else None
    candidates = _IN_TEXT if fork.fork().accept_string(" ") else _PRIORITY
    return next((c for c in candidates if fork.accept_string(c)), None)


@dataclass(frozen=True)
class Closing:
    """A constrained row within ``WIND_DOWN_TOKENS`` of its max_tokens: how to close its grammar,
    and the tokens it may still generate, this step's included."""

    closer: Closer
    num_tokens_left: int

    def replacement(self, matcher: Any, token: int) -> int | None:
        """The token to take instead of the sampled ``token``: the first of the closing, where
        ``token`` leaves too few tokens to close the grammar after it and the closing fits; else None."""
        if self._leaves_room(matcher, token):
            return None
        tokens = self.closer.closing(matcher)
        return tokens[0] if tokens is not None and len(tokens) <= self.num_tokens_left else None

    def _leaves_room(self, matcher: Any, token: int) -> bool:
        fork = matcher.fork()
        if token in matcher.stop_token_ids or not fork.accept_token(token):  # it ends, or is refused
            return True
        after = self.closer.closing(fork)
        return after is not None and len(after) < self.num_tokens_left
