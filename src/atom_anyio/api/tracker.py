"""Who is in flight, and the one ``request.finished`` line of each HTTP request.

``RequestTracker`` owns the facts of requests as a whole: how many are in
flight, how many of their sequences are still being prepared, the idle
signal the drain waits on, and the log line and counters written when a
request ends. Everything else asks it.

    HTTP request scope (app.HTTPConnection)   RequestRecord: endpoint, status
      └ tracker.admit(n)  ─────────────────── Admission: counted in flight; n seqs preparing
          └ admission.submitted(stream)        seqs now the engine's (waiting there)
          └ admission.finish(outcome, usage)   released + the line, with usage (generation)
      scope ends: an admission never finished  → finished as cancelled (499): body never started
                  no line yet                  → the line from the response status
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from atom_anyio.api.usage import Usage

if TYPE_CHECKING:
    from atom_anyio.engine.stream import RequestStream
    from atom_anyio.obs.metrics import Metrics

log = structlog.get_logger("atom_anyio.api")


def request_id() -> str | None:
    """The current request's id (bound by the app for each request)."""
    return structlog.contextvars.get_contextvars().get("request_id")


def outcome_of(status: int) -> str:
    """ok below 400, refused for a client error, cancelled for 499 (the client left), else error."""
    if status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    return "refused" if status < 500 else "error"


@dataclass
class RequestRecord:
    """One HTTP request, for its line: filled in as the app learns its route and status."""

    endpoint: str = "other"  # the route's label: a bounded set of values
    status: int | None = None  # the response's, once there is one
    admission: Admission | None = None
    is_logged: bool = False
    log_context: dict[str, Any] = field(default_factory=dict)  # request_id, method, path: for its line


_current: ContextVar[RequestRecord | None] = ContextVar("atom_request_record", default=None)


def current_record() -> RequestRecord | None:
    return _current.get()


class Admission:
    """One generation request from admission to its last byte. ``release`` stops counting it
    (closing its stream, so the engine aborts what is left); ``finish`` also writes its line."""

    def __init__(self, tracker: RequestTracker, record: RequestRecord | None, num_seqs: int):
        self.tracker = tracker
        self.record = record
        self.num_preparing_seqs = num_seqs
        self.stream: RequestStream | None = None
        self.is_released = False

    def submitted(self, stream: RequestStream) -> None:
        self.stream = stream
        self.tracker.num_preparing_seqs -= self.num_preparing_seqs
        self.num_preparing_seqs = 0

    def release(self) -> None:
        if self.is_released:
            return
        self.is_released = True
        if self.stream is not None:
            self.stream.close()
        self.tracker._released(self)

    def finish(self, outcome: str, usage: Usage, status: int) -> None:
        if not self.is_released:
            self.release()
            self.tracker._log_generation(self.record, outcome, usage, status)


class RequestTracker:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.num_in_flight = 0
        self.num_preparing_seqs = 0  # admitted, not yet submitted: waiting too
        self._idle = anyio.Event()

    @contextmanager
    def http_request(self) -> Iterator[RequestRecord]:
        """Around one HTTP request's handling, its body included; its line is written by the end."""
        record = RequestRecord()
        token = _current.set(record)
        try:
            yield record
        finally:
            _current.reset(token)
            self._close(record)

    def admit(self, num_seqs: int) -> Admission:
        """Count a generation request in flight (the caller has checked it may be admitted)."""
        record = _current.get()
        admission = Admission(self, record, num_seqs)
        if record is not None:
            record.admission = admission
        self.num_in_flight += 1
        self.num_preparing_seqs += num_seqs
        return admission

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every request finished within ``timeout`` seconds."""
        with anyio.move_on_after(timeout):
            while self.num_in_flight:
                await self._idle.wait()
        return not self.num_in_flight

    def _released(self, admission: Admission) -> None:
        self.num_preparing_seqs -= admission.num_preparing_seqs
        admission.num_preparing_seqs = 0
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()
            self._idle = anyio.Event()

    def _close(self, record: RequestRecord) -> None:
        admission = record.admission
        if admission is not None and not admission.is_released:  # its body never started: the client left
            admission.finish("cancelled", Usage(), 499)
        if record.is_logged:
            return
        record.is_logged = True
        status = record.status or 499
        outcome = outcome_of(status)
        self.metrics.requests.labels(record.endpoint, outcome).inc()
        context = {**record.log_context, **structlog.contextvars.get_contextvars()}
        log.info("request.finished", **context, endpoint=record.endpoint, outcome=outcome, status=status)

    def _log_generation(self, record: RequestRecord | None, outcome: str, usage: Usage, status: int) -> None:
        """The line of a generation request, with its usage and timings."""
        if record is None:  # driven without the app (no HTTP request)
            record = RequestRecord()
        assert not record.is_logged, "one request.finished line per request"
        record.is_logged = True
        context = {**record.log_context, **structlog.contextvars.get_contextvars()}
        self.metrics.observe_finished(record.endpoint, outcome, usage, context.get("request_id"))
        log.info(
            "request.finished",
            **context,
            endpoint=record.endpoint,
            outcome=outcome,
            status=status,
            finish_reason=usage.finish_reason,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            generated_tokens=usage.completion_tokens,
            **{f"{k}_s": round(v, 6) for k, v in usage.timings.items()},
            **({"spec_acceptance": usage.spec_acceptance} if usage.num_draft_tokens else {}),
            **({"closed_early": usage.num_closed_early} if usage.num_closed_early else {}),
        )
