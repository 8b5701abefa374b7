"""The package's layers point one way: api -> prompt -> engine -> models -> kernels, and every
unit of the package (a subpackage or a top-level module) imports only the units its row of
``ALLOWED`` names, with no cycle among them.

Read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of a module, wherever it stands (``if TYPE_CHECKING:``
blocks and imports inside functions included), relative ones resolved. A
module's unit is its first component under ``atom_anyio`` (``atom_anyio`` itself
for the package's ``__init__``, the facade).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "atom_anyio"
LAYERS = {"api": 0, "prompt": 1, "engine": 2, "models": 3, "kernels": 4}  # lower: higher up
# unit -> the units it may import
ALLOWED: dict[str, set[str]] = {
    "atom_anyio": {"api", "llm", "sampling_params", "version"},  # the facade: app, LLM, SamplingParams, __version__
    "cli": {"atom_anyio", "api", "config", "obs", "settings"},
    "api": {
        "prompt",
        "engine",
        "models",
        "parse",
        "obs",
        "config",
        "settings",
        "sampling_params",
        "generation_defaults",
        "version",
    },
    "llm": {"config", "engine", "models", "obs", "prompt", "sampling_params"},
    "config": {"prompt", "engine", "generation_defaults", "kernels", "models", "parse", "settings"},
    "prompt": {"engine", "parse", "sampling_params"},
    "obs": {"engine"},  # metrics read the engine's stats record (engine.stats)
    "engine": {"models", "kernels", "sampling_params", "settings"},
    "models": {"kernels", "generation_defaults"},
    "kernels": {"settings"},
    "parse": set(),
    "settings": set(),
    "sampling_params": set(),
    "generation_defaults": {"sampling_params"},  # the model's sampling defaults sit with the sampling parameters
    "templates": set(),
    "version": set(),
}


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(module: str, path: Path, known: dict[str, Path], source: str | None = None) -> set[str]:
    """The package modules that ``module`` (its file ``path``, or ``source`` when given)
    imports; ``from X import name`` counts as ``X.name`` when that is a module, else as ``X``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            for alias in node.names:
                child = f"{origin}.{alias.name}"
                targets.add(child if child in known else origin)
    return {t for t in targets if t.split(".")[0] == "atom_anyio"}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_edges(known: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in known.items():
        for target in imported_modules(module, path, known):
            if unit(module) != unit(target):
                edges.setdefault((unit(module), unit(target)), []).append(f"{module} -> {target}")
    return edges


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_the_layer_check_sees_the_package_and_resolves_its_imports():
    known = package_modules()
    assert {"atom_anyio.api.app", "atom_anyio.models.attention", "atom_anyio.kernels"} <= known.keys()
    # ``from atom_anyio import kernels`` is the module, not the package
    assert "atom_anyio.kernels" in imported_modules("atom_anyio.models.fused", known["atom_anyio.models.fused"], known)
    # relative imports resolve against the module's package (a module that does not exist: source given)
    probe = "from . import metadata\nfrom .. import ops\nfrom ..quant import BLOCKS\n"
    path = SRC / "models" / "attention" / "probe.py"
    assert imported_modules("atom_anyio.models.attention.probe", path, known, probe) == {
        "atom_anyio.models.attention.metadata",
        "atom_anyio.models.ops",
        "atom_anyio.models.quant",
    }


def test_no_module_imports_a_layer_above_its_own():
    known = package_modules()
    offending = sorted(
        (module, target)
        for module, path in known.items()
        if layer(module) is not None
        for target in imported_modules(module, path, known)
        if layer(target) is not None and layer(target) < layer(module)
    )
    assert not offending, "imports against the layers (api -> prompt -> engine -> models -> kernels):\n" + "\n".join(
        f"  {module} -> {target}" for module, target in offending
    )


def test_every_unit_of_the_package_has_a_row_in_the_table():
    units = {unit(module) for module in package_modules()}
    assert units == ALLOWED.keys(), (
        f"units without a row: {units - ALLOWED.keys()}; rows without a unit: {ALLOWED.keys() - units}"
    )


def test_units_import_only_what_their_row_allows():
    offending = [
        line
        for (source, target), lines in sorted(unit_edges(package_modules()).items())
        if target not in ALLOWED[source]
        for line in lines
    ]
    assert not offending, "imports outside the table of allowed edges:\n" + "\n".join(f"  {line}" for line in offending)


def test_the_units_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for source, target in unit_edges(package_modules()):
        graph.setdefault(source, set()).add(target)
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, "a cycle among the package's units: " + " -> ".join([*path[path.index(node) :], node])
        if node not in done:
            for target in sorted(graph.get(node, ())):
                visit(target, (*path, node))
            done.add(node)

    for node in sorted(graph):
        visit(node, ())


def test_the_cycle_check_finds_a_cycle():
    """Guards the check above: a graph with a cycle fails it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    seen: list[str] = []

    def visit(node: str, path: tuple[str, ...]) -> None:
        if node in path:
            seen.append(" -> ".join([*path[path.index(node) :], node]))
            return
        for target in sorted(graph.get(node, ())):
            visit(target, (*path, node))

    visit("a", ())
    assert seen == ["a -> b -> c -> a"]


def test_no_module_imports_another_modules_private_name():
    known = package_modules()
    offending = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("atom_anyio")):
                offending += [
                    f"{module}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.endswith("__")
                ]
    assert not offending, "private names imported across modules:\n" + "\n".join(f"  {line}" for line in offending)
