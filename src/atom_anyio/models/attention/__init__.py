"""Paged attention: one metadata object per step, backends behind one interface.

The KV cache of a layer is two flat tensors ``[num_slots, num_kv_heads,
head_dim]`` where ``slot = block_id * block_size + offset``. A step's tokens
are flattened: decode tokens first (one per sequence), then the prefill
chunks. Every backend takes the same ``AttentionMetadata`` (block tables,
context lengths, query offsets) and writes the step's K/V into the cache
before attending over it. The metadata and the ``AttentionBackend`` protocol
live in ``metadata.py``, which imports no backend; this package's
``__init__`` chooses a backend (``select_backend``) and re-exports the names
callers use.

* ``cpu`` (``cpu.py``): decodes through a C++ kernel
  (``kernels/csrc/paged_attention.cpp``) that reads each sequence's KV
  through its block table where it lies: no gathered copy, no padding to the
  longest sequence; prefill chunks through torch's flash attention for the
  CPU, one call per chunk (its blocked GEMMs run several times faster than
  the kernel's per-query loop on long chunks: docs/performance.md). The
  default on CPUs. ``cpu_paged`` runs prefill chunks through the kernel too
  (the fused decoder's path in every step); ``auto`` picks it for bfloat16 on
  a CPU with AVX512-BF16 and no AMX, where the kernel's bfloat16 dot products
  beat torch's SDPA (``kernel_prefill_reason``).
* ``torch`` (``portable.py``): the portable path on any torch device. It
  gathers each sequence's context through its block table and runs batched
  ``scaled_dot_product_attention`` (one call for all decodes, one for all
  prefill chunks). It is the reference the exactness tests pin and the
  fallback when the kernel cannot be built.
* ``triton`` (``triton.py``): one Triton kernel for decodes and prefill
  chunks on NVIDIA and AMD GPUs (and on the CPU under
  ``TRITON_INTERPRET=1``, for tests).
* ``flashinfer``, ``aiter`` (``vendor.py``): thin adapters over the vendor
  libraries, used when they are importable.
"""

from __future__ import annotations

import importlib.util

import structlog
import torch

from atom_anyio import kernels
from atom_anyio.models.attention.cpu import CpuPagedAttention
from atom_anyio.models.attention.metadata import (
    AttentionBackend,
    AttentionMetadata,
    GatherPlan,
    PrefillChunk,
    attend,
    stage,
    triton_interpreted,
)
from atom_anyio.models.attention.portable import TorchPagedAttention, gather
from atom_anyio.models.plan import BACKENDS

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedAttention",
    "GatherPlan",
    "PrefillChunk",
    "TorchPagedAttention",
    "attend",
    "auto_candidates",
    "first_that_runs",
    "gather",
    "kernel_prefill_reason",
    "load_backend",
    "select_backend",
    "stage",
    "triton_interpreted",
    "triton_unavailable",
]

log = structlog.get_logger("atom_anyio.models")


def select_backend(
    device: torch.device,
    name: str | None = None,
    head_dim: int | None = None,
    batch_invariant: bool = False,
    dtype: torch.dtype | None = None,
    native: bool = True,
    amx: bool = True,
) -> AttentionBackend:
    """The attention backend for ``device``: ``name``, else ``auto``: the first of ``auto_candidates(device)`` that runs there, each
    fallback logged, and on the CPU the prefill path by ``kernel_prefill_reason(dtype)``. An
    explicitly named backend that cannot run is a one-line error, never a silent fallback.
    ``batch_invariant``: the CPU kernel's invariant form, on the CPU only. ``native``, ``amx``: the
    CPU kernel's variants (``CpuPagedAttention``)."""
    name = name or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    device = torch.device(device)
    switches = {"native": native, "amx": amx}
    if batch_invariant:
        backend = invariant_backend(device, name, **switches)
    elif name == "auto":
        backend = first_that_runs(auto_candidates(device), device, head_dim, **switches)
    else:
        backend = load_backend(name, device, head_dim, **switches)
    why = None
    if name == "auto" and isinstance(backend, CpuPagedAttention) and not batch_invariant:
        if why := kernel_prefill_reason(dtype):
            backend = CpuPagedAttention(paged_prefill=True, **switches)
        elif why := amx_prefill_reason(dtype):
            backend = CpuPagedAttention(amx_prefill=True, **switches)
        else:
            why = "torch's flash SDPA (oneDNN GEMMs) is faster than the kernel's prefill on this CPU and dtype"
    log.info(
        "attention.backend",
        backend=backend.name,
        requested=name,
        device=str(device),
        batch_invariant=batch_invariant,
        **({"prefill": prefill_path(backend), "why": why} if why else {}),
    )
    return backend


