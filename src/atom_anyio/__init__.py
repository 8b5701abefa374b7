"""atom_anyio: an anyio-native LLM inference server.

``atom_anyio:app`` is the ASGI app; ``LLM`` and ``SamplingParams`` are the
offline API. Importing this package loads nothing heavy.
"""

from __future__ import annotations

from typing import Any

from atom_anyio.version import __version__

__all__ = ["LLM", "SamplingParams", "app", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from atom_anyio.sampling_params import SamplingParams

        return SamplingParams
    if name == "LLM":
        from atom_anyio.llm import LLM

        return LLM
    raise AttributeError(name)


class _App:
    """``atom_anyio:app`` for ASGI servers. A real module attribute (hypercorn
    resolves ``module:app`` with ``eval`` over the module's namespace), which
    imports the server on first use, so importing the package stays cheap."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        from atom_anyio.api.app import app as atom_app

        await atom_app(scope, receive, send)


app = _App()
