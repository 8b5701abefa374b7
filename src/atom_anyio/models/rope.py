"""Rotary position embedding frequencies, as transformers computes them
(``modeling_rope_utils``): plain, linear, Llama 3, YaRN, and the per-frequency
factors a GGUF's ``rope_freqs`` tensor carries."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch


class RopeConfig(Protocol):
    """What the frequencies depend on (``ModelConfig`` has it; a protocol, so rope imports no model)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rope_freq_factors: Any
    max_position_embeddings: int


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` and the factor cos/sin are scaled by."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return yarn_inv_freq(cfg, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_freq(cfg: RopeConfig, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp
    between, and cos/sin scaled by the attention factor (``mscale``)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or cfg.max_position_embeddings / old_ctx
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
