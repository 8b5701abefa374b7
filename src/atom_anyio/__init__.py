"""atom_anyio: an anyio-native LLM inference server.

``atom_anyio:app`` is the ASGI app; ``LLM`` and ``SamplingParams`` are the
offline API. Importing this package loads nothing heavy.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "app", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SamplingParams":
        from atom_anyio.sampling_params import SamplingParams

        return SamplingParams
    if name == "LLM":
        from atom_anyio.llm import LLM

        return LLM
    if name == "app":
        from atom_anyio.api.app import app

        return app
    raise AttributeError(name)
