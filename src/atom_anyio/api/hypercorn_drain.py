"""Drain before hypercorn shuts down, under bare ``hypercorn atom_anyio:app``.

hypercorn's own shutdown closes the listener, gives open connections its
``graceful_timeout`` (3 s by default), cancels what is left and only then
sends ``lifespan.shutdown``: too late for the app to drain. So while serving,
the app holds hypercorn's shutdown trigger back; on SIGTERM/SIGINT it drains
first (the listener stays open: new requests get 503 ``shutting_down``;
in-flight ones finish within ``drain_timeout_s``) and then lets the trigger
fire on an idle server. Two ways hypercorn is triggered, both held here:

* a worker process (the default, ``--workers 1``): the parent sets a shared
  event on the signal and the worker's trigger polls ``event.is_set()``; this
  worker's instance of the event answers False until the drain is done;
* in-process (``--workers 0``, or ``hypercorn.asyncio.serve`` without a
  trigger): hypercorn's signal handlers on the event loop, taken over.

Both reach into hypercorn 0.18's internals (the worker process's target
arguments, asyncio's table of signal handlers); where neither is found (the
CLI, which drains itself; another server) nothing is held.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from typing import Any, Protocol

import anyio
import structlog

from atom_anyio.api.runtime import Runtime

log = structlog.get_logger("atom_anyio.api")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.1  # hypercorn's own interval for the worker's event (a multiprocessing event has nothing to await)


class HeldTrigger(Protocol):
    async def requested(self) -> None:
        """Until hypercorn was asked to shut down."""

    def release(self) -> None:
        """Give hypercorn its trigger back (firing it if the shutdown was asked for)."""


async def drain_before_hypercorn_shutdown(runtime: Runtime) -> None:
    """Hold hypercorn's shutdown until the runtime has drained (a task of the lifespan while serving)."""
    trigger = held_trigger()
    if trigger is None:
        return
    try:
        await trigger.requested()
        log.info("server.signal", server="hypercorn")
        await runtime.drain()
    finally:
        trigger.release()


def held_trigger() -> HeldTrigger | None:
    kwargs = _hypercorn_worker_kwargs()
    if kwargs is not None and kwargs.get("shutdown_event") is not None:
        return WorkerEvent(kwargs["shutdown_event"])
    loop = asyncio.get_running_loop()
    handlers = getattr(loop, "_signal_handlers", {})  # asyncio's Unix loop: sig -> Handle
    handles = {sig: handlers[sig] for sig in SIGNALS if sig in handlers}
    return LoopSignals(loop, handles) if handles else None


def _hypercorn_worker_kwargs() -> dict[str, Any] | None:
    """The arguments of this process's target if it is a hypercorn worker (spawned: they are this
    process's own copies)."""
    process = multiprocessing.current_process()
    target = getattr(process, "_target", None)
    if target is None or not getattr(target, "__module__", "").startswith("hypercorn."):
        return None
    return getattr(process, "_kwargs", None)


class WorkerEvent:
    """The worker's copy of the parent's shutdown event: hypercorn's poll sees it unset until released."""

    def __init__(self, event: Any):
        self.event = event
        event.is_set = lambda: False  # this instance only: the parent's copy is untouched

    async def requested(self) -> None:
        while not type(self.event).is_set(self.event):
            await anyio.sleep(POLL_S)

    def release(self) -> None:
        del self.event.is_set  # the real one again: hypercorn's next poll sees the parent's signal


class LoopSignals:
    """hypercorn's SIGTERM/SIGINT handlers on this loop, replaced by a flag until released."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handles: dict[int, asyncio.Handle]):
        self.loop, self.handles = loop, handles
        self.signalled = anyio.Event()
        for sig in handles:
            loop.add_signal_handler(sig, self.signalled.set)

    async def requested(self) -> None:
        await self.signalled.wait()

    def release(self) -> None:
        for sig, handle in self.handles.items():
            self.loop.add_signal_handler(sig, handle._callback, *handle._args)
        if self.signalled.is_set():
            handle = next(iter(self.handles.values()))
            handle._callback(*handle._args)
