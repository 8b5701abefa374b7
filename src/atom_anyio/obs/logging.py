"""structlog set-up: JSON lines by default, console rendering on a TTY.

Everything goes through one handler on the root logger whose
``ProcessorFormatter`` runs the same processors for structlog events and for
stdlib records (hypercorn's error and access logs, libraries), so every line
has ``event``, ``level``, ``timestamp`` and ``logger``, plus ``request_id`` and
the other request fields bound in contextvars while a request runs."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor

# hypercorn's own rendering of an access line (only seen by handlers other than ours)
ACCESS_LOG_FORMAT = "%(m)s %(U)s %(s)s %(L)s"
ACCESS_LOGGER = "hypercorn.access"

# libraries that print through a console handler of their own; routed through the root handler instead
SELF_HANDLED_LOGGERS = ("transformers",)
# hypercorn gives these a console handler in its own format each time it builds its logging, which under
# ``hypercorn atom_anyio:app`` is after the app has started: a filter on the logger outlives that
HYPERCORN_LOGGERS = ("hypercorn.error", ACCESS_LOGGER)

_handler: logging.Handler | None = None


class ThroughRootHandler(logging.Filter):
    """On a logger: hand each record to the root handler (JSON) instead of the logger's own
    console handlers; a logger that writes to a file (``--access-logfile PATH``) keeps its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = logging.getLogger(record.name).handlers
        if _handler is None or any(type(h) is not logging.StreamHandler for h in own):
            return True
        _handler.handle(record)
        return False


def access_fields(_: Any, __: str, event: EventDict) -> EventDict:
    """A hypercorn access record becomes ``http.access`` with typed fields.
    Only named atoms are kept: the atom mapping also holds every request
    header and environment variable (an API key among them)."""
    atoms = event.pop("positional_args", None)
    record = event.get("_record")
    if record is None or record.name != ACCESS_LOGGER or not isinstance(atoms, Mapping):
        return event
    event.update(
        event="http.access",
        method=atoms["m"],
        path=atoms["U"],
        status=int(atoms["s"]) if atoms["s"].isdigit() else None,
        duration_s=float(atoms["L"]),
        client=atoms["h"],
    )
    rid = atoms["{x-request-id}o"]
    if rid != "-":
        event["request_id"] = rid
    return event


def log_to_stderr_by_default() -> None:
    """Until something configures structlog (``configure_logging``, or the application embedding the
    engine), its lines go to stderr instead of structlog's default, stdout: stdout carries results
    (``atom-anyio generate`` prints the completions there)."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def configure_logging(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """``fmt``: json, console, or auto (console when ``stream`` is a TTY).
    ``stream`` defaults to stderr. Safe to call again: it replaces its handler."""
    global _handler
    stream = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    rendering: list[Processor] = (
        [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if use_json
        else [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, access_fields],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
            pass_foreign_args=True,
        )
    )
    numeric_level = logging.getLevelName(level.upper())
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    _handler = handler
    for name in SELF_HANDLED_LOGGERS:
        lib = logging.getLogger(name)
        consoles = [h for h in lib.handlers if type(h) is logging.StreamHandler]  # files stay
        for h in consoles:
            lib.removeHandler(h)
        lib.propagate = lib.propagate or bool(consoles)
    for name in HYPERCORN_LOGGERS:
        lib = logging.getLogger(name)
        if not any(isinstance(f, ThroughRootHandler) for f in lib.filters):
            lib.addFilter(ThroughRootHandler())
    logging.captureWarnings(True)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
