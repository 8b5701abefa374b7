"""One request's delta stream: the engine sends without ever blocking, the
request's task reads, and a slow reader cannot make it grow without bound.

At most ``max_pending`` deltas wait unread; past that a new delta is merged
into the last pending one of the same choice (text, token ids and logprobs
concatenated, the latest finish and counters kept), so what waits is bounded
by the request's own output and a reader that catches up sees the same text.
Every sequence of the request holds one ``ChoiceSender``; the stream ends when
all have closed. Closing the ``RequestStream`` (the reader leaving) makes the
next send raise ``BrokenResourceError`` and ``is_abandoned`` true, which is
how the engine learns to abort the request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio


@dataclass
class Logprob:
    """A token's logprob and the top alternatives at that position (a sampled token's, or a
    prompt token's, whose ``rank`` in the vocabulary is also given: 1 for the likeliest)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class ChoiceDelta:
    """What one step produced for one sequence (choice ``index``)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or token id that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # an error the request caused: the field at fault (a 400), else None (a 500)
    metrics: dict[str, float] = field(default_factory=dict)
    # on a choice's last delta, with speculative decoding: its draft tokens verified and accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # on a choice's last delta: the tokens the wind-down chose to close its grammar within max_tokens
    num_closing_tokens: int = 0
    # on a choice's first delta when the request asked for them: one per prompt token, None for the first
    prompt_logprobs: list[Logprob | None] | None = None

    def merge(self, new: ChoiceDelta) -> None:
        """``new`` (a later delta of the same choice) appended: one delta saying both.
        The one fold of deltas: a slow reader's pending ones, a whole response's, offline results."""
        self.text += new.text
        self.token_ids.extend(new.token_ids)  # the engine makes fresh lists for every delta
        if new.logprobs:
            self.logprobs = [*(self.logprobs or []), *new.logprobs]
        if new.prompt_logprobs is not None:
            self.prompt_logprobs = new.prompt_logprobs
        self.num_prompt_tokens = new.num_prompt_tokens
        self.num_cached_tokens = new.num_cached_tokens
        self.num_output_tokens = new.num_output_tokens
        if new.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = new.finish_reason, new.stop_reason, new.error
            self.error_param = new.error_param
        if new.metrics:
            self.metrics = new.metrics
        self.num_draft_tokens = new.num_draft_tokens or self.num_draft_tokens
        self.num_accepted_tokens = new.num_accepted_tokens or self.num_accepted_tokens
        self.num_closing_tokens = new.num_closing_tokens or self.num_closing_tokens


class RequestStream:
    """The receive side: iterate it (``async with`` closes it)."""

    def __init__(self, max_pending: int):
        assert max_pending >= 1
        self.max_pending = max_pending
        self.pending: deque[ChoiceDelta] = deque()
        self.num_open_senders = 0
        self.is_closed = False
        self._readable: anyio.Event | None = None

    def sender(self) -> ChoiceSender:
        self.num_open_senders += 1
        return ChoiceSender(self)

    # receive side

    def close(self) -> None:
        self.is_closed = True
        self.pending.clear()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def receive(self) -> ChoiceDelta:
        """The next delta; ``EndOfStream`` once every sequence has finished."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise anyio.EndOfStream from None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        while True:
            if self.is_closed:
                raise anyio.ClosedResourceError
            if self.pending:
                return self.pending.popleft()
            if not self.num_open_senders:
                raise StopAsyncIteration
            self._readable = anyio.Event()
            await self._readable.wait()

    # send side

    def _put(self, delta: ChoiceDelta) -> None:
        if self.is_closed:
            raise anyio.BrokenResourceError
        if len(self.pending) < self.max_pending or not self._merge(delta):
            self.pending.append(delta)  # past the bound only a choice with nothing pending adds an entry
        self._wake()

    def _merge(self, delta: ChoiceDelta) -> bool:
        for last in reversed(self.pending):
            if last.index == delta.index:
                last.merge(delta)
                return True
        return False

    def _sender_closed(self) -> None:
        self.num_open_senders -= 1
        self._wake()

    def _wake(self) -> None:
        if self._readable is not None:
            self._readable.set()
            self._readable = None


class ChoiceSender:
    """One sequence's send side; closing it is idempotent."""

    __slots__ = ("_stream",)

    def __init__(self, stream: RequestStream):
        self._stream: RequestStream | None = stream

    def send_nowait(self, delta: ChoiceDelta) -> None:
        if self._stream is None:
            raise anyio.ClosedResourceError
        self._stream._put(delta)

    @property
    def is_abandoned(self) -> bool:
        """Whether the reader has gone (its sequence should be aborted)."""
        return self._stream is None or self._stream.is_closed

    def close(self) -> None:
        if self._stream is not None:
            self._stream._sender_closed()
            self._stream = None


async def collect(stream: RequestStream | Any, num_choices: int) -> list[ChoiceDelta | None]:
    """Every choice of a request folded into one delta each (None: a choice that never reported).
    ``stream``: a ``RequestStream`` or anything iterated the same way (the API's ``GenerationStream``); closed."""
    choices: list[ChoiceDelta | None] = [None] * num_choices
    async with stream:
        async for d in stream:
            if (whole := choices[d.index]) is None:
                whole = choices[d.index] = ChoiceDelta(d.index, "", [])
            whole.merge(d)
    return choices
