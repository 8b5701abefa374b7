"""Event-loop lag and GC pauses, measured into histograms."""

from __future__ import annotations

import gc
import time

import anyio
import structlog
from prometheus_client import Histogram

log = structlog.get_logger("atom_anyio.obs")


async def monitor_loop_lag(hist: Histogram, tick: float = 0.01, warn_above: float = 0.1) -> None:
    """Sleep ``tick`` forever; how late each wake-up is goes into ``hist``,
    and a lag over ``warn_above`` is logged (something blocked the loop)."""
    while True:
        start = anyio.current_time()
        await anyio.sleep(tick)
        lag = max(0.0, anyio.current_time() - start - tick)
        hist.observe(lag)
        if lag > warn_above:
            log.warning("event_loop.lag", lag_s=round(lag, 4))


class GCTimer:
    """A ``gc.callbacks`` hook timing every collection by generation."""

    def __init__(self, hist: Histogram):
        self.hist = hist
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.hist.labels(str(info["generation"])).observe(time.perf_counter() - self._start)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


# gen-1 collections per full one (Python's default is 10). After the freeze a full
# collection only finds in-flight requests' objects, which reference counting frees
# anyway (the one cycle a request makes, werkzeug's route matcher closure, dies young).
GEN1_PER_FULL_COLLECTION = 100


def freeze_heap() -> tuple[int, int, int]:
    """Move everything alive now (model, tokenizer, modules) out of the collector's
    view, so gen-2 collections only walk what requests create, and run them less
    often. Returns the thresholds to give ``thaw_heap``."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], GEN1_PER_FULL_COLLECTION)
    return thresholds


def thaw_heap(thresholds: tuple[int, int, int]) -> None:
    gc.set_threshold(*thresholds)
    gc.unfreeze()
