"""The ``torch`` backend: portable paged attention on any torch device. It
gathers each sequence's context through its block table and runs batched
``scaled_dot_product_attention`` (one call for all decodes, one for all
prefill chunks); the reference the exactness tests pin."""

from __future__ import annotations

import torch

from atom_anyio.models.attention.metadata import AttentionMetadata, as_cached, attend, from_kv_cache
from atom_anyio.models.ops import TorchOps

__all__ = ["TorchPagedAttention", "attend", "gather"]


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for a ``[B, L]`` slot index: ``index_select`` on the
    flattened index is several times faster than advanced indexing on CPU."""
    return torch.index_select(cache, 0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])


class TorchPagedAttention:
    """Portable paged attention on any torch device (CPU, CUDA, ROCm)."""

    name = "torch"
    ops = TorchOps()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window=None, sinks=None):
        meta.store_kv(k, v, k_cache, v_cache)
        plan, nd = meta.gather_plan(sliding_window), meta.num_decode
        out = torch.empty_like(q)
        if nd:
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            kd = from_kv_cache(gather(k_cache, plan.decode_kv_index), q.dtype).transpose(1, 2)  # [Bd, KVH, Ld, D]
            vd = from_kv_cache(gather(v_cache, plan.decode_kv_index), q.dtype).transpose(1, 2)
            out[:nd] = attend(qd, kd, vd, plan.decode_mask, sinks).squeeze(2)
        if plan.num_prefill_seqs == 0:
            return out
        if plan.prefill_fresh:
            kp, vp = as_cached(k[nd:], k_cache.dtype), as_cached(v[nd:], v_cache.dtype)
            qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (q[nd:], kp, vp))
            out[nd:] = attend(qp, kp, vp, None, sinks, is_causal=True).squeeze(0).transpose(0, 1)
            return out
        bp, lq, h, d = plan.num_prefill_seqs, meta.max_query_len, q.shape[1], q.shape[2]
        qpad = q.new_zeros(bp * lq, h, d)
        qpad[plan.prefill_pad_index] = q[nd:]
        qp = qpad.view(bp, lq, h, d).transpose(1, 2)
        kp = from_kv_cache(gather(k_cache, plan.prefill_kv_index), q.dtype).transpose(1, 2)
        vp = from_kv_cache(gather(v_cache, plan.prefill_kv_index), q.dtype).transpose(1, 2)
        op = attend(qp, kp, vp, plan.prefill_mask, sinks)
        out[nd:] = op.transpose(1, 2).reshape(bp * lq, h, d)[plan.prefill_pad_index]
        return out
