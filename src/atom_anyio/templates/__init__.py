"""Chat templates shipped with the package (test templates for the tiny models)."""

from __future__ import annotations

from importlib.resources import files


def template_path(name: str) -> str:
    """The file path of the shipped template ``name`` (e.g. ``"qwen3_tools"``; ``.jinja`` optional)."""
    filename = name if name.endswith(".jinja") else f"{name}.jinja"
    path = files(__name__) / filename
    if not path.is_file():
        raise FileNotFoundError(f"no shipped chat template {filename!r}")
    return str(path)
