"""Paged attention: one metadata object per step, backends behind one interface.

The KV cache of a layer is two flat tensors ``[num_slots, num_kv_heads,
head_dim]`` where ``slot = block_id * block_size + offset``. A step's tokens
are flattened: decode tokens first (one per sequence), then the prefill
chunks. Every backend takes the same ``AttentionMetadata`` (block tables,
context lengths, query offsets) and writes the step's K/V into the cache
before attending over it.

* ``cpu``: decodes through a C++ kernel (``csrc/paged_attention.cpp``) that
  reads each sequence's KV through its block table where it lies: no gathered
  copy, no padding to the longest sequence; prefill chunks through torch's
  flash attention for the CPU, one call per chunk (its blocked GEMMs run
  several times faster than the kernel's per-query loop on long chunks:
  docs/performance.md). The default on CPUs. ``cpu_paged`` runs prefill
  chunks through the kernel too (the fused decoder's path in every step).
* ``torch``: the portable path on any torch device. It gathers each
  sequence's context through its block table and runs batched
  ``scaled_dot_product_attention`` (one call for all decodes, one for all
  prefill chunks). It is the reference the exactness tests pin and the
  fallback when the kernel cannot be built.
* ``triton`` (``triton_attention.py``): one Triton kernel for decodes and
  prefill chunks on NVIDIA and AMD GPUs (and on the CPU under
  ``TRITON_INTERPRET=1``, for tests).
* ``flashinfer``, ``aiter`` (``vendor_attention.py``): thin adapters over the
  vendor libraries, used when they are importable.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from atom_anyio.engine import kernels
from atom_anyio.models.ops import CpuOps, TorchOps

log = structlog.get_logger("atom_anyio.engine")

BACKENDS = ("auto", "cpu", "cpu_paged", "torch", "triton", "flashinfer", "aiter")


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
    plans: dict[int | None, GatherPlan] = field(default_factory=dict, repr=False)  # by sliding window
    chunks: list[PrefillChunk] | None = field(default=None, repr=False)  # built at the first use
    # seq_lens, block_tables, query_start_loc as built on the host, for planners that read them
    # there (FlashInfer's plan): copying them back from a GPU would be a host sync per step
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

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

        host_tables = torch.from_numpy(tables)
        host_seq_lens = torch.from_numpy(ctx).to(torch.int32)
        host_query_start = torch.from_numpy(query_start).to(torch.int32)
        return cls(
            slot_mapping=stage(torch.from_numpy(slot_mapping), device),
            block_tables=stage(host_tables, device),
            seq_lens=stage(host_seq_lens, device),
            query_start_loc=stage(host_query_start, device),
            num_decode=num_decode,
            max_query_len=int(qlen.max()),
            block_size=block_size,
            host=(host_seq_lens, host_tables, host_query_start),
        )

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The step's new keys and values into their slots of the paged cache (every backend's first step)."""
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def prefill_chunks(self) -> list[PrefillChunk]:
        """Each prefill chunk's rows, first position and (over a cached prefix) context slots."""
        if self.chunks is None:
            seq_lens, tables, query_start = self.host or (self.seq_lens, self.block_tables, self.query_start_loc)
            self.chunks = [
                PrefillChunk.build(int(query_start[i]), int(query_start[i + 1]), int(seq_lens[i]), tables[i], self)
                for i in range(self.num_decode, len(seq_lens))
            ]
        return self.chunks

    def gather_plan(self, sliding_window: int | None = None) -> GatherPlan:
        """The portable path's padded gather indices and masks (built once per step and window)."""
        if sliding_window not in self.plans:
            self.plans[sliding_window] = GatherPlan.build(self, sliding_window)
        return self.plans[sliding_window]


def stage(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``x`` on ``device``: on a GPU through pinned memory and a
    non-blocking copy (ordered on the current stream), on the CPU ``x`` itself."""
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)


@dataclass
class PrefillChunk:
    """One sequence's prefill rows ``[begin, end)`` of the step, at positions ``start`` onwards;
    ``slots``: its whole context's KV slots when it follows a cached prefix (None: the chunk's
    own keys are the whole context)."""

    begin: int
    end: int
    start: int
    slots: torch.Tensor | None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)  # by sliding window

    @classmethod
    def build(cls, begin: int, end: int, context: int, table: torch.Tensor, meta: AttentionMetadata) -> PrefillChunk:
        start = context - (end - begin)
        if start == 0:
            return cls(begin, end, 0, None)
        j = torch.arange(context, device=meta.block_tables.device)
        table = table.to(meta.block_tables.device).long()
        return cls(begin, end, start, table[j // meta.block_size] * meta.block_size + j % meta.block_size)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """``[Lq, Lk]`` True where a key is visible (bottom-right causal, and the window); None: plain causal."""
        if self.slots is None and window is None:
            return None
        if window not in self.masks:
            device = self.slots.device if self.slots is not None else None
            i = torch.arange(self.start, self.start + self.end - self.begin, device=device)[:, None]
            j = torch.arange(self.start + self.end - self.begin, device=device)[None, :]
            visible = j <= i
            if window is not None:
                visible &= j > i - window
            self.masks[window] = visible
        return self.masks[window]

    def attend(self, q, k, v, k_cache, v_cache, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """This chunk's attention output ``[Lq, H, D]`` through ``scaled_dot_product_attention``."""
        rows = slice(self.begin, self.end)
        if self.slots is None:
            keys, values = k[rows], v[rows]
        else:
            keys, values = k_cache.index_select(0, self.slots), v_cache.index_select(0, self.slots)
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[rows], keys, values))
        mask = self.mask(window)
        return attend(qs, ks, vs, mask, sinks, is_causal=mask is None).squeeze(0).transpose(0, 1)


