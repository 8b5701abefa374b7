"""Paged attention in Triton: NVIDIA and AMD GPUs, and the CPU under ``TRITON_INTERPRET=1`` (how CI tests it).

One kernel serves decodes and prefill chunks alike. A program takes one KV
head of one sequence and a tile of that sequence's query tokens times the
query heads that share the KV head (GQA), so each K/V tile is read once per
group. Keys are read through the block table where they lie (no gathered
copy); causality, the sliding window and padding are masks; softmax is online
(base 2). Decodes, which have one query token each, may split their keys over
several programs (``decode_splits``) whose partial results a second kernel
merges, so that a small batch still fills the device.

Which rows a program holds (``QPK`` query heads per KV head, padded to a
power of two)::

    row r -> query token  q_block * BLOCK_Q + r // QPK_PAD,  head  kv_head * QPK + r % QPK_PAD
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_anyio.models.attention.metadata import AttentionMetadata, triton_interpreted
from atom_anyio.models.ops import TorchOps

INTERPRETED = triton_interpreted()  # as @triton.jit reads it, when this module is imported
NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _attend_tile(
    q,
    acc,
    m,
    ell,
    j,
    qpos,
    k_cache,
    v_cache,
    table_row,
    kv_head,
    d,
    d_ok,
    kv_end,
    window,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """One online-softmax update of rows ``q`` over the keys ``j`` (absolute positions)."""
    j_ok = j < kv_end
    page = tl.load(table_row + j // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + j % PAGE_SIZE
    k = tl.load(
        k_cache + slot[None, :] * stride_ks + kv_head * stride_kh + d[:, None],
        mask=j_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee") if F32_DOT else tl.dot(q, k)
    s = s * qk_scale
    visible = j_ok[None, :] & (j[None, :] <= qpos[:, None]) & (j[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    ell = ell * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
        mask=j_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if F32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, ell


@triton.jit(do_not_specialize=["seq_offset", "window"])  # one compiled kernel whatever their values
def paged_attention_kernel(
    out,
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    sinks,
    part_acc,  # [num_decode, H, NUM_SPLITS, BLOCK_D] float32 when NUM_SPLITS > 1
    part_ml,  # [num_decode, H, NUM_SPLITS, 2] float32: running max and sum
    seq_offset,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    qk_scale,
    window,
    QPK: tl.constexpr,
    QPK_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    seq = tl.program_id(0) + seq_offset
    kv_head = tl.program_id(1)
    q_block = 0
    if NUM_SPLITS == 1:
        q_block = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    ctx = tl.load(seq_lens + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    rows = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + rows // QPK_PAD
    g = rows % QPK_PAD
    row_ok = (rows // QPK_PAD < BLOCK_Q) & (qi < q_len) & (g < QPK)
    head = kv_head * QPK + g
    qpos = ctx - q_len + qi  # each row's absolute position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    first_pos = ctx - q_len + q_block * BLOCK_Q
    kv_end = tl.minimum(ctx, first_pos + BLOCK_Q)  # causal: nothing past the tile's last token
    kv_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N  # the window masks the excess
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_start + split * per_split
        kv_end = tl.minimum(kv_end, kv_start + per_split)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ell = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    for tile in range(kv_start, kv_end, BLOCK_N):
        j = tile + tl.arange(0, BLOCK_N)
        acc, m, ell = _attend_tile(
            q,
            acc,
            m,
            ell,
            j,
            qpos,
            k_cache,
            v_cache,
            table_row,
            kv_head,
            d,
            d_ok,
            kv_end,
            window,
            stride_ks,
            stride_kh,
            stride_vs,
            stride_vh,
            qk_scale,
            PAGE_SIZE,
            F32_DOT,
        )
    if NUM_SPLITS > 1:  # the merge kernel adds the sinks and normalises
        part = ((seq - seq_offset) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml + part * 2, m, mask=row_ok)
        tl.store(part_ml + part * 2 + 1, ell, mask=row_ok)
        return
    if HAS_SINKS:  # the sink joins the denominator only
        sink = tl.load(sinks + head, mask=row_ok, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        scale = tl.exp2(m - m_new)
        ell = ell * scale + tl.exp2(sink - m_new)
        acc = acc * scale[:, None]
    ell = tl.where(ell == 0.0, 1.0, ell)  # padded rows
    o = acc / ell[:, None]
    tl.store(
        out + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def merge_splits_kernel(
    out,
    part_acc,
    part_ml,
    sinks,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Decode token ``program_id(0)``, head ``program_id(1)``: merge its splits' partial softmax results."""
    token, head = tl.program_id(0), tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml + part * 2)
    ell = tl.load(part_ml + part * 2 + 1)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc + part[:, None] * BLOCK_D + d[None, :])
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks + head) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))  # an empty split weighs nothing
    total = tl.sum(ell * w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_all)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out + token * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


