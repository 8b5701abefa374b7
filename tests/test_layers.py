"""The package's layers point one way: api -> prompt -> engine -> models -> kernels.

Read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of a module, wherever it stands (``if TYPE_CHECKING:``
blocks and imports inside functions included), relative ones resolved. A
module's layer is its first subpackage; the top-level modules and the other
subpackages (obs, parse, templates, config, settings, cli, llm, ...) are
outside the check.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "atom_anyio"
LAYERS = {"api": 0, "prompt": 1, "engine": 2, "models": 3, "kernels": 4}  # lower: higher up


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
