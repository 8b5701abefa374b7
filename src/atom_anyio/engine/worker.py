"""One device: the model, its KV pool and the sampler.

The engine loop sends plain ``StepInput`` objects over an anyio memory
channel and receives ``StepOutput`` back; the forward runs in a worker
thread (one at a time, through its own limiter) so the event loop never
waits on the device. Nothing here refers to sequences, so the worker could
move into its own process without the loop changing.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import anyio
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from atom_anyio.engine.attention import AttentionMetadata
from atom_anyio.engine.grammar import accept_tokens, apply_masks
from atom_anyio.engine.sampler import Sampler, SamplingInputs
from atom_anyio.engine.sequence import Logprob
from atom_anyio.models.llama import LlamaForCausalLM


@dataclass
class StepInput:
    input_ids: list[int]  # the step's tokens, flattened: decodes first, then prefill chunks
    positions: list[int]
    block_tables: list[array]  # each sequence's block ids, int32 (read without a copy loop)
    context_lens: list[int]  # per sequence, including this step's tokens
    query_lens: list[int]
    sample_rows: list[int]  # which sequences sample a token this step
    sampling: SamplingInputs


@dataclass
class StepOutput:
    token_ids: list[int] = field(default_factory=list)  # one per sample row
    logprobs: list[Logprob | None] = field(default_factory=list)
    error: str | None = None
    rejected: list[int] = field(default_factory=list)  # sample rows whose token their grammar refused
    timings: dict[str, float] = field(default_factory=dict)


def kv_bytes_per_token(model: LlamaForCausalLM, dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class Worker:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_threads: int = 1):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        num_slots = num_blocks * block_size
        self.kv_pool = torch.zeros(
            cfg.num_hidden_layers,
            2,
            num_slots,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_pool]
        self.block_size = block_size
        self.num_threads = num_threads
        self.sampler = Sampler()
        self.limiter = anyio.CapacityLimiter(1)
        self.failpoint: Exception | None = None  # off unless a test sets it: every step raises it

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        if self.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(self.device)
        elif torch.get_num_threads() != self.num_threads:  # OpenMP settings are per thread too
            torch.set_num_threads(self.num_threads)
        t0 = time.perf_counter()
        if self.failpoint is not None:
            raise self.failpoint
        dev = self.device
        meta = AttentionMetadata.build(step.block_tables, step.context_lens, step.query_lens, self.block_size, dev)
        input_ids = torch.tensor(step.input_ids, dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.tensor(step.positions, dtype=torch.long).to(dev, non_blocking=True)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        last = torch.tensor(step.query_lens).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last[step.sample_rows].to(dev)])
        if not torch.isfinite(logits).all():
            raise FloatingPointError("non-finite logits")
        t1 = time.perf_counter()
        matchers = step.sampling.matchers
        rows = apply_masks(logits, matchers) if matchers else []
        out = self.sampler(logits, step.sampling)
        rejected = accept_tokens(matchers, rows, out.token_ids) if rows else []
        t2 = time.perf_counter()
        timings = {"forward": t1 - t0, "sample": t2 - t1}
        return StepOutput(out.token_ids, out.logprobs, rejected=rejected, timings=timings)

    def _execute_or_error(self, step: StepInput) -> StepOutput:
        try:
            return self.execute(step)
        except Exception as exc:  # a failed step ends its batch, not the engine
            return StepOutput(error=f"{type(exc).__name__}: {exc}")

    async def run(
        self,
        steps: MemoryObjectReceiveStream[StepInput],
        results: MemoryObjectSendStream[StepOutput],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        async with steps, results:
            task_status.started()
            async for step in steps:
                out = await anyio.to_thread.run_sync(self._execute_or_error, step, limiter=self.limiter)
                await results.send(out)