@dataclass
class GatherPlan:
    """Slots of each sequence's context padded to the longest, and the masks over the padding."""

    decode_kv_index: torch.Tensor | None  # [Bd, Ld] slots of each decode's context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] True where a key is visible
    prefill_fresh: bool  # one prefill chunk starting at position 0, no window: plain causal
    prefill_pad_index: torch.Tensor | None  # [Tp] row of each prefill token in [Bp*Lq]
    prefill_kv_index: torch.Tensor | None  # [Bp, Lk] slots of each chunk's context
    prefill_mask: torch.Tensor | None  # [Bp, 1, Lq, Lk]
    num_prefill_seqs: int

    @classmethod
    def build(cls, meta: AttentionMetadata, window: int | None = None) -> GatherPlan:
        """``window``: the query at position i sees the keys j with i - window < j <= i."""
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
            visible = j[None, :] < ctx[:nd, None]
            if window is not None:
                visible &= j[None, :] > ctx[:nd, None] - 1 - window
            decode_mask = visible[:, None, None, :]
        num_prefill = len(qlen) - nd
        prefill_fresh = num_prefill == 1 and int(start[nd]) == 0 and window is None
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
            visible = j[None, None, :] <= qpos[:, :, None]
            if window is not None:
                visible &= j[None, None, :] > qpos[:, :, None] - window
            prefill_mask = visible[:, None]
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
        *,
        sliding_window: int | None = None,  # the query at i sees keys i - W < j <= i
        sinks: torch.Tensor | None = None,  # float32 [H] logits that join the softmax denominator only
    ) -> torch.Tensor: ...


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for a ``[B, L]`` slot index: ``index_select`` on the
    flattened index is several times faster than advanced indexing on CPU."""
    return torch.index_select(cache, 0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])


def attend(q, k, v, mask: torch.Tensor | None, sinks: torch.Tensor | None, is_causal: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` over ``[B, H, L, D]``; ``sinks`` (a logit
    per head) join the softmax as one more key whose value is zero."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask is None:  # causal
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    sink = sinks.to(q.dtype)[None, :, None, None].expand(b, h, lq, 1)
    bias = torch.cat([bias.expand(b, h, lq, lk), sink], dim=-1)
    k, v = (F.pad(x, (0, 0, 0, 1)) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


class TorchPagedAttention:
    """Portable paged attention on any torch device (CPU, CUDA, ROCm)."""

    name = "torch"
    ops = TorchOps

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window=None, sinks=None):
        meta.store_kv(k, v, k_cache, v_cache)
        plan, nd = meta.gather_plan(sliding_window), meta.num_decode
        out = torch.empty_like(q)
        if nd:
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            kd = gather(k_cache, plan.decode_kv_index).transpose(1, 2)  # [Bd, KVH, Ld, D]
            vd = gather(v_cache, plan.decode_kv_index).transpose(1, 2)
            out[:nd] = attend(qd, kd, vd, plan.decode_mask, sinks).squeeze(2)
        if plan.num_prefill_seqs == 0:
            return out
        if plan.prefill_fresh:
            qp, kp, vp = (x[nd:].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[nd:] = attend(qp, kp, vp, None, sinks, is_causal=True).squeeze(0).transpose(0, 1)
            return out
        bp, lq, h, d = plan.num_prefill_seqs, meta.max_query_len, q.shape[1], q.shape[2]
        qpad = q.new_zeros(bp * lq, h, d)
        qpad[plan.prefill_pad_index] = q[nd:]
        qp = qpad.view(bp, lq, h, d).transpose(1, 2)
        kp = gather(k_cache, plan.prefill_kv_index).transpose(1, 2)
        vp = gather(v_cache, plan.prefill_kv_index).transpose(1, 2)
        op = attend(qp, kp, vp, plan.prefill_mask, sinks)
        out[nd:] = op.transpose(1, 2).reshape(bp * lq, h, d)[plan.prefill_pad_index]
        return out


class CpuPagedAttention:
    """Decodes through the C++ kernel, reading the paged KV in place (split over the keys
    when there are few sequences); prefill chunks through ``PrefillChunk.attend``, or with
    ``paged_prefill`` through the kernel too, in the same call as the decodes."""

    ops = CpuOps

    def __init__(self, paged_prefill: bool = False):
        self.paged_prefill = paged_prefill
        self.name = "cpu_paged" if paged_prefill else "cpu"

    def runs_in_kernel(self, meta: AttentionMetadata) -> bool:
        """Whether the kernel runs the whole step (what the fused decoder, which has only the kernel, can match)."""
        return self.paged_prefill or meta.num_decode == meta.num_seqs

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window=None, sinks=None):
        meta.store_kv(k, v, k_cache, v_cache)
        q = q.contiguous()
        out = torch.empty_like(q)
        in_kernel = meta.num_seqs if self.runs_in_kernel(meta) else meta.num_decode
        if in_kernel:
            rows = q.shape[0] if in_kernel == meta.num_seqs else in_kernel  # decodes: one row each
            torch.ops.atom.paged_attention(
                out[:rows],
                q[:rows],
                k_cache,
                v_cache,
                meta.block_tables[:in_kernel],
                meta.seq_lens[:in_kernel],
                meta.query_start_loc[: in_kernel + 1],
                meta.block_size,
                1.0 / math.sqrt(q.shape[-1]),
                sliding_window or 0,
                None if sinks is None else sinks.float().contiguous(),
            )
        if in_kernel < meta.num_seqs:
            for chunk in meta.prefill_chunks():
                out[chunk.begin : chunk.end] = chunk.attend(q, k, v, k_cache, v_cache, sliding_window, sinks)
        return out


def select_backend(device: torch.device, name: str | None = None, head_dim: int | None = None) -> AttentionBackend:
    """The attention backend for ``device``: ``name``, else ``auto``: the first of ``auto_candidates(device)`` that runs there, each
    fallback logged. An explicitly named backend that cannot run is a one-line
    error, never a silent fallback."""
    name = name or "auto"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    device = torch.device(device)
    if name == "auto":
        backend = first_that_runs(auto_candidates(device), device, head_dim)
    else:
        backend = load_backend(name, device, head_dim)
    log.info("attention.backend", backend=backend.name, requested=name, device=str(device))
    return backend


def first_that_runs(candidates: tuple[str, ...], device: torch.device, head_dim: int | None) -> AttentionBackend:
    """The first candidate that loads on ``device``, each one that does not logged; the last must load."""
    *fallible, last = candidates
    for candidate in fallible:
        try:
            return load_backend(candidate, device, head_dim)
        except (ValueError, RuntimeError) as exc:
            log.warning("attention.fallback", backend=candidate, reason=str(exc))
    return load_backend(last, device, head_dim)


def auto_candidates(device: torch.device) -> tuple[str, ...]:
    """``auto``'s order, fastest first: the vendor library (aiter on ROCm, FlashInfer on CUDA), Triton, torch."""
    if device.type == "cpu":
        return ("cpu", "torch")
    if device.type != "cuda":
        return ("torch",)
    return ("aiter" if torch.version.hip else "flashinfer", "triton", "torch")


