"""Paged attention: one metadata object per step, one backend interface.

The KV cache of a layer is two flat tensors ``[num_slots, num_kv_heads,
head_dim]`` where ``slot = block_id * block_size + offset``. A step's tokens
are flattened: decode tokens first (one per sequence), then the prefill
chunks. The portable torch backend gathers each sequence's context through
its block table and runs batched ``scaled_dot_product_attention``: one call
for all decodes and one for all prefill chunks, never a loop per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where a step's tokens read and write the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    num_decode: int  # the first num_decode tokens are decodes, one per sequence
    decode_kv_index: torch.Tensor | None  # [Bd, Ld] slots of each decode's context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] True where a key is visible
    prefill_fresh: bool  # one prefill chunk starting at position 0: plain causal
    prefill_pad_index: torch.Tensor | None  # [Tp] row of each prefill token in [Bp*Lq]
    prefill_kv_index: torch.Tensor | None  # [Bp, Lk] slots of each chunk's context
    prefill_mask: torch.Tensor | None  # [Bp, 1, Lq, Lk]
    num_prefill_seqs: int
    max_query_len: int

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for sequences ordered decodes first (query_len == 1 and
        context_len > 1), then prefill chunks. ``context_lens`` include the
        step's own tokens."""
        num_decode = 0
        while num_decode < len(query_lens) and query_lens[num_decode] == 1 and context_lens[num_decode] > 1:
            num_decode += 1
        bs = block_size
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        qlen = torch.tensor(query_lens, dtype=torch.long)
        start = ctx - qlen
        # slot of every new token
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), qlen)
        first = torch.cumsum(qlen, 0) - qlen
        pos = start[seq_of_token] + torch.arange(int(qlen.sum())) - first[seq_of_token]
        slot_mapping = tables[seq_of_token, pos // bs] * bs + pos % bs

        def kv_index(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
            lk = int(ctx[rows].max())
            j = torch.arange(lk)
            t = tables[rows]
            index = t[:, (j // bs).clamp(max=t.shape[1] - 1)] * bs + j % bs
            return index, j

        decode_kv_index = decode_mask = None
        if num_decode:
            decode_kv_index, j = kv_index(slice(0, num_decode))
            decode_mask = (j[None, :] < ctx[:num_decode, None])[:, None, None, :]

        num_prefill = len(query_lens) - num_decode
        prefill_fresh = num_prefill == 1 and int(start[num_decode]) == 0
        pad_index = prefill_kv_index = prefill_mask = None
        max_q = int(qlen[num_decode:].max()) if num_prefill else 0
        if num_prefill and not prefill_fresh:
            rows = slice(num_decode, None)
            pq = qlen[rows]
            pfirst = torch.cumsum(pq, 0) - pq
            seq = torch.repeat_interleave(torch.arange(num_prefill), pq)
            offset = torch.arange(int(pq.sum())) - pfirst[seq]
            pad_index = seq * max_q + offset
            prefill_kv_index, j = kv_index(rows)
            i = torch.arange(max_q)
            qpos = start[rows, None] + i[None, :]  # [Bp, Lq]
            qpos = torch.where(i[None, :] < pq[:, None], qpos, 0)  # padded rows see key 0
            prefill_mask = (j[None, None, :] <= qpos[:, :, None])[:, None]
        to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return cls(
            slot_mapping=to(slot_mapping),
            num_decode=num_decode,
            decode_kv_index=to(decode_kv_index),
            decode_mask=to(decode_mask),
            prefill_fresh=prefill_fresh,
            prefill_pad_index=to(pad_index),
            prefill_kv_index=to(prefill_kv_index),
            prefill_mask=to(prefill_mask),
            num_prefill_seqs=num_prefill,
            max_query_len=max_q,
        )


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for a ``[B, L]`` slot index: ``index_select`` on the
    flattened index is several times faster than advanced indexing on CPU."""
    return torch.index_select(cache, 0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])


class TorchPagedAttention:
    """Portable paged attention on any torch device (CPU, CUDA, ROCm)."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decode
        out = torch.empty_like(q)
        if nd:
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            kd = gather(k_cache, meta.decode_kv_index).transpose(1, 2)  # [Bd, KVH, Ld, D]
            vd = gather(v_cache, meta.decode_kv_index).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
            out[:nd] = od.squeeze(2)
        if meta.num_prefill_seqs == 0:
            return out
        if meta.prefill_fresh:
            qp, kp, vp = (x[nd:].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            out[nd:] = op.squeeze(0).transpose(0, 1)
            return out
        bp, lq, h, d = meta.num_prefill_seqs, meta.max_query_len, q.shape[1], q.shape[2]
        qpad = q.new_zeros(bp * lq, h, d)
        qpad[meta.prefill_pad_index] = q[nd:]
        qp = qpad.view(bp, lq, h, d).transpose(1, 2)
        kp = gather(k_cache, meta.prefill_kv_index).transpose(1, 2)
        vp = gather(v_cache, meta.prefill_kv_index).transpose(1, 2)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.prefill_mask, enable_gqa=True)
        out[nd:] = op.transpose(1, 2).reshape(bp * lq, h, d)[meta.prefill_pad_index]
        return out


def select_backend(device: torch.device) -> TorchPagedAttention:
    """The attention backend for ``device``.

    Fast kernels (aiter on ROCm, flash-attn on CUDA) plug in here behind the
    same ``forward`` signature; the portable torch path is the fallback and
    the reference the exactness tests pin.
    """
    return TorchPagedAttention()
