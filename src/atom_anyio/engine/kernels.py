"""The C++ CPU kernels in ``csrc/``, built with torch's cpp_extension at first
use and cached (torch's extension directory, ``TORCH_EXTENSIONS_DIR``).

They register ``torch.ops.atom.*``. The build targets the CPU it runs on
(``-march=native``), so the cache entry is named after the source, the torch
version and the CPU's instruction-set flags. Without a compiler the build
fails once, the reason is returned and the portable torch path is used.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("atom_anyio.engine")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "ops.cpp", CSRC / "quant.cpp", CSRC / "decoder.cpp"]
HEADERS = [CSRC / "vec.h", CSRC / "kernels.h"]
# no FMA contraction of separate products: the elementwise kernels round as torch's ops do
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def cpu_flags() -> str:
    """The CPU's instruction-set flags (``/proc/cpuinfo``), or its name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()))


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (or load the cached build of) the CPU kernels. None when
    ``torch.ops.atom`` is ready, else why not (logged once)."""
    from torch.utils import cpp_extension  # imports setuptools: only when needed

    digest = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(), cpu_flags().encode()):
        digest.update(part)
    name = f"atom_cpu_kernels_{digest.hexdigest()[:16]}"
    t0 = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the portable path serves
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        log.warning("kernels.unavailable", reason=reason)
        return reason
    log.info("kernels.loaded", name=name, seconds=round(time.perf_counter() - t0, 2))
    return None
