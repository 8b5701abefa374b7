"""Thin adapters over vendor paged-attention libraries, used when importable.

* ``flashinfer`` (``flashinfer-python``, CUDA): ``BatchPrefillWithPagedKVCacheWrapper``
  over the cache viewed as NHD pages ``[num_blocks, block_size, KVH, D]``; one plan
  per step (and window), reused by every layer. No attention sinks.
* ``aiter`` (``amd-aiter``, ROCm): its Triton ``unified_attention``, which reads
  the same page layout through the block table, windows and sinks included.

Neither has run in this project's CI (no GPU there); the Triton backend is the
tested path on both vendors' GPUs.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from atom_anyio.models.attention.metadata import AttentionMetadata
from atom_anyio.models.ops import TorchOps

FLASHINFER_HEAD_DIMS = (64, 128, 256)


def load(name: str, device: torch.device, head_dim: int | None):
    """The adapter ``name`` on ``device``; ValueError if it cannot run there, RuntimeError if not installed."""
    rocm = torch.version.hip is not None
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"attention_backend {name!r} needs a GPU, and {device} is not one")
    if name == "flashinfer":
        if rocm:
            raise ValueError("attention_backend 'flashinfer' runs on CUDA, not ROCm")
        if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"attention_backend 'flashinfer' takes head_dim {FLASHINFER_HEAD_DIMS}, not {head_dim}")
        if importlib.util.find_spec("flashinfer") is None:
            raise RuntimeError("attention_backend 'flashinfer' is unavailable: pip install flashinfer-python")
        return FlashInferPagedAttention(device)
    assert name == "aiter", name
    if not rocm:
        raise ValueError("attention_backend 'aiter' runs on ROCm, not CUDA")
    if importlib.util.find_spec("aiter") is None:
        raise RuntimeError("attention_backend 'aiter' is unavailable: pip install amd-aiter")
    return AiterPagedAttention()


def pages(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat ``[num_slots, KVH, D]`` caches as ``[num_blocks, block_size, KVH, D]`` pages (views)."""
    return tuple(c.view(-1, block_size, *c.shape[1:]) for c in (k_cache, v_cache))


class FlashInferPagedAttention:
    name = "flashinfer"
    ops = TorchOps()

    def __init__(self, device: torch.device):
        import flashinfer

        self.workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        self.make_wrapper = lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.plans: dict[int | None, tuple[AttentionMetadata, object]] = {}  # by window: the step planned

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window=None, sinks=None):
        if sinks is not None:
            raise ValueError("attention_backend 'flashinfer' does not take attention sinks; use triton")
        meta.store_kv(k, v, k_cache, v_cache)
        wrapper = self._wrapper(q, k_cache, meta, sliding_window)
        return wrapper.run(q.contiguous(), pages(k_cache, v_cache, meta.block_size))

    def _wrapper(self, q, k_cache, meta: AttentionMetadata, window: int | None):
        planned = self.plans.get(window)
        if planned is not None and planned[0] is meta:
            return planned[1]
        bs = meta.block_size
        # the host copies the metadata was built from (no device-to-host sync), else copied back
        seq_lens, tables, query_start = meta.host or (
            x.cpu() for x in (meta.seq_lens, meta.block_tables, meta.query_start_loc)
        )
        num_pages = (seq_lens + bs - 1) // bs
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        torch.cumsum(num_pages, 0, out=indptr[1:])
        used = torch.arange(tables.shape[1])[None, :] < num_pages[:, None]
        wrapper = planned[1] if planned is not None else self.make_wrapper()
        wrapper.plan(
            query_start,
            indptr,
            tables[used].to(device=q.device, dtype=torch.int32),
            (seq_lens - (num_pages - 1) * bs).to(torch.int32),
            q.shape[1],
            k_cache.shape[1],
            q.shape[2],
            bs,
            causal=True,
            sm_scale=1.0 / math.sqrt(q.shape[2]),
            window_left=window - 1 if window else -1,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
        )
        self.plans[window] = (meta, wrapper)
        return wrapper


class AiterPagedAttention:
    name = "aiter"
    ops = TorchOps()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window=None, sinks=None):
        from aiter.ops.triton.unified_attention import unified_attention

        meta.store_kv(k, v, k_cache, v_cache)
        q = q.contiguous()
        out = torch.empty_like(q)
        kp, vp = pages(k_cache, v_cache, meta.block_size)
        unified_attention(
            q,
            kp,
            vp,
            out,
            meta.query_start_loc,
            meta.max_query_len,
            meta.seq_lens,
            meta.block_tables.shape[1] * meta.block_size,  # a bound on the longest context, known without a sync
            1.0 / math.sqrt(q.shape[2]),
            True,
            (sliding_window - 1, 0) if sliding_window else (-1, -1),
            meta.block_tables,
            0,
            None,
            None,
            None,
            sinks=sinks,
        )
        return out
