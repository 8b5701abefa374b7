"""Paged attention: one metadata object per step, backends behind one interface.

The KV cache of a layer is two flat tensors ``[num_slots, num_kv_heads,
head_dim]`` where ``slot = block_id * block_size + offset``. A step's tokens
are flattened: decode tokens first (one per sequence), then the prefill
chunks. Every backend takes the same ``AttentionMetadata`` (block tables,
context lengths, query offsets) and writes the step's K/V into the cache
before attending over it.

* ``cpu``: a C++ kernel (``csrc/paged_attention.cpp``) that reads each
  sequence's KV through its block table where it lies: no gathered copy, no
  padding to the longest sequence. The default on CPUs.
* ``torch``: the portable path on any torch device. It gathers each
  sequence's context through its block table and runs batched
  ``scaled_dot_product_attention`` (one call for all decodes, one for all
  prefill chunks). It is the reference the exactness tests pin and the
  fallback when the kernel cannot be built.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from atom_anyio.engine import kernels
from atom_anyio.models.ops import CpuOps, TorchOps

log = structlog.get_logger("atom_anyio.engine")

BACKENDS = ("auto", "cpu", "torch")


@dataclass
class AttentionMetadata:
    """Where a step's tokens read and write the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32, zero-padded
    seq_lens: torch.Tensor  # [B] int32: context of each sequence, the step's tokens included
    query_start_loc: torch.Tensor  # [B + 1] int32: offsets of each sequence's tokens in the step
    num_decode: int  # the first num_decode sequences are decodes, one token each
    max_query_len: int
    block_size: int

    @classmethod
    def build(
        cls,
        block_tables: Seq[Seq[int]],
        context_lens: Seq[int],
        query_lens: Seq[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for sequences ordered decodes first (query_len == 1 and
        context_len > 1), then prefill chunks. ``context_lens`` include the
        step's own tokens. Vectorised: no Python loop per token or per block."""
        ctx = np.asarray(context_lens, dtype=np.int64)
        qlen = np.asarray(query_lens, dtype=np.int64)
        is_decode = (qlen == 1) & (ctx > 1)
        num_decode = len(qlen) if is_decode.all() else int(np.argmin(is_decode))
        tables = np.zeros((len(block_tables), max(len(t) for t in block_tables)), dtype=np.int32)
        for row, table in zip(tables, block_tables, strict=True):
            row[: len(table)] = np.asarray(table, dtype=np.int32)  # an array('i') converts without a copy loop
        query_start = np.zeros(len(qlen) + 1, dtype=np.int64)
        np.cumsum(qlen, out=query_start[1:])
        seq_of_token = np.repeat(np.arange(len(qlen)), qlen)
        pos = (ctx - qlen)[seq_of_token] + np.arange(query_start[-1]) - query_start[seq_of_token]
        slot_mapping = tables[seq_of_token, pos // block_size].astype(np.int64) * block_size + pos % block_size

        def to(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(x).to(device=device, dtype=dtype, non_blocking=True)

        return cls(
            slot_mapping=to(slot_mapping, torch.long),
            block_tables=to(tables, torch.int32),
            seq_lens=to(ctx, torch.int32),
            query_start_loc=to(query_start, torch.int32),
            num_decode=num_decode,
            max_query_len=int(qlen.max()),
            block_size=block_size,
        )

    @cached_property
    def gather_plan(self) -> GatherPlan:
        """The portable path's padded gather indices and masks (built once per step)."""
        return GatherPlan.build(self)


@dataclass
class GatherPlan:
    """Slots of each sequence's context padded to the longest, and the masks over the padding."""

    decode_kv_index: torch.Tensor | None  # [Bd, Ld] slots of each decode's context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] True where a key is visible
    prefill_fresh: bool  # one prefill chunk starting at position 0: plain causal
    prefill_pad_index: torch.Tensor | None  # [Tp] row of each prefill token in [Bp*Lq]
    prefill_kv_index: torch.Tensor | None  # [Bp, Lk] slots of each chunk's context
    prefill_mask: torch.Tensor | None  # [Bp, 1, Lq, Lk]
    num_prefill_seqs: int

    @classmethod
    def build(cls, meta: AttentionMetadata) -> GatherPlan:
        bs, nd = meta.block_size, meta.num_decode
        tables = meta.block_tables.long()
        ctx = meta.seq_lens.long()
        qlen = meta.query_start_loc[1:].long() - meta.query_start_loc[:-1].long()
        start = ctx - qlen

        def kv_index(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
            j = torch.arange(int(ctx[rows].max()), device=ctx.device)
            t = tables[rows]
            return t[:, (j // bs).clamp(max=t.shape[1] - 1)] * bs + j % bs, j

        decode_kv_index = decode_mask = None
        if nd:
            decode_kv_index, j = kv_index(slice(0, nd))
            decode_mask = (j[None, :] < ctx[:nd, None])[:, None, None, :]
        num_prefill = len(qlen) - nd
        prefill_fresh = num_prefill == 1 and int(start[nd]) == 0
        pad_index = prefill_kv_index = prefill_mask = None
        if num_prefill and not prefill_fresh:
            rows, max_q = slice(nd, None), meta.max_query_len
            pq = qlen[rows]
            seq = torch.repeat_interleave(torch.arange(num_prefill, device=pq.device), pq)
            offset = torch.arange(int(pq.sum()), device=pq.device) - (torch.cumsum(pq, 0) - pq)[seq]
            pad_index = seq * max_q + offset
            prefill_kv_index, j = kv_index(rows)
            i = torch.arange(max_q, device=pq.device)
            qpos = start[rows, None] + i[None, :]  # [Bp, Lq]
            qpos = torch.where(i[None, :] < pq[:, None], qpos, 0)  # padded rows see key 0
            prefill_mask = (j[None, None, :] <= qpos[:, :, None])[:, None]
        return cls(decode_kv_index, decode_mask, prefill_fresh, pad_index, prefill_kv_index, prefill_mask, num_prefill)


class AttentionBackend(Protocol):
    name: str
    ops: type  # the decoder's elementwise ops that go with it (models/ops.py)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for a ``[B, L]`` slot index: ``index_select`` on the
    flattened index is several times faster than advanced indexing on CPU."""
    return torch.index_select(cache, 0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])


class TorchPagedAttention:
    """Portable paged attention on any torch device (CPU, CUDA, ROCm)."""

    name = "torch"
    ops = TorchOps

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        plan, nd = meta.gather_plan, meta.num_decode
        out = torch.empty_like(q)
        if nd:
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            kd = gather(k_cache, plan.decode_kv_index).transpose(1, 2)  # [Bd, KVH, Ld, D]
            vd = gather(v_cache, plan.decode_kv_index).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, enable_gqa=True)
            out[:nd] = od.squeeze(2)
        if plan.num_prefill_seqs == 0:
            return out
        if plan.prefill_fresh:
            qp, kp, vp = (x[nd:].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            out[nd:] = op.squeeze(0).transpose(0, 1)
            return out
        bp, lq, h, d = plan.num_prefill_seqs, meta.max_query_len, q.shape[1], q.shape[2]
        qpad = q.new_zeros(bp * lq, h, d)
        qpad[plan.prefill_pad_index] = q[nd:]
        qp = qpad.view(bp, lq, h, d).transpose(1, 2)
        kp = gather(k_cache, plan.prefill_kv_index).transpose(1, 2)
        vp = gather(v_cache, plan.prefill_kv_index).transpose(1, 2)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=plan.prefill_mask, enable_gqa=True)
        out[nd:] = op.transpose(1, 2).reshape(bp * lq, h, d)[plan.prefill_pad_index]
        return out


class CpuPagedAttention:
    """The C++ kernel: decodes and prefill chunks in one call, reading the
    paged KV in place (split over the keys when there are few sequences)."""

    name = "cpu"
    ops = CpuOps

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        torch.ops.atom.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.block_size,
            1.0 / math.sqrt(q.shape[-1]),
        )
        return out


def select_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """The attention backend for ``device``: ``name``, else ``ATOM_ATTENTION_BACKEND``,
    else ``auto`` (the C++ kernel on CPU when it builds, else the portable path).
    An explicitly named backend that cannot run is an error, never a silent fallback."""
    name = name or os.environ.get("ATOM_ATTENTION_BACKEND") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cpu"):
        return TorchPagedAttention()
    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}")
    error = kernels.load_cpu_kernels()
    if error is None:
        return CpuPagedAttention()
    if name == "cpu":
        raise RuntimeError(f"attention_backend 'cpu' is unavailable: {error}")
    log.warning("attention.fallback", backend="torch", reason=error)
    return TorchPagedAttention()
