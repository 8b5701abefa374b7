"""The ``cpu`` and ``cpu_paged`` backends: decodes (and with ``cpu_paged`` prefill
chunks too) through the C++ kernel of ``kernels/csrc/paged_attention.cpp``."""

from __future__ import annotations

import math

import torch

from atom_anyio import kernels
from atom_anyio.models.attention.metadata import AttentionMetadata
from atom_anyio.models.ops import BatchInvariantCpuOps, CpuOps

# keys per partition of a batch-invariant call (with the block size's lcm): each partition's partial
# is merged, so it is large enough that merging costs little against a prefill chunk's work over a
# long prefix (a 1,500-token chunk beside 8 decodes at 40k, tiny Llama, Xeon: 512 cost 1.14-1.19x
# the unsplit call, 2048 0.98x), and small enough that a few long decodes still split over the threads
INVARIANT_PARTITION = 2048
AMX_FRESH_PREFILL_MAX = 1024  # a fresh prompt's chunk this long or longer goes to SDPA under amx_prefill
# a step whose every chunk has at most this many rows runs wholly in the kernel, without paged_prefill
# too: speculation's verifying chunks (num_speculative_tokens + 1 rows, suffix's default 25), where
# gathering each chunk's context for SDPA, and the op-by-op path beside the fused decoder, cost a
# verifying step of SmolLM2 (float32, AVX2 build on a Zen 4) about six plain decodes
SHORT_CHUNK_ROWS = 32


class CpuPagedAttention:
    """Decodes through the C++ kernel, reading the paged KV in place (split over the keys
    when there are few sequences); prefill chunks through ``PrefillChunk.attend``, or with
    ``paged_prefill`` through the kernel too, in the same call as the decodes.

    ``batch_invariant``: every row through the kernel, its keys split at fixed multiples of
    ``INVARIANT_PARTITION`` whatever the batch, and the model's linears in fixed tiles
    (``BatchInvariantCpuOps``): a sequence's logits are the same bits alone or batched, in one prefill or
    in chunks, computed or taken from the prefix cache.

    ``native`` and ``amx`` (the model's plan: ``cpu_native_kernels``, ``cpu_amx``) go with every
    kernel call: the native variants where built, else their portable twins; bfloat16 attention on
    the AMX tiles where built and lent, else the AVX512-BF16 variant."""

    def __init__(
        self,
        paged_prefill: bool = False,
        batch_invariant: bool = False,
        amx_prefill: bool = False,
        native: bool = True,
        amx: bool = True,
    ):
        self.paged_prefill = paged_prefill or batch_invariant
        self.batch_invariant = batch_invariant
        # prefill chunks through the kernel while it runs on the AMX tiles (auto's choice for
        # bfloat16 on such a CPU), through SDPA when cpu_amx=false turns them off
        self.amx_prefill = amx_prefill
        self.native, self.amx = native, amx
        self.ops = (BatchInvariantCpuOps if batch_invariant else CpuOps)(native)
        self.name = "cpu_paged" if self.paged_prefill else "cpu"

    @property
    def on_amx_tiles(self) -> bool:
        """bfloat16 attention in the kernel runs on the AMX tiles (built, lent, and neither switch off)."""
        return self.native and self.amx and kernels.has_amx_attention()

    def use_auto_batch_invariant(self) -> None:
        """Batch-invariant attention (every row through the kernel, keys split at fixed multiples)
        for a model whose linears already are (every one on the AMX GEMM, which ``CpuOps`` runs at
        any row count): the loader's one change, at load, where ``batch_invariant`` is auto and
        ``loader.batch_invariant_auto_reason`` finds it costs nothing."""
        self.batch_invariant = self.paged_prefill = True
        self.name = "cpu_paged"

    def partition(self, meta: AttentionMetadata) -> int:
        """The kernel's key partition: fixed multiples when batch-invariant, else 0 (its own split)."""
        return math.lcm(INVARIANT_PARTITION, meta.block_size) if self.batch_invariant else 0

    def runs_in_kernel(self, meta: AttentionMetadata) -> bool:
        """Whether the kernel runs the whole step (what the fused decoder, which has only the kernel, can match)."""
        if self.paged_prefill or meta.num_decode == meta.num_seqs or meta.max_query_len <= SHORT_CHUNK_ROWS:
            return True
        if not (self.amx_prefill and self.on_amx_tiles):
            return False
        # a long fresh prompt: torch's flash SDPA, whose causal blocks are larger, takes the step's
        # chunks (a fresh 2,048 in 9.4 ms a layer against the tiles' 12.8; 555: 1.13 against 1.08)
        return meta.longest_fresh_prefill() < AMX_FRESH_PREFILL_MAX

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window=None, sinks=None):
        if _heads_contiguous(k) and _heads_contiguous(v):  # the qkv buffer's views: one call for both
            torch.ops.atom.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        else:
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
                self.partition(meta),
                self.native,
                self.amx,
            )
        if in_kernel < meta.num_seqs:
            for chunk in meta.prefill_chunks():
                out[chunk.begin : chunk.end] = chunk.attend(q, k, v, k_cache, v_cache, sliding_window, sinks)
        return out


def _heads_contiguous(t: torch.Tensor) -> bool:
    """Whether each token's heads of ``t`` ``[T, heads, head_dim]`` lie as one row (any token stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
