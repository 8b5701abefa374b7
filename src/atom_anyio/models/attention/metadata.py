"""What every attention backend shares: the step's ``AttentionMetadata`` (block
tables, context lengths, query offsets) with its prefill chunks and gather
plans, ``stage`` (host tensors onto the device), ``attend`` (the
``scaled_dot_product_attention`` every chunk falls back to), the
``AttentionBackend`` protocol, and ``triton_interpreted``. It imports no backend:
the backends (``portable``, ``cpu``, ``triton``, ``vendor``) import it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

# kv_cache_dtype's fp8 formats (engine_config.KV_CACHE_DTYPES; "fp8" is e4m3, as vLLM's), unscaled as
# vLLM's are without a checkpoint's scales
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for ``kv_cache_dtype`` ``name``: an fp8 format, or the model's (auto)."""
    return FP8_KV_DTYPES.get(name, model_dtype)


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache's ``dtype``: fp8 saturated to its largest finite value, then rounded to
    nearest even by torch's conversion (as the kernels' ``store_kv`` writes)."""
    if x.dtype == dtype:
        return x
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` into ``cache[slots]`` as the cache's dtype (``index_copy_``, which takes an fp8 cache
    through its bytes: torch has no fp8 index_copy_ on the CPU)."""
    rows = to_kv_cache(rows, cache.dtype)
    if cache.element_size() == 1:
        cache, rows = cache.view(torch.uint8), rows.contiguous().view(torch.uint8)
    cache.index_copy_(0, slots, rows)


def from_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values read from the cache, as the queries' ``dtype`` (fp8 widens exactly)."""
    return x if x.dtype == dtype else x.to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """A step's own keys or values as the cache holds them (an fp8 cache rounds them), so a fresh
    prompt attends to what a later hit on its prefix reads."""
    return from_kv_cache(to_kv_cache(x, cache_dtype), x.dtype)


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
    fresh_rows: int | None = field(default=None, repr=False)  # longest_fresh_prefill's answer

    def longest_fresh_prefill(self) -> int:
        """The most tokens of a prefill chunk that starts a prompt (no cached prefix), 0 without one."""
        if self.fresh_rows is None:
            seq_lens, _, query_start = self.host or (self.seq_lens, self.block_tables, self.query_start_loc)
            nd = self.num_decode
            rows = (query_start[nd + 1 :] - query_start[nd:-1]).long()
            fresh = rows == seq_lens[nd:].long()
            self.fresh_rows = int(rows[fresh].max()) if bool(fresh.any()) else 0
        return self.fresh_rows

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
        write_slots(k_cache, self.slot_mapping, k)
        write_slots(v_cache, self.slot_mapping, v)

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


def slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slots of ``positions`` through block tables ``[..., max_blocks]`` (a position past a
    table's last block reads that block: padding, which the masks hide)."""
    blocks = (positions // block_size).clamp(max=tables.shape[-1] - 1)
    return tables[..., blocks] * block_size + positions % block_size


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
        return cls(begin, end, start, slots_of(table.to(j.device).long(), j, meta.block_size))

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
            keys, values = as_cached(k[rows], k_cache.dtype), as_cached(v[rows], v_cache.dtype)
        else:
            keys, values = (from_kv_cache(c.index_select(0, self.slots), q.dtype) for c in (k_cache, v_cache))
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
            return slots_of(tables[rows], j, bs), j

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


def triton_interpreted() -> bool:
    """``TRITON_INTERPRET`` is on: Triton runs kernels defined from now on in its interpreter, on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