class TritonPagedAttention:
    """The Triton kernel; ``decode_splits``: how many programs share one decode's
    keys (None: enough to give every multiprocessor about two programs)."""

    name = "triton"
    ops = TorchOps()

    def __init__(self, decode_splits: int | None = None, block_n: int | None = None):
        assert decode_splits is None or decode_splits == triton.next_power_of_2(decode_splits)
        self.decode_splits = decode_splits
        self.block_n = block_n

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert q.dtype in DTYPES and k_cache.dtype == q.dtype, (q.dtype, k_cache.dtype)
        meta.store_kv(k, v, k_cache, v_cache)
        step = Step.build(q, k_cache, v_cache, meta, sliding_window, sinks, self.block_n)
        nd, num_seqs, num_kv_heads = meta.num_decode, meta.seq_lens.shape[0], k_cache.shape[1]
        if nd:
            step.decodes(self.decode_splits or default_splits(q.device, nd * num_kv_heads))
        if num_seqs > nd:  # prefill chunks: about 64 query rows a program (32 past head_dim 128)
            block_q = max(1, (64 if step.block_d <= 128 else 32) // step.qpk_pad)
            step.launch((num_seqs - nd, num_kv_heads, triton.cdiv(meta.max_query_len, block_q)), nd, block_q)
        return step.out


@dataclass
class Step:
    """One layer's call: its tensors and the kernel constants its launches share."""

    out: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    sinks: torch.Tensor | None
    qpk: int  # query heads per KV head
    qpk_pad: int
    block_d: int
    block_n: int
    window: int
    f32_dot: bool

    @classmethod
    def build(cls, q, k_cache, v_cache, meta, sliding_window, sinks, block_n) -> Step:
        heads, head_dim = q.shape[1], q.shape[2]
        qpk = heads // k_cache.shape[1]
        assert qpk * k_cache.shape[1] == heads and (sinks is None or sinks.shape == (heads,))
        q = q if q.stride(-1) == 1 else q.contiguous()
        block_d = max(16, triton.next_power_of_2(head_dim))
        return cls(
            out=torch.empty(q.shape, dtype=q.dtype, device=q.device),
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            meta=meta,
            sinks=None if sinks is None else sinks.float().contiguous(),
            qpk=qpk,
            qpk_pad=triton.next_power_of_2(qpk),
            block_d=block_d,
            block_n=block_n or (64 if block_d <= 128 else 32),
            window=sliding_window or NO_WINDOW,
            # float32 exactly (no TF32); bfloat16 too under the interpreter, whose bfloat16 dot is wrong
            f32_dot=q.dtype == torch.float32 or (INTERPRETED and q.dtype == torch.bfloat16),
        )

    def decodes(self, splits: int) -> None:
        """The decodes (the first sequences), their keys split ``splits`` ways and merged."""
        nd, num_kv_heads = self.meta.num_decode, self.k_cache.shape[1]
        if splits == 1:
            self.launch((nd, num_kv_heads, 1), 0, 1)
            return
        heads, dev = self.q.shape[1], self.q.device
        part_acc = torch.empty(nd, heads, splits, self.block_d, dtype=torch.float32, device=dev)
        part_ml = torch.empty(nd, heads, splits, 2, dtype=torch.float32, device=dev)
        self.launch((nd, num_kv_heads, splits), 0, 1, splits, part_acc, part_ml)
        merge_splits_kernel[(nd, heads)](
            self.out,
            part_acc,
            part_ml,
            self.sinks if self.sinks is not None else part_ml,
            self.out.stride(0),
            self.out.stride(1),
            HEAD_DIM=self.q.shape[-1],
            BLOCK_D=self.block_d,
            HAS_SINKS=self.sinks is not None,
            NUM_SPLITS=splits,
        )

    def launch(self, grid, seq_offset: int, block_q: int, num_splits: int = 1, part_acc=None, part_ml=None) -> None:
        q, k_cache, v_cache, meta, out = self.q, self.k_cache, self.v_cache, self.meta, self.out
        paged_attention_kernel[grid](
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.sinks if self.sinks is not None else out,  # placeholders: never read
            part_acc if part_acc is not None else out,
            part_ml if part_ml is not None else out,
            seq_offset,
            q.shape[1],
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            meta.block_tables.stride(0),
            LOG2E / math.sqrt(q.shape[-1]),
            self.window,
            QPK=self.qpk,
            QPK_PAD=self.qpk_pad,
            BLOCK_Q=block_q,
            BLOCK_M=max(16, block_q * self.qpk_pad),
            HEAD_DIM=q.shape[-1],
            BLOCK_D=self.block_d,
            BLOCK_N=self.block_n,
            PAGE_SIZE=meta.block_size,
            HAS_SINKS=self.sinks is not None,
            NUM_SPLITS=num_splits,
            F32_DOT=self.f32_dot,
        )


def default_splits(device: torch.device, num_programs: int) -> int:
    """Key splits per decode so that about two programs run per multiprocessor (1 on the CPU)."""
    if device.type != "cuda":
        return 1
    return min(16, triton.next_power_of_2(max(1, 2 * multiprocessors(device) // max(1, num_programs))))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
