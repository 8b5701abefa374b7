"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, GPT-OSS): a top-k
router and the experts' weights stacked per layer (``gate_up_proj [E, 2I,
H]``, gate rows then up rows, and ``down_proj [E, H, I]``).

The experts run grouped: the step's (token, choice) pairs are sorted by
expert, each active expert runs one GEMM pair over its rows (on a GPU one
``torch._grouped_mm`` per projection for all experts, with nothing read back
to the host), and the weighted rows are summed back into their tokens with
one ``index_add_``. Never a loop over tokens."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from atom_anyio.models.ops import Ops


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool = True  # the top k router weights renormalised to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every step-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, dense
    # GPT-OSS: router and experts with biases, a softmax over the top k logits,
    # the clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate)
    is_gpt_oss: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class Router(nn.Module):
    """Qwen3-MoE and Mixtral: a float32 softmax over the experts, then the top k
    (``torch.topk``, as transformers does, so tied scores pick the same
    experts), renormalised when ``norm_topk_prob``. GPT-OSS: the top k logits,
    then a softmax over them."""

    def __init__(self, moe: MoeConfig, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.is_gpt_oss else None
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, experts [T, k])``."""
        logits = F.linear(x, self.weight, self.bias)
        if self.moe.is_gpt_oss:
            top, experts = torch.topk(logits, self.moe.top_k, dim=-1)
            return torch.softmax(top, dim=-1), experts
        weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, ops: Ops):
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if moe.is_gpt_oss else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden_size)) if moe.is_gpt_oss else None
        self.moe, self.ops = moe, ops

    # one grouped GEMM per projection (torch._grouped_mm) instead of a loop over the active experts:
    # no host read of the experts' counts. None: on GPUs (where that read is a sync per layer)
    grouped: bool | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        token = order // experts.shape[1]
        rows = x.index_select(0, token)
        grouped = self.grouped if self.grouped is not None else x.device.type == "cuda"
        if grouped and hasattr(torch, "_grouped_mm"):
            out = self.grouped_experts(rows, flat[order])
        else:
            out = torch.empty_like(rows)
            start = 0
            for expert, n in enumerate(torch.bincount(flat, minlength=self.moe.num_experts).tolist()):
                if n:
                    out[start : start + n] = self.expert(expert, rows[start : start + n])
                    start += n
        out *= weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def grouped_experts(self, rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        """Every expert's rows (sorted by expert) through its projections, one grouped GEMM each; the
        group ends are found on the device (``searchsorted``), so nothing is read back."""
        bounds = torch.arange(1, self.moe.num_experts + 1, device=rows.device, dtype=expert_of_row.dtype)
        offs = torch.searchsorted(expert_of_row, bounds).to(torch.int32)
        h = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offs)
        if not self.moe.is_gpt_oss:
            return torch._grouped_mm(self.ops.silu_and_mul(h), self.down_proj.transpose(1, 2), offs=offs)
        gate, up = (h + self.gate_up_proj_bias[expert_of_row]).chunk(2, dim=-1)
        h = _gpt_oss_swiglu(gate, up, self.moe)
        return torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs) + self.down_proj_bias[expert_of_row]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if not self.moe.is_gpt_oss:
            return F.linear(self.ops.silu_and_mul(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])
        gate, up = F.linear(x, self.gate_up_proj[e], self.gate_up_proj_bias[e]).chunk(2, dim=-1)
        return F.linear(_gpt_oss_swiglu(gate, up, self.moe), self.down_proj[e], self.down_proj_bias[e])


def _gpt_oss_swiglu(gate: torch.Tensor, up: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU: ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    limit = moe.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * moe.swiglu_alpha)


class SparseMoeBlock(nn.Module):
    """Named like Hugging Face's block: ``mlp.gate`` (the router; GPT-OSS's
    ``mlp.router`` is renamed at load) and ``mlp.experts``."""

    def __init__(self, moe: MoeConfig, hidden_size: int, ops: Ops):
        super().__init__()
        self.gate = Router(moe, hidden_size)
        self.experts = Experts(moe, hidden_size, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.experts(x, weights, experts)


# Hugging Face checkpoint names of one expert's projections: Qwen3-MoE's, then Mixtral's
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT = re.compile(r"(.*)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_ROUTER = re.compile(r"(.*)\.(block_sparse_moe\.gate|mlp\.router)\.(weight|bias)")  # Mixtral's, GPT-OSS's
_GPT_OSS_EXPERTS = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def stack_experts(state: dict[str, torch.Tensor], moe: MoeConfig | None) -> dict[str, torch.Tensor]:
    """The checkpoint's expert weights in this module's layout: per-expert
    weights (``mlp.experts.3.gate_proj``, Mixtral's
    ``block_sparse_moe.experts.3.w1``) stacked per layer; GPT-OSS's stacked
    ``[E, H, 2I]`` with gate and up interleaved, transposed and split; routers
    renamed ``mlp.gate``."""
    if moe is None:
        return state
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, w in state.items():
        if m := _EXPERT.fullmatch(name):
            parts[m[1]][EXPERT_PARTS[m[4]]][int(m[3])] = w
        elif m := _ROUTER.fullmatch(name):
            out[f"{m[1]}.mlp.gate.{m[3]}"] = w
        elif moe.is_gpt_oss and (m := _GPT_OSS_EXPERTS.fullmatch(name)):
            out[name] = gpt_oss_expert_weight(w, is_gate_up=m[2] == "gate_up_proj", is_bias=bool(m[3]))
        else:
            out[name] = w
    for layer, by_part in parts.items():
        out.update(stack_layer(layer, by_part))
    return out


def stack_layer(layer: str, by_part: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    num = 1 + max(max(p) for p in by_part.values())
    missing = [
        f"{layer}.mlp.experts.{e}.{p}" for p in ("gate", "up", "down") for e in range(num) if e not in by_part[p]
    ]
    if missing:
        raise ValueError(f"expert weights missing: {missing}")
    gate, up, down = (by_part[p] for p in ("gate", "up", "down"))
    return {
        f"{layer}.mlp.experts.gate_up_proj": torch.stack([torch.cat([gate[e], up[e]]) for e in range(num)]),
        f"{layer}.mlp.experts.down_proj": torch.stack([down[e] for e in range(num)]),
    }


def gpt_oss_expert_weight(w: torch.Tensor, *, is_gate_up: bool, is_bias: bool) -> torch.Tensor:
    """GPT-OSS computes ``x @ W`` with gate and up interleaved in W's last dimension."""
    if not is_bias:
        w = w.transpose(1, 2)  # [E, out, in], as F.linear takes it
    if is_gate_up:
        w = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    return w.contiguous()
