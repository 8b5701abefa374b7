"""The C++ CPU kernels in ``csrc/``, built with torch's cpp_extension at first
use and cached (torch's extension directory, ``TORCH_EXTENSIONS_DIR``).

They register ``torch.ops.atom.*``. The build targets the CPU it runs on
(``-march=native``), so the cache entry is named after the source, the torch
version and the CPU's instruction-set flags. Without a compiler the build
fails once, the reason is returned and the portable torch path is used.

``ATOM_KERNEL_ISA`` (``native`` by default) builds and picks them as on a CPU
with less than this one: ``avx2`` as on an AVX2-only CPU (a Zen 3),
``avx512`` as on one with AVX512 but neither BF16 nor AMX (an Ice Lake or
Skylake Xeon, or a VM that hides them), ``avx512_bf16`` as on one with
AVX512-BF16 and no AMX (a Zen 4 or 5). The
flags past it are hidden from everything that decides by them (``auto``'s
dtype, the kernel variants, the attention's prefill path), so the suite runs
what that CPU kind runs; torch's own kernels follow ``ONEDNN_MAX_CPU_ISA``
and ``ATEN_CPU_CAPABILITY``, which ``nox -s tests`` sets from it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import mmap
import os
import platform
import shutil
import time
from pathlib import Path

import structlog
import torch

from atom_anyio.settings import ConfigError

log = structlog.get_logger("atom_anyio.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "registry.cpp",
        "paged_attention.cpp",
        "ops.cpp",
        "quant.cpp",
        "decoder.cpp",
        "gemm.cpp",
        "qtile_f32.cpp",
    )
]
HEADERS = [
    CSRC / name
    for name in (
        "vec.h",
        "gemm_f32.h",
        "kernels.h",
        "amx.h",
        "attention_loop.h",
        "attention_portable.h",
        "attention_avx2.h",
        "attention_avx512_bf16.h",
        "attention_amx.h",
        "qtile_f32_avx2.h",
    )
]
# no FMA contraction of separate products: the elementwise kernels round as torch's ops do
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]

# ATOM_KERNEL_ISA: (the build's -march, the flags it hides, the flags the CPU must have for it)
KERNEL_ISAS = {
    "native": ("native", (), ()),
    "avx2": ("x86-64-v3", ("avx512", "amx"), ("avx2", "fma")),
    "avx512": ("skylake-avx512", ("avx512_bf16", "amx", "avx512_fp16"), ("avx512f", "avx512bw", "avx512vl")),
    "avx512_bf16": ("cooperlake", ("amx", "avx512_fp16"), ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")),
}


@functools.cache
def host_flags() -> str:
    """The CPU's instruction-set flags (``/proc/cpuinfo``), or its name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def kernel_isa() -> str:
    """``ATOM_KERNEL_ISA`` (module docstring): ``native``, or the CPU kind the kernels are built
    and picked for; a name it does not know, or a kind above this CPU, is a ``ConfigError``."""
    isa = os.environ.get("ATOM_KERNEL_ISA") or "native"
    if isa not in KERNEL_ISAS:
        raise ConfigError(f"ATOM_KERNEL_ISA={isa}: one of {', '.join(KERNEL_ISAS)}")
    present = set(host_flags().split())
    if missing := [f for f in KERNEL_ISAS[isa][2] if f not in present]:
        raise ConfigError(f"ATOM_KERNEL_ISA={isa}: this CPU lacks {', '.join(missing)}")
    return isa


def cpu_flags() -> str:
    """The instruction-set flags the kernels are built and picked for: the CPU's, less those past
    ``ATOM_KERNEL_ISA``."""
    hidden = KERNEL_ISAS[kernel_isa()][1]
    if not hidden:
        return host_flags()
    return " ".join(f for f in host_flags().split() if not f.startswith(hidden))


def compiler_flags() -> list[str]:
    return [*FLAGS, f"-march={KERNEL_ISAS[kernel_isa()][0]}"]


@functools.cache
def cpu_model() -> str:
    """The CPU's model name with its family and model numbers (``/proc/cpuinfo``), or the
    platform's processor string."""
    try:
        return describe_cpu(Path("/proc/cpuinfo").read_text()) or platform.processor()
    except OSError:
        return platform.processor()


