"""One Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k
RMSNorm), SmolLM2 (tied embeddings), and with per-layer sliding windows,
attention sinks and mixture-of-experts layers (``moe.py``) Qwen3-MoE,
Mixtral and GPT-OSS. Parameter names match Hugging Face so
weights load by name, except the packed projections: q/k/v are one
``qkv_proj`` and gate/up one ``gate_up_proj`` (one GEMM each instead of three
and two); ``pack_weights`` builds them from the Hugging Face names."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from torch import nn

from atom_anyio.models import fused
from atom_anyio.models.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from atom_anyio.models.moe import MoeConfig, SparseMoeBlock
from atom_anyio.models.ops import Ops
from atom_anyio.models.quant import QuantizedWeight
from atom_anyio.models.rope import rope_inv_freq
from atom_anyio.models.tensor_parallel import TensorParallel

# the Hugging Face architectures this decoder serves
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types names

log = structlog.get_logger("atom_anyio.models")


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
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: each frequency divided by its factor
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None  # keys i - W < j <= i, on the SLIDING layers
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer; empty: every layer FULL
    moe: MoeConfig | None = None  # mixture of experts; None: a dense MLP in every layer
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head in each layer's softmax
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
        assert not self.layer_types or len(self.layer_types) == self.num_hidden_layers

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer``: None attends to the whole context."""
        is_sliding = self.layer_types[layer] == SLIDING if self.layer_types else False
        return self.sliding_window if is_sliding else None

    def is_moe_layer(self, layer: int) -> bool:
        moe = self.moe
        return moe is not None and layer not in moe.mlp_only_layers and (layer + 1) % moe.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4 or 5 keys)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = cfg.get("model_type", "llama")
        if quantization := cfg.get("quantization_config"):
            method = quantization.get("quant_method", "unknown")
            raise ValueError(
                f"quantized Hugging Face checkpoints ({method}) are not supported: serve a float one or a GGUF"
            )
        if (act := cfg.get("hidden_act", "silu")) != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (supported: silu)")
        eos_ids = hf_eos_ids(cfg.get("eos_token_id"))
        heads = cfg["num_attention_heads"]
        theta, rope_scaling = hf_rope(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **hf_sliding_window(cfg, model_type),
            moe=hf_moe(cfg, model_type),
            attention_sinks=model_type == "gpt_oss",
            o_proj_bias=cfg.get("attention_bias", False) and model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )


# Hugging Face config keys that a config built from elsewhere (a GGUF's metadata) takes as overrides
ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor")
FIELD_KEYS = ("max_position_embeddings", "rms_norm_eps", "sliding_window", "bos_token_id")


def hf_eos_ids(eos: Any) -> tuple[int, ...]:
    """A Hugging Face ``eos_token_id`` (one id, a list, or none) as a tuple."""
    return tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)