def kernel_prefill_reason(dtype: torch.dtype | None) -> str | None:
    """Why ``auto`` runs prefill chunks through the paged kernel (``cpu_paged``) on this CPU, or
    None to keep torch's flash SDPA. Measured (docs/performance.md): on an AVX512-BF16 CPU without
    AMX (AMD Zen 4/5) the kernel's bfloat16 dot products prefill a 555-token SmolLM2 chunk in 2.3 ms
    against SDPA's 5.2 (oneDNN has no fast bfloat16 GEMM there); with AMX, SDPA's tiles are 4-5x
    faster than the kernel. In float32 on a CPU with AVX512 the two are within 15% of each other,
    and SDPA stays; on an AVX2-only CPU (AMD Zen 3) the kernel's AVX2 code takes 0.55-1.0x SDPA's
    time (a fresh 555-token SmolLM2 chunk 3.4 ms a layer against 5.4, 512 over a 4k prefix 48.5
    against 64.7) and a 555-token prompt's whole prefill 0.85-0.90x."""
    if dtype == torch.float32 and kernels.avx2_only():
        return "float32 on an AVX2-only CPU: the kernel's prefill takes 0.55-1.0x torch's SDPA time here"
    if dtype != torch.bfloat16 or "amx_bf16" in kernels.cpu_flags().split():
        return None
    if "paged_attention_avx512_bf16" not in kernels.native_kernels():
        return None
    return "bfloat16 on AVX512-BF16 without AMX: the kernel's prefill is about 2x torch's SDPA here"


def prefill_path(backend: CpuPagedAttention) -> str:
    if backend.paged_prefill:
        return "kernel"
    return "kernel on AMX, else sdpa" if backend.amx_prefill else "sdpa"


def amx_prefill_reason(dtype: torch.dtype | None) -> str | None:
    """Why ``auto`` runs bfloat16 prefill chunks through the kernel on a CPU with AMX (while
    ``cpu_amx`` keeps it on the tiles), or None. Measured on a 2-core Xeon with AMX
    (docs/performance.md): a 512-token chunk over 57k cached tokens of the tiny model 83 ms a layer
    against SDPA's 101 (gathering the prefix, a mask), over 4k of SmolLM2's 8.6 against 9.2; fresh
    555-token prompts alike (1.08 against 1.13 ms); a fresh 2,048 is 1.4x SDPA's."""
    if dtype != torch.bfloat16 or not kernels.has_amx_attention():
        return None
    return "bfloat16 on AMX: the kernel's tiles prefill a chunk over a cached prefix faster than gather + SDPA"


def invariant_backend(device: torch.device, name: str, native: bool = True, amx: bool = True) -> CpuPagedAttention:
    """The batch-invariant backend: the CPU kernel for every row, fixed key partitions, tiled linears."""
    if device.type != "cpu":
        raise ValueError(f"batch_invariant runs on the CPU (the project's own kernels), not on {device}")
    if name not in ("auto", "cpu", "cpu_paged"):
        raise ValueError(f"batch_invariant runs on the cpu attention backend, not {name!r}")
    if (error := kernels.load_cpu_kernels()) is not None:
        raise RuntimeError(f"batch_invariant needs the CPU kernels, which are unavailable: {error}")
    return CpuPagedAttention(batch_invariant=True, native=native, amx=amx)


def first_that_runs(
    candidates: tuple[str, ...], device: torch.device, head_dim: int | None, native: bool = True, amx: bool = True
) -> AttentionBackend:
    """The first candidate that loads on ``device``, each one that does not logged; the last must load."""
    *fallible, last = candidates
    for candidate in fallible:
        try:
            return load_backend(candidate, device, head_dim, native, amx)
        except (ValueError, RuntimeError) as exc:
            log.warning("attention.fallback", backend=candidate, reason=str(exc))
    return load_backend(last, device, head_dim, native, amx)


def auto_candidates(device: torch.device) -> tuple[str, ...]:
    """``auto``'s order, fastest first: the vendor library (aiter on ROCm, FlashInfer on CUDA), Triton, torch."""
    if device.type == "cpu":
        return ("cpu", "torch")
    if device.type != "cuda":
        return ("torch",)
    return ("aiter" if torch.version.hip else "flashinfer", "triton", "torch")


def load_backend(
    name: str, device: torch.device, head_dim: int | None = None, native: bool = True, amx: bool = True
) -> AttentionBackend:
    """Backend ``name`` on ``device``; ValueError if it cannot run there, RuntimeError if it is not installed.
    ``native``, ``amx``: the CPU kernel's variants (the other backends have none)."""
    if name == "torch":
        return TorchPagedAttention()
    if name in ("cpu", "cpu_paged"):
        if device.type != "cpu":
            raise ValueError(f"attention_backend {name!r} runs on the CPU, not on {device}")
        if (error := kernels.load_cpu_kernels()) is not None:
            raise RuntimeError(f"attention_backend {name!r} is unavailable: {error}")
        return CpuPagedAttention(paged_prefill=name == "cpu_paged", native=native, amx=amx)
    if name == "triton":
        if (error := triton_unavailable(device, head_dim)) is not None:
            raise ValueError(f"attention_backend 'triton' cannot run: {error}")
        from atom_anyio.models.attention.triton import TritonPagedAttention

        return TritonPagedAttention()
    from atom_anyio.models.attention import vendor

    return vendor.load(name, device, head_dim)


def triton_unavailable(device: torch.device, head_dim: int | None) -> str | None:
    """Why the Triton kernel cannot run on ``device`` (or for ``head_dim``), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if head_dim is not None and not 1 <= head_dim <= 256:
        return f"head_dim {head_dim} is outside 1..256"
    if device.type == "cpu":
        return None if triton_interpreted() else "on the CPU it runs only under TRITON_INTERPRET=1"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"it needs a CUDA or ROCm GPU, and {device} is not one"
    return None
