"""One generation request's path, shared by every wire format.

A route parses its body into a ``PromptRequest`` (or several), its sampling
parameters included, and calls ``Runtime.generate`` with an ``encoder_for``
function; the runtime admits, prepares in one worker-thread hop (each prompt
becomes its finished ``EngineRequest``), builds the wire format's ``Encoder``
from the prepared prompts, submits, and responds: the encoder's SSE events
or its whole response, with an error event or an error body if the engine
fails. The request's line is written once, when the response ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, Protocol

from atom_anyio.api.errors import APIError
from atom_anyio.api.tracker import Admission, outcome_of
from atom_anyio.api.usage import Usage
from atom_anyio.engine.stream import ChoiceDelta, RequestStream


class GenerationFailed(Exception):
    """A request's sequence ended with an engine error (the step failed or the engine stopped), or
    with one the request caused (``param``: its field at fault, e.g. a grammar that admits no output)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Encoder(Protocol):
    """Engine deltas -> one wire format."""

    usage: Usage

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        """The whole response."""

    def events(self, stream: RequestStream) -> AsyncIterator[str]:
        """The response as SSE events."""

    def error_event(self, err: APIError) -> str:
        """The SSE event(s) that end a stream the engine failed."""


class GenerationStream:
    """A request's deltas as encoders read them: each folded into ``usage``; an error delta
    raises ``GenerationFailed``, and so does the stream ending before every choice finished.
    ``async with`` closes the stream (the engine then aborts what is left)."""

    def __init__(self, stream: RequestStream, usage: Usage, num_choices: int):
        self.stream = stream
        self.usage = usage
        self.num_unfinished = num_choices

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stream.close()

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> ChoiceDelta:
        try:
            d = await self.stream.__anext__()
        except StopAsyncIteration:
            if self.num_unfinished:
                raise GenerationFailed("the engine stopped before the request finished") from None
            raise
        if d.finish_reason == "error":
            raise GenerationFailed(d.error or "the engine failed", d.error_param)
        self.usage.add(d)
        self.num_unfinished -= d.finish_reason is not None
        return d


async def stream_body(encoder: Encoder, stream: RequestStream, admission: Admission) -> AsyncIterator[str]:
    """An SSE body: the encoder's events, an error event if the engine fails mid-stream,
    then the request is finished (the headers went out with 200 before the body)."""
    outcome = "cancelled"
    try:
        async with aclosing(encoder.events(stream)) as events:
            async for event in events:
                yield event
        outcome = "ok"
    except GenerationFailed as exc:
        outcome = "error"
        yield encoder.error_event(engine_error(exc))
    except APIError as exc:
        outcome = "error"
        yield encoder.error_event(exc)
    finally:
        admission.finish(outcome, encoder.usage, status=200)


async def json_body(body: Awaitable[dict[str, Any]], usage: Usage, admission: Admission) -> dict[str, Any]:
    outcome, status = "cancelled", 499  # the client closed the request
    try:
        result = await body
        outcome, status = "ok", 200
        return result
    except GenerationFailed as exc:
        error = engine_error(exc)
        outcome, status = outcome_of(error.status), error.status
        raise error from None
    except APIError as exc:
        outcome, status = outcome_of(exc.status), exc.status
        raise
    finally:
        admission.finish(outcome, usage, status)


def engine_error(exc: GenerationFailed) -> APIError:
    if exc.param is not None:  # the request's own fault: a 400 naming its field
        return APIError(400, f"Invalid value for '{exc.param}': {exc}", param=exc.param, code="invalid_value")
    return APIError(500, f"The engine failed while generating: {exc}", code="engine_error")


class TokenText:
    """Token id -> its text and bytes, for logprobs (memoised: bounded by the vocabulary)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            hit = self._cache[token_id] = (text, list(text.encode("utf-8", errors="replace")))
        return hit