def describe_cpu(cpuinfo: str) -> str:
    """The first processor's ``model name (family F model M)``. A VM's name is often the vendor's
    line alone ("AMD EPYC" for a Zen 3, 4 or 5 alike); the numbers tell them apart (family 25
    model 1: Zen 3; 17: Zen 4)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if not key.strip():
            break  # the blank line after the first processor
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "")
    if name and "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


# the instruction-set flags that decide dtypes and kernel paths, as benchmarks and logs report them
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def isa_flags() -> list[str]:
    present = set(cpu_flags().split())
    return [f for f in ISA_FLAGS if f in present]


def native_kernels() -> list[str]:
    """The variants the build has beyond the portable code (``paged_attention_avx512_bf16`` where
    the CPU has AVX512-BF16, ``paged_attention_amx_bf16`` where it has AMX and the OS lends the
    tiles); empty without the kernels. Whether they run is the model's (``ModelPlan.native_kernels``
    and ``amx``, passed to each kernel call): nothing here is a setting of the process."""
    return list(torch.ops.atom.native_kernels()) if load_cpu_kernels() is None else []


@functools.cache
def has_tile_linears() -> bool:
    """The build has the bfloat16 tile linears (gemm.cpp): AVX512-BF16's variant (``linear_avx512_bf16``),
    which an AMX build has too."""
    return "linear_avx512_bf16" in native_kernels()


def avx2_only() -> bool:
    """An AVX2-only CPU: AVX2 and FMA, no AVX512F (a Zen 3, or any x86 under ``ATOM_KERNEL_ISA=avx2``)."""
    flags = set(cpu_flags().split())
    return "avx512f" not in flags and {"avx2", "fma"} <= flags


def cpu_vendor() -> str:
    """The first processor's ``vendor_id`` (``AuthenticAMD``, ``GenuineIntel``), or ``""``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def f32_tile_linears_reason() -> str | None:
    """Why float32 linears (GGUF blocks, float32 matrices) run on the float32 tile GEMM here
    (qtile_f32.cpp: one FMA chain per output element, batch-invariant), or None. Where the build has
    it (its AVX2 variant) and it is measured level with or faster than the float32 default (MKL's
    GEMM, the project's GEMVs): an AVX2-only CPU (AMD Zen 3, or ``ATOM_KERNEL_ISA=avx2``; over blocks
    level with MKL at prefill sizes, 1.3-1.5x the int16 GEMV at one row), and an AMD CPU with AVX512
    (a Zen 4, whose 512-bit FMAs run as two 256-bit halves, and where MKL's float GEMM is no faster
    than on AVX2: SmolLM2's linears as float32 panels 0.58x the default's time at one row and 16,
    0.75x at 64, 0.92x at 555; docs/engine.md). Not on Intel's AVX512 CPUs, where MKL's 512-bit GEMM
    has twice an AVX2 kernel's FMAs (not measured there)."""
    if "linear_f32_avx2" not in native_kernels():
        return None
    if avx2_only():
        return "float32 on an AVX2-only CPU: the linears on the float32 tile GEMM"
    if cpu_vendor() == "AuthenticAMD" and {"avx2", "fma"} <= set(cpu_flags().split()):
        return "float32 on an AMD CPU with AVX512: the linears on the float32 tile GEMM"
    return None


@functools.cache
def has_amx_linears() -> bool:
    """The build has the AMX linears (``linear_amx_bf16``, gemm.cpp) and the OS lends the tiles."""
    return "linear_amx_bf16" in native_kernels()