def load_backend(name: str, device: torch.device, head_dim: int | None = None) -> AttentionBackend:
    """Backend ``name`` on ``device``; ValueError if it cannot run there, RuntimeError if it is not installed."""
    if name == "torch":
        return TorchPagedAttention()
    if name in ("cpu", "cpu_paged"):
        if device.type != "cpu":
            raise ValueError(f"attention_backend {name!r} runs on the CPU, not on {device}")
        if (error := kernels.load_cpu_kernels()) is not None:
            raise RuntimeError(f"attention_backend {name!r} is unavailable: {error}")
        return CpuPagedAttention(paged_prefill=name == "cpu_paged")
    if name == "triton":
        if (error := triton_unavailable(device, head_dim)) is not None:
            raise ValueError(f"attention_backend 'triton' cannot run: {error}")
        from atom_anyio.engine.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    from atom_anyio.engine import vendor_attention

    return vendor_attention.load(name, device, head_dim)


def triton_interpreted() -> bool:
    """``TRITON_INTERPRET`` is on: Triton runs kernels defined from now on in its interpreter, on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_unavailable(device: torch.device, head_dim: int | None) -> str | None:
    """Why the Triton kernel cannot run on ``device`` (or for ``head_dim``), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if head_dim is not None and not 1 <= head_dim <= 256:
        return f"head_dim {head_dim} is outside 1..256"
    if device.type == "cpu":
        return None if triton_interpreted() else "on the CPU it runs only under TRITON_INTERPRET=1"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"it needs a CUDA or ROCm GPU, and {device} is not one"
    return None