def merge_hf_overrides(cfg: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json`` with ``overrides`` over it; ``rope_scaling`` and transformers 5's
    ``rope_parameters`` name one thing, so an override of either replaces both (keeping the theta)."""
    merged = {**cfg, **overrides}
    rope = overrides.get("rope_parameters") or overrides.get("rope_scaling")
    if rope is not None:
        theta = merged.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        merged["rope_parameters"] = merged["rope_scaling"] = {**({"rope_theta": theta} if theta else {}), **rope}
    return merged


def with_hf_overrides(cfg: ModelConfig, overrides: Mapping[str, Any]) -> ModelConfig:
    """``cfg`` with Hugging Face config keys over it, as ``from_hf`` reads them (``eos_token_id``
    replaces the end tokens; the RoPE keys are standardised by ``hf_rope``, a YaRN's original
    context defaulting to the overridden ``max_position_embeddings``)."""
    if unknown := overrides.keys() - {*ROPE_KEYS, *FIELD_KEYS, "eos_token_id"}:
        raise ValueError(
            f"hf_overrides: {', '.join(sorted(unknown))} cannot override a GGUF's config (keys taken: "
            f"{', '.join((*ROPE_KEYS, *FIELD_KEYS, 'eos_token_id'))}, or GGUF metadata keys such as llama.context_length)"
        )
    changes: dict[str, Any] = {k: overrides[k] for k in FIELD_KEYS if k in overrides}
    if "eos_token_id" in overrides:
        changes["eos_token_ids"] = hf_eos_ids(overrides["eos_token_id"])
    if any(k in overrides for k in ROPE_KEYS):
        max_len = changes.get("max_position_embeddings", cfg.max_position_embeddings)
        base = {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "max_position_embeddings": max_len}
        changes["rope_theta"], changes["rope_scaling"] = hf_rope({**base, **overrides})
    return dataclasses.replace(cfg, **changes)


def hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``rope_theta`` and the scaling parameters (None for plain RoPE), as
    transformers standardises them (``original_max_position_embeddings``
    defaults to ``max_position_embeddings``)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0))
    rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
    partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        original = cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048)
        rope["original_max_position_embeddings"] = rope.get("original_max_position_embeddings") or original
    return theta, {**rope, "rope_type": rope_type}


def hf_moe(cfg: dict[str, Any], model_type: str) -> MoeConfig | None:
    """The experts' settings: Mixtral renormalises its top k and routes every
    layer; Qwen3-MoE reads ``norm_topk_prob``, ``decoder_sparse_step`` and
    ``mlp_only_layers``; GPT-OSS has its own router and activation."""
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")  # transformers 5 saves the former
    if model_type not in ("mixtral", "qwen3_moe", "gpt_oss"):
        return None
    size = cfg["moe_intermediate_size"] if model_type == "qwen3_moe" else cfg["intermediate_size"]
    moe = MoeConfig(num_experts=num_experts, top_k=cfg["num_experts_per_tok"], intermediate_size=size)
    if model_type == "qwen3_moe":
        return dataclasses.replace(
            moe,
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    if model_type == "gpt_oss":
        return dataclasses.replace(
            moe, is_gpt_oss=True, swiglu_alpha=cfg.get("swiglu_alpha", 1.702), swiglu_limit=cfg.get("swiglu_limit", 7.0)
        )
    return moe


def hf_sliding_window(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` with transformers' rules: Mistral
    and Mixtral window every layer; the Qwen families only with
    ``use_sliding_window``, Qwen2/Qwen3 on their ``layer_types`` (by default the
    layers from ``max_window_layers`` on), Qwen3-MoE on every layer; GPT-OSS
    on its ``layer_types`` (by default every other layer, the first windowed)."""
    window = cfg.get("sliding_window")
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return {"sliding_window": None, "layer_types": ()}
    n = cfg["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
    elif model_type == "gpt_oss":
        types = cfg.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    else:
        types = [SLIDING] * n
    return {"sliding_window": int(window), "layer_types": tuple(types)}


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
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int):
        super().__init__()
        self.sliding_window = cfg.window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        kv_size = self.num_kv_heads * self.head_dim
        self.split = [self.num_heads * self.head_dim, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
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
        o = self.backend.forward(q, k, v, kv[0], kv[1], meta, sliding_window=self.sliding_window, sinks=self.sinks)
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
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp  # o_proj and down_proj are row-parallel: their partial sums are reduced here
        self.self_attn = Attention(cfg, backend, layer)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, backend.ops)
        else:
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
        x = self.tp.all_reduce(self.self_attn(x, cos, sin, kv, meta))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.tp.all_reduce(self.mlp(x)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, tp: TensorParallel):
        super().__init__()
        # given a weight, the embedding skips its random init: on the meta device that init imports
        # torch._dynamo (0.7 s of every start); the loader assigns the real one
        empty = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)


class LlamaForCausalLM(nn.Module):
    """``forward`` takes a step's flattened tokens and returns hidden states;
    ``compute_logits`` runs the head only on the rows that are sampled. With ``tp``
    it is one rank's shard, shaped by ``tp.config`` (models/tensor_parallel.py)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, tp: TensorParallel | None = None):
        super().__init__()
        assert tp is None or tp.model == cfg, "tp splits another model"
        self.tp = tp or TensorParallel(cfg)
        self.config = cfg = self.tp.config  # this rank's shard (the whole model at size 1)
        self.attention_backend = backend or TorchPagedAttention()
        self.model = LlamaModel(cfg, self.attention_backend, self.tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):  # not on the meta device the loader builds under: any op there imports torch._dynamo
            inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.use_fused = True  # steps through the fused decoder (models/fused.py), where it applies
        self._fused: tuple[torch.ScriptObject | None, str | None] | None = None  # built at load, else at the first step

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale
        # the fused decoder has the paged kernel only: steps whose prefill runs elsewhere go op by op
        if (decoder := self.fused_decoder()) is not None and self.attention_backend.runs_in_kernel(meta):
            return decoder.forward(
                input_ids,
                cos,
                sin,
                [k for k, _ in kv_caches],
                [v for _, v in kv_caches],
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.block_size,
                self.attention_backend.partition(meta),
            )
        x = self.tp.embed(self.model.embed_tokens, input_ids)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.model.norm(x, residual)[0]

    def build_fused(self) -> str | None:
        """Build the fused CPU decoder (models/fused.py) over the weights as they lie (the loader
        does, once); why the model does not fit it, or None."""
        self._fused = fused.build(self)
        return self._fused[1]

    def fused_decoder(self) -> torch.ScriptObject | None:
        """The fused CPU decoder when ``use_fused`` and the model fits it, else None."""
        if not self.use_fused:
            return None
        if self._fused is None:  # a model built in memory, or its layers packed again since (tests)
            why = self.build_fused()
            log.info("model.fused_decoder", enabled=why is None, reason=why)
        return self._fused[0]

    @property
    def dtype_name(self) -> str:
        """``float32``, ``bfloat16``: the dtype the weights were loaded in; with GGUF blocks kept
        quantized, their types too (``float32+Q4_1+Q8_0``: activations, then the weights' types)."""
        weights = (getattr(m, "weight", None) for m in self.modules())
        qtypes = sorted({w.qtype.name for w in weights if isinstance(w, QuantizedWeight)})
        return "+".join([str(self.lm_head.weight.dtype).removeprefix("torch."), *qtypes])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the sampled rows, float32."""
        return self.tp.gather_logits(self.attention_backend.ops.lm_head(hidden, self.lm_head)).float()
