"""Decode-only steps on static buffers, captured as CUDA graphs on a GPU.

A decode batch of ``b`` sequences is padded up to the next captured size (1,
2, 4, ... ``max_num_seqs``) and its inputs are copied into buffers that never
move, so each size's forward and LM head can be captured once and replayed.
A padding row has context 1 and writes its K/V to a slot of the spare block
past the pool's last one (the block manager never hands it out), so it
touches nothing a sequence owns. On the CPU the same padded path runs without
capture, which is how the tests pin it; the capture itself has not yet run on
a GPU. Needs a backend that never reads a device value on the host (``triton``).
"""

from __future__ import annotations

from array import array

import numpy as np
import structlog
import torch

from atom_anyio.models.attention import AttentionMetadata
from atom_anyio.models.decoder import LlamaForCausalLM

log = structlog.get_logger("atom_anyio.engine")


def batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(min(2 * sizes[-1], max_num_seqs))
    return tuple(sizes)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        spare_slot: int,
        max_model_len: int,
        max_num_seqs: int,
    ):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda"
        self.sizes = batch_sizes(max_num_seqs)
        self.spare_slot = spare_slot
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        dev = self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), spare_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.metas: dict[int, AttentionMetadata] = {}  # by padded size: the sizes that have run

    def fits(self, block_tables: list[array], context_lens: list[int], query_lens: list[int]) -> bool:
        """A step of decodes only, no more than the largest size, every table within the buffers."""
        return (
            len(query_lens) <= self.sizes[-1]
            and all(q == 1 for q in query_lens)
            and all(c > 1 for c in context_lens)
            and max(len(t) for t in block_tables) <= self.block_tables.shape[1]
        )

    def logits(self, input_ids: list[int], block_tables: list[array], context_lens: list[int]) -> torch.Tensor:
        """float32 ``[b, vocab]`` logits of one decode step (``fits`` holds)."""
        b = len(input_ids)
        size = next(s for s in self.sizes if s >= b)
        self._fill(size, input_ids, block_tables, context_lens)
        if not self.capture:
            return self._forward(size)[:b]
        if size not in self.graphs:
            try:
                self.graphs[size] = self._captured(size)
            except Exception as exc:  # e.g. a backend that reads a device value on the host: run eagerly
                log.warning("cuda_graph.unavailable", reason=f"{type(exc).__name__}: {exc}")
                self.capture = False
                return self._forward(size)[:b]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b]

    def _fill(self, size: int, input_ids, block_tables, context_lens) -> None:
        b, bs = len(input_ids), self.block_size
        ctx = np.ones(size, dtype=np.int32)
        ctx[:b] = context_lens
        pos = (ctx - 1).astype(np.int64)
        pos[b:] = 0
        width = max(len(t) for t in block_tables)
        tables = np.zeros((b, width), dtype=np.int32)
        for row, table in zip(tables, block_tables, strict=True):
            row[: len(table)] = np.asarray(table, dtype=np.int32)
        slots = np.full(size, self.spare_slot, dtype=np.int64)
        slots[:b] = tables[np.arange(b), pos[:b] // bs].astype(np.int64) * bs + pos[:b] % bs
        ids = np.zeros(size, dtype=np.int64)
        ids[:b] = input_ids
        for buffer, values in (
            (self.input_ids[:size], ids),
            (self.positions[:size], pos),
            (self.slot_mapping[:size], slots),
            (self.seq_lens[:size], ctx),
            (self.block_tables[:b, :width], tables),
        ):
            host = torch.from_numpy(values)
            buffer.copy_(host.pin_memory() if self.capture else host, non_blocking=True)

    def _meta(self, size: int) -> AttentionMetadata:
        if size not in self.metas:  # views of the buffers: one per size, as a graph captured them
            self.metas[size] = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                block_tables=self.block_tables[:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                num_decode=size,
                max_query_len=1,
                block_size=self.block_size,
            )
        return self.metas[size]

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._meta(size) if self.capture else dataclass_copy(self._meta(size))
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _captured(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (kernels compiled, allocations made), then capture."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._forward(size)
        log.info("cuda_graph.captured", batch_size=size)
        return graph, logits


def dataclass_copy(meta: AttentionMetadata) -> AttentionMetadata:
    """A fresh metadata over the same buffers: the portable path caches its plan per object and step."""
    return AttentionMetadata(
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.num_decode,
        meta.max_query_len,
        meta.block_size,
    )
