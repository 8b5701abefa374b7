"""One Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k
RMSNorm), SmolLM2 (tied embeddings). Parameter names match Hugging Face so
weights load by name, except the packed projections: q/k/v are one
``qkv_proj`` and gate/up one ``gate_up_proj`` (one GEMM each instead of three
and two); ``pack_weights`` builds them from the Hugging Face names."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from atom_anyio.engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from atom_anyio.models.ops import Ops


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4 or 5 keys)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = cfg.get("model_type", "llama")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    """``norm(x)``, or ``norm(x, residual)``: ``residual + x`` normalised, and
    the sum as the next residual (one fused op on the CPU kernels)."""

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        kv_size = self.num_kv_heads * self.head_dim
        self.split = [self.num_heads * self.head_dim, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend.ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend.ops)
        self.backend = backend

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        t = x.shape[0]
        ops = self.backend.ops
        q, k, v = ops.linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, cos, sin)
        o = self.backend.forward(q, k, v, kv[0], kv[1], meta)
        return ops.linear(o.reshape(t, -1), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x):
        ops = self.ops
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up_proj)), self.down_proj)


# module -> its packed parameter and the Hugging Face parts concatenated into it (output dimension)
PACKED = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}
_PART = re.compile(r"(.*)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)")


def pack_weights(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Concatenate q/k/v and gate/up of a Hugging Face state dict into the
    packed parameters; also return the parts missing beside present ones."""
    packed, missing = dict(state), []
    groups = {(m[1], m[2], m[4]) for name in state if (m := _PART.fullmatch(name))}
    for layer, module, kind in sorted(groups):
        target, parts = PACKED[module]
        names = [f"{layer}.{module}.{part}.{kind}" for part in parts]
        if all(n in state for n in names):
            packed[f"{layer}.{module}.{target}.{kind}"] = torch.cat([packed.pop(n) for n in names])
        else:
            missing += [n for n in names if n not in state]
    return packed, missing


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        self.mlp = MLP(cfg, backend.ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)

    def forward(self, x, residual, cos, sin, kv, meta):
        """``x`` is the previous layer's output and ``residual`` the stream
        before it (None at the first layer): the residual add is fused into
        the norm that follows it."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)


class LlamaForCausalLM(nn.Module):
    """``forward`` takes a step's flattened tokens and returns hidden states;
    ``compute_logits`` runs the head only on the rows that are sampled."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__()
        self.config = cfg
        self.attention_backend = backend or TorchPagedAttention()
        self.model = LlamaModel(cfg, self.attention_backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.model.norm(x, residual)[0]

    @property
    def dtype_name(self) -> str:
        """``float32``, ``bfloat16``: the dtype the weights were loaded in."""
        return str(self.lm_head.weight.dtype).removeprefix("torch.")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the sampled rows, float32."""
        return self.attention_backend.ops.lm_head(hidden, self.lm_head).float()