@functools.cache
def has_amx_attention() -> bool:
    """The build has the AMX attention variant and the OS lends this process the tiles."""
    return "paged_attention_amx_bf16" in native_kernels()


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()))


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded into this process (torch's libgomp, or an LLVM/Intel one), or None."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1]
        if any(name in Path(path).name for name in ("libgomp", "libiomp", "libomp")):
            runtime = ctypes.CDLL(path)
            return runtime if hasattr(runtime, "omp_pause_resource_all") else None
    return None


def release_openmp_threads() -> bool:
    """Let the worker threads of the calling thread's OpenMP pool go (``omp_pause_resource_all``),
    as a thread that loaded a model (or zeroed a KV pool) should before another thread runs the
    steps. libgomp keeps a region's workers spinning only while it manages no more threads than
    the process may use CPUs; the pool a loading thread leaves behind doubles that count on a
    2-core machine, and from then on every region of the engine's thread hands its work over
    through futex sleeps: SmolLM2's 120 linears at 16 rows took 25-26 ms a step against 12.5-13
    (Xeon, family 6 model 167). A later region on the calling thread makes a new pool. Returns
    whether a runtime was there to ask."""
    runtime = openmp_runtime()
    if runtime is None:
        return False
    runtime.omp_pause_resource_all(1)  # omp_pause_soft: the threads end, the runtime stays
    return True


HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """An uninitialised CPU tensor in memory of its own (an anonymous mapping, freed with the
    tensor) that Linux is asked to back with transparent huge pages (``MADV_HUGEPAGE``), from a
    2 MiB boundary; and whether it was asked. Where THP is in ``madvise`` mode (the usual default)
    nothing else gets them, and malloc may hand a large tensor memory already touched in 4 KiB
    pages. The KV pool wants them: the attention reads its blocks scattered, each block's lines
    prefetched ahead, and with 4 KiB pages nearly every block is a TLB miss (16 decodes at 32k of
    context, float32, Zen 3: the kernel alone 40-45 against 46-51 ms, three runs alternated).
    Off Linux, or under two huge pages, it is ``torch.empty``."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if platform.system() != "Linux" or nbytes < 2 * HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype), False
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
        advised = True
    except OSError:  # THP not built into this kernel
        advised = False
    offset = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    # the tensor keeps the mapping alive; it is unmapped when the last view of it goes
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape), advised


def build_name() -> str:
    """The cache entry's name: a digest of everything the build depends on (the sources, their
    place, the compiler flags, the torch it links against, the ninja that builds it and the CPU's
    flags), so two installs on one machine keep two entries instead of rebuilding each other's.
    The ninja is the one on PATH, which torch runs: a venv's (PyPI's ninja, 1.13) and the
    system's (Debian's, 1.11) each drop the other's build log, so a server started outside the
    venv and the suite inside it rebuilt one entry for 40 s at every turn (Zen 3)."""
    digest = hashlib.sha256()
    for p in SOURCES + HEADERS:
        digest.update(str(p.resolve()).encode())
        digest.update(p.read_bytes())
    ninja = shutil.which("ninja") or ""
    for part in (torch.__version__, torch.__file__, " ".join(compiler_flags()), ninja, cpu_flags()):
        digest.update(part.encode())
    return f"atom_cpu_kernels_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where torch's cpp_extension builds and caches the entry ``name`` (``TORCH_EXTENSIONS_DIR``)."""
    from torch.utils import cpp_extension  # imports setuptools: only when needed

    return Path(cpp_extension._get_build_directory(name, verbose=False))


STALE_LOCK_S = 900.0  # a build takes 30-90 s on two cores: a lock this old was left by a killed one


def clear_stale_lock(build_dir: Path) -> None:
    """torch waits without end, and silently, on a build directory's ``lock``, which a build killed
    midway (Ctrl-C or a supervisor's start timeout during the first start) leaves behind, even
    when the build is cached: remove one older than any build takes, and log a younger one's wait."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        log.warning("kernels.stale_lock_removed", path=str(lock), age_s=round(age))
    else:
        log.info("kernels.waiting_for_build", path=str(lock), age_s=round(age))


@functools.cache
def load_cpu_kernels() -> str | None:
    """Build (or load the cached build of) the CPU kernels. None when
    ``torch.ops.atom`` is ready, else why not (logged once)."""
    from torch.utils import cpp_extension  # imports setuptools: only when needed

    name = build_name()
    build_dir = build_directory(name)
    clear_stale_lock(build_dir)
    if not (build_dir / f"{name}.so").exists():
        log.info(
            "kernels.building", name=name, sources=[p.name for p in SOURCES], cpu=cpu_model(), flags=compiler_flags()
        )
    t0 = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=compiler_flags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the portable path serves
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        log.warning("kernels.unavailable", reason=reason)
        return reason
    log.info(
        "kernels.loaded",
        name=name,
        seconds=round(time.perf_counter() - t0, 2),
        isa=kernel_isa(),
        native=list(torch.ops.atom.native_kernels()),
    )
    return None
