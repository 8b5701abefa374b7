"""Shared by every wire format: body parsing, SSE framing, collecting a
request's deltas, usage."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import Response, request

from atom_anyio.api.errors import APIError, from_validation_error
from atom_anyio.api.limits import check_body, depth_error
from atom_anyio.engine.sequence import Delta, Logprob
from atom_anyio.engine.stream import DeltaStream

M = TypeVar("M", bound=BaseModel)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only bodies with one are checked for a lone half


async def parse_body(model: type[M]) -> M:
    """The request body validated against ``model``; 4xx naming the field otherwise."""
    ctype = request.mimetype
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {ctype!r}", code="unsupported_media_type")
    raw = await request.get_data(as_text=False)
    try:
        body = json.loads(raw, parse_constant=_not_a_number)
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not valid UTF-8.", code="invalid_json") from None
    except RecursionError:
        raise depth_error() from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400, f"The request body is not valid JSON: {exc.msg} at position {exc.pos}", code="invalid_json"
        ) from None
    except ValueError as exc:  # NaN or Infinity, or an integer over Python's digit limit
        reason = str(exc).partition(";")[0]
        raise APIError(400, f"The request body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    check_body(body)
    if SURROGATE_ESCAPE.search(raw) and not _is_encodable(body):
        raise APIError(400, "The request body has a lone UTF-16 surrogate (\\ud800-\\udfff).", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _not_a_number(literal: str) -> float:
    raise ValueError(f"{literal} is not a JSON number")


def _is_encodable(body: dict) -> bool:
    """No string holds half a surrogate pair (JSON escapes allow it; UTF-8 and the tokenizer do not)."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def sse_response(events: AsyncIterator[str]) -> Response:
    """A streamed ``text/event-stream`` response with no send timeout (Quart
    would otherwise cut a long stream off silently after 60 s)."""
    resp = Response(
        events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    resp.timeout = None
    return resp


def sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    inter_token_gaps: list[float] = field(default_factory=list)  # between deltas, as the client sees them
    finish_reason: str | None = None  # the last choice to finish
    _last_delta_at: float | None = None

    def add(self, d: Delta) -> None:
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

    def openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class EngineFailed(Exception):
    """A request's sequence ended with an engine error (the step failed or the engine stopped)."""


def raise_on_error(d: Delta) -> None:
    if d.finish_reason == "error":
        raise EngineFailed(d.error or "the engine failed")


async def collect(stream: DeltaStream, n: int, usage: Usage) -> list[Choice]:
    """Every choice of a request, whole (non-streaming responses)."""
    choices = [Choice(index=i) for i in range(n)]
    async with stream:
        async for d in stream:
            raise_on_error(d)
            c = choices[d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            if d.logprobs:
                c.logprobs += d.logprobs
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            usage.add(d)
    if any(c.finish_reason is None for c in choices):
        raise EngineFailed("the engine stopped before the request finished")
    return choices


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
