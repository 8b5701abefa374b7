"""Event-loop lag and GC pauses, measured into histograms."""

from __future__ import annotations

import ctypes
import ctypes.util
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


def freeze_heap() -> None:
    """Move everything alive now (model, tokenizer, modules) out of the collector's
    view, so full collections only walk what requests in flight hold. Python's
    thresholds are kept: thinning full collections (tried: 10x rarer) left each
    burst's cyclic garbage (hypercorn's per-connection objects) alive longer,
    which showed as RSS, while their share of time was already under 0.05%."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    gc.unfreeze()


M_ARENA_MAX = -8  # glibc's mallopt parameter number


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (``mallopt`` and ``malloc_trim`` are glibc's), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    return libc


def limit_malloc_arenas(max_arenas: int) -> bool:
    """Cap glibc's malloc arenas (``MALLOC_ARENA_MAX``) for arenas created from
    now on. glibc gives threads their own arenas (up to 8 per core); memory freed
    in one stays there, fragmented, so every worker thread that ever ran (model
    steps, prompt preparation) adds RSS that a burst leaves behind. 0 leaves
    glibc's default. Returns whether the limit was set (False off glibc)."""
    if max_arenas <= 0 or (libc := _glibc()) is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, max_arenas))


def release_freed_memory() -> bool:
    """Give the pages of memory malloc holds free back to the system (glibc's ``malloc_trim(0)``,
    every arena, not only the heap's top). Loading a model frees its staging buffers (a GGUF's
    dequantized slices, the tiles' repacking) below glibc's trim threshold, which it raises with
    every large buffer freed: SmolLM2's GGUF at the defaults left 260 MiB of RSS that nothing
    used (1,743 -> 1,483 MiB anonymous, AMD EPYC Zen 4, 2026-12-08). Called once the model is
    loaded and warmed up, never between steps (it walks the arenas holding their locks). Returns
    whether it ran (False off glibc)."""
    if (libc := _glibc()) is None:
        return False
    libc.malloc_trim(0)
    return True


def anonymous_rss_bytes() -> int | None:
    """This process's resident anonymous memory (Linux's ``RssAnon``), or None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
