"""A model split over ranks (tensor parallelism): which part of each weight a rank holds,
and the collectives its forward adds.

    q, k, v, gate, up   column-parallel: a rank holds rows (its heads, its slice of the MLP)
    o, down             row-parallel: the matching input columns; partial sums, then all_reduce
    embedding, LM head  vocab-parallel: a rank holds a range of token rows; the embedding's
                        lookups are all_reduced, the head's logits all_gathered (rank 0 samples)

KV heads are split in contiguous groups with their query heads (unevenly when the ranks do not
divide them: SmolLM2's 3 KV heads over 2 ranks are 2 + 1). With fewer KV heads than ranks,
each KV head is replicated on ``size / num_kv_heads`` ranks, which split its query heads. GGUF
weights kept quantized are cut along whole blocks: rows are independent, and the row-parallel
inputs split at multiples of the block (32 weights; 256 for a K-quant) or are refused.
A rank builds its shard with ``config`` (the shard's head counts, MLP width and vocabulary)
from ``shard_state`` of the whole model's Hugging Face weights.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from atom_anyio.models.quant import BLOCK_SIZE, BLOCKS, QuantizedWeight


class ModelShape(Protocol):
    """What the split reads of a model's config: models/decoder.py's ``ModelConfig``, a frozen
    dataclass (named structurally here, so the model and its split import one way only)."""

    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    moe: Any


Shape = TypeVar("Shape", bound=ModelShape)

_LAYER_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)|model\.layers\.\d+\.self_attn\.sinks"
)


def split(n: int, parts: int, i: int) -> range:
    """Part ``i`` of ``range(n)`` cut in ``parts`` contiguous pieces, the first ``n % parts`` one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


@dataclass(frozen=True)
class TensorParallel(Generic[Shape]):
    """Rank ``rank`` of ``size`` holding its part of ``model`` (rank 0 of 1: the whole model)."""

    model: Shape  # the whole model's config
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size == 1:
            return
        cfg, name = self.model, f"tensor_parallel_size={self.size}"
        if cfg.moe is not None:
            raise ValueError(f"{name}: mixture-of-experts models are not split across ranks yet; serve with 1")
        kv, ranks_per_kv = cfg.num_key_value_heads, self.size // cfg.num_key_value_heads
        if kv < self.size and (self.size % kv or cfg.num_attention_heads // kv < ranks_per_kv):
            raise ValueError(
                f"{name} cannot split the model's {kv} KV heads and {cfg.num_attention_heads} query heads "
                f"(with fewer KV heads than ranks, the ranks must be a multiple of them)"
            )

    @cached_property
    def kv_heads(self) -> range:
        kv = self.model.num_key_value_heads
        if kv >= self.size:
            return split(kv, self.size, self.rank)
        head = self.rank // (self.size // kv)  # replicated: this rank shares its KV head
        return range(head, head + 1)

    @cached_property
    def q_heads(self) -> range:
        group = self.model.num_attention_heads // self.model.num_key_value_heads
        if self.model.num_key_value_heads >= self.size:
            return range(self.kv_heads.start * group, self.kv_heads.stop * group)
        ranks_per_kv = self.size // self.model.num_key_value_heads
        part = split(group, ranks_per_kv, self.rank % ranks_per_kv)
        first = self.kv_heads.start * group
        return range(first + part.start, first + part.stop)

    @cached_property
    def mlp(self) -> range:
        """This rank's columns of the MLP, in 32-wide units where the width allows (quant blocks stay whole)."""
        width = self.model.intermediate_size
        unit = BLOCK_SIZE if width % BLOCK_SIZE == 0 else 1
        part = split(width // unit, self.size, self.rank)
        return range(part.start * unit, part.stop * unit)

    @cached_property
    def vocab(self) -> range:
        return split(self.model.vocab_size, self.size, self.rank)

    @cached_property
    def config(self) -> Shape:
        """The shard's shape: the model this rank builds."""
        if self.size == 1:
            return self.model
        return dataclasses.replace(
            self.model,
            num_attention_heads=len(self.q_heads),
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.mlp),
            vocab_size=len(self.vocab),
        )

    # weights

    def shard_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of each weight of a Hugging Face state dict (before q/k/v and gate/up are packed)."""
        if self.size == 1:
            return state
        return {name: self._shard(name, w) for name, w in state.items()}

    def _shard(self, name: str, w: torch.Tensor):
        d = self.model.head_dim
        heads = lambda r: range(r.start * d, r.stop * d)  # noqa: E731
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return _rows(w, self.vocab)
        if not (m := _LAYER_WEIGHT.fullmatch(name)):
            return w  # norms: replicated
        if m[0].endswith("sinks"):
            return w[self.q_heads.start : self.q_heads.stop]
        part, kind = m[2], m[3]
        rows = {"q_proj": heads(self.q_heads), "k_proj": heads(self.kv_heads), "v_proj": heads(self.kv_heads)}
        rows |= {"gate_proj": self.mlp, "up_proj": self.mlp}
        if part in rows:
            return _rows(w, rows[part])
        columns = {"o_proj": heads(self.q_heads), "down_proj": self.mlp}[part]
        if kind == "bias":  # a row-parallel layer's bias is added once, on rank 0
            return w if self.rank == 0 else torch.zeros_like(w)
        return _columns(w, columns, f"{name} at tensor_parallel_size={self.size}")

    # collectives (on the default process group; none at size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def embed(self, embedding: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: a rank gives its own tokens' rows and zeros for the rest; summed over ranks."""
        if self.size == 1:
            return embedding(input_ids)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        x = embedding(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)
        return self.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from each rank's slice, on every rank (slices padded to one size)."""
        if self.size == 1:
            return logits
        widest = len(split(self.model.vocab_size, self.size, 0))
        padded = torch.nn.functional.pad(logits, (0, widest - logits.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        vocab = [split(self.model.vocab_size, self.size, r) for r in range(self.size)]
        return torch.cat([p[:, : len(v)] for p, v in zip(parts, vocab, strict=True)], dim=1)


def _rows(w, rows: range):
    index = torch.arange(rows.start, rows.stop)
    return w.index_select(0, index) if isinstance(w, QuantizedWeight) else w[rows.start : rows.stop].contiguous()


def _columns(w, columns: range, what: str):
    if not isinstance(w, QuantizedWeight):
        return w[:, columns.start : columns.stop].contiguous()
    weights, size = BLOCKS[w.qtype]  # per block: 32 weights, or 256 in a K-quant's super-block
    if columns.start % weights or columns.stop % weights:
        raise ValueError(f"{what}: the split cuts a {weights}-weight quantized block; serve with dtype=float32")
    data = w.data[:, columns.start // weights * size : columns.stop // weights * size]
    return dataclasses.replace(w, data=data.contiguous(), shape=torch.Size((w.shape[0], len(columns))))
