"""One device: the model, its KV pool and the sampler.

The engine loop sends plain ``StepInput`` objects (picklable: the grammar masks
as a bitmask) over an anyio memory channel and receives ``StepOutput`` back; the steps run on one thread of
their own (through the worker's limiter) so the event loop never waits on
the device. Nothing here refers to sequences, so the worker could
move into its own process without the loop changing.
"""

from __future__ import annotations

import queue
import time

import anyio
import structlog
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from atom_anyio import kernels
from atom_anyio.engine.cuda_graphs import DecodeGraphs
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import apply_bitmask
from atom_anyio.engine.kv_tier import TierStore
from atom_anyio.engine.sampler import INVALID_TOKEN, MIN_LOGPROB, Sampler
from atom_anyio.engine.speculative import draft_positions, verify
from atom_anyio.engine.step import PromptRows, StepInput, StepOutput
from atom_anyio.engine.stream import Logprob
from atom_anyio.models.attention import AttentionMetadata, stage
from atom_anyio.models.attention.metadata import kv_cache_torch_dtype
from atom_anyio.models.decoder import LlamaForCausalLM

log = structlog.get_logger("atom_anyio.engine")


class WorkerFailed(RuntimeError):
    """No later step can run (a rank of a tensor-parallel group is gone): the engine stops."""


def kv_bytes_per_token(model: LlamaForCausalLM, dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def kv_pool_bytes(cfg: EngineConfig, model: LlamaForCausalLM) -> int:
    """The KV pool's budget: ``kv_cache_gib`` on the CPU; on a GPU, ``gpu_memory_utilization``
    of its memory less what is in use (these weights, other processes) and one step's activations."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return int(cfg.kv_cache_gib * 2**30)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * cfg.gpu_memory_utilization) - (total - free) - activation_bytes(cfg, model)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves no room for the KV pool on {device} "
            f"({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use)"
        )
    return budget


def activation_bytes(cfg: EngineConfig, model: LlamaForCausalLM) -> int:
    """A generous bound on one step's transient memory: the largest step's hidden states,
    projections and MLP, the sampled rows' float32 logits (and their sort), twice over, and 512 MiB."""
    mc = model.config
    itemsize = next(model.parameters()).element_size()
    width = 4 * mc.hidden_size + (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    width += 3 * mc.intermediate_size
    logits = cfg.max_num_seqs * mc.vocab_size * 4 * 4
    return 2 * (cfg.max_num_batched_tokens * width * itemsize + logits) + 512 * 2**20


PROMPT_LOGITS_ROWS = 256
FP8_KV_BACKENDS = ("cpu", "cpu_paged", "torch")  # the attention backends that read an fp8 KV cache


class Worker:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        num_threads: int = 1,
        decode_graphs: tuple[int, int] | None = None,  # (max_model_len, max_num_seqs): see cuda_graphs.py
        tier_slots: int = 0,  # blocks of the KV cache's second tier (kv_tier.py); 0: none
        tier_dir: str | None = None,  # where the CPU's tier file goes
        sampler: Sampler | None = None,  # default the real one (tests pass a fake)
        kv_cache_dtype: str = "auto",  # EngineConfig.kv_cache_dtype
    ):
        self.model = model  # as loaded (its plan: models/plan.py); nothing here changes it
        param = next(model.parameters())
        self.device, self.kv_dtype = param.device, kv_cache_torch_dtype(kv_cache_dtype, param.dtype)
        backend = model.attention_backend.name
        if self.kv_dtype != param.dtype and backend not in FP8_KV_BACKENDS:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype} runs on the {' and '.join(FP8_KV_BACKENDS)} attention backends, "
                f"not on {backend}"
            )
        cfg = model.config
        num_slots = (num_blocks + (decode_graphs is not None)) * block_size  # a spare block for padding rows
        shape = (cfg.num_hidden_layers, 2, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_huge_pages = False
        if self.device.type == "cpu":
            self.kv_pool, self.kv_huge_pages = kernels.empty_on_huge_pages(shape, self.kv_dtype)
            self.kv_pool.zero_()  # its pages faulted in here, on the loading thread, not by the first steps
        else:
            self.kv_pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_pool]
        self.tier = TierStore(tier_slots, self.kv_pool, block_size, tier_dir) if tier_slots else None
        self.block_size = block_size
        self.graphs = None
        if decode_graphs is not None:
            spare_slot = num_blocks * block_size
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size, spare_slot, *decode_graphs)
        self.num_threads = num_threads
        self.sampler = sampler or Sampler()
        self.sampled: torch.Tensor | None = None  # the last step's sampled ids, on the device (None: it failed)
        self.limiter = anyio.CapacityLimiter(1)
        if self.device.type == "cpu":  # the steps run on another thread: this one's OpenMP pool goes
            kernels.release_openmp_threads()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        if self.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(self.device)
        elif torch.get_num_threads() != self.num_threads:  # OpenMP settings are per thread too
            torch.set_num_threads(self.num_threads)
        t0 = time.perf_counter()
        copy_s = self.copy_tier(step)
        graphs = self.graphs
        one_row_each = not (step.prompt_rows or step.draft_token_ids)
        every_row_samples = len(step.sample_rows) == len(step.query_lens) and one_row_each
        prompt_logprobs: list[list[Logprob]] = []
        if graphs and every_row_samples and graphs.fits(step.block_tables, step.context_lens, step.query_lens):
            logits = self.graphs.logits(self.host_input_ids(step), step.block_tables, step.context_lens)
        else:
            logits, prompt_logprobs = self.forward(step)
        # a NaN or an infinity anywhere in a row reaches its max: checked on the device, read back
        # with the sampled ids (the step's one host sync), before the grammar masks add their -inf
        finite = torch.isfinite(logits.amax(dim=-1))
        t1 = time.perf_counter()
        if step.sampling.masked_rows:
            apply_bitmask(logits, step.sampling.bitmask, step.sampling.masked_rows)
        out = self.sampler(logits, step.sampling, finite)
        if INVALID_TOKEN in out.token_ids:
            raise FloatingPointError("non-finite logits")
        num_accepted = verify(step.draft_token_ids, out.token_ids) if step.draft_token_ids else []
        # async scheduling feeds these to the next step: a row whose token the output side may
        # change (a grammar's, a reasoning budget's) never runs ahead, so none is read changed
        self.sampled = out.ids if out.ids is not None else torch.tensor(out.token_ids, device=self.device)
        t2 = time.perf_counter()
        timings = {"forward": t1 - t0, "sample": t2 - t1}  # forward: the tier's copies included
        if copy_s is not None:
            timings["kv_copy"] = copy_s
        return StepOutput(out.token_ids, out.logprobs, num_accepted, timings=timings, prompt_logprobs=prompt_logprobs)

    def copy_tier(self, step: StepInput) -> float | None:
        """The step's copies between the pool and the tier (saves, then loads), run before its
        forward on every rank; their seconds, or None for a step without any."""
        if not (step.kv_saves or step.kv_loads):
            return None
        t0 = time.perf_counter()
        self.tier.transfer(self.kv_pool, step.kv_saves, step.kv_loads)
        return time.perf_counter() - t0

    def forward(self, step: StepInput) -> tuple[torch.Tensor, list[list[Logprob]]]:
        """float32 logits of the step's sample rows, and the logprobs its prompt rows asked for."""
        dev = self.device
        meta = AttentionMetadata.build(step.block_tables, step.context_lens, step.query_lens, self.block_size, dev)
        input_ids = stage(torch.tensor(step.input_ids, dtype=torch.long), dev)
        if step.prev_tokens:  # async scheduling: the previous step's tokens, device to device
            rows, samples = stage(torch.tensor(step.prev_tokens, dtype=torch.long).T.contiguous(), dev)
            input_ids[rows] = self.previous_sampled()[samples]
        positions = stage(torch.tensor(step.positions, dtype=torch.long), dev)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        last = (torch.tensor(step.query_lens).cumsum(0) - 1)[step.sample_rows]
        if step.draft_token_ids:  # every position of a draft, and the one after it
            last = torch.tensor(draft_positions(last.tolist(), step.draft_token_ids))
        logits = self.model.compute_logits(hidden[stage(last, dev)])
        return logits, self.prompt_logprobs(hidden, step.prompt_rows) if step.prompt_rows else []

    def previous_sampled(self) -> torch.Tensor:
        if self.sampled is None:
            raise RuntimeError("the step before this one failed: its sampled tokens are not known")
        return self.sampled

    def host_input_ids(self, step: StepInput) -> list[int]:
        """The step's input ids with the previous step's tokens filled in on the host (for the CUDA graphs'
        static buffers; the previous step's ids were read back already, so this waits on nothing)."""
        if not step.prev_tokens:
            return step.input_ids
        ids = list(step.input_ids)
        tokens = self.previous_sampled()[[j for _, j in step.prev_tokens]].tolist()
        for (row, _), token in zip(step.prev_tokens, tokens, strict=True):
            ids[row] = token
        return ids

    def prompt_logprobs(self, hidden: torch.Tensor, rows: list[PromptRows]) -> list[list[Logprob]]:
        """log_softmax of the raw logits at the asked rows: each next token's logprob and rank, and the
        top alternatives. Logits are made ``PROMPT_LOGITS_ROWS`` rows at a time (a chunk's whole
        ``[tokens, vocab]`` float32 logits could take gigabytes)."""
        index = torch.cat([torch.arange(r.start, r.start + len(r.targets)) for r in rows])
        targets = torch.tensor([t for r in rows for t in r.targets], dtype=torch.long, device=self.device)
        width = max(r.num_top for r in rows)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for i in range(0, len(index), PROMPT_LOGITS_ROWS):
            piece = stage(index[i : i + PROMPT_LOGITS_ROWS], self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[piece]), dim=-1)
            value = logprobs.gather(1, targets[i : i + PROMPT_LOGITS_ROWS].unsqueeze(1))
            chosen.append(value.squeeze(1))
            ranks.append((logprobs > value).sum(dim=1) + 1)
            values, ids = logprobs.topk(width, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        # a masked token's -inf has no JSON form: reported as -9999.0, as for sampled tokens
        chosen_l = torch.cat(chosen).clamp_min(MIN_LOGPROB).tolist()
        ranks_l = torch.cat(ranks).tolist()
        top_values_l = torch.cat(top_values).clamp_min(MIN_LOGPROB).tolist()
        top_ids_l = torch.cat(top_ids).tolist()
        out, j = [], 0
        for r in rows:
            lps = []
            for t in r.targets:
                top = list(zip(top_ids_l[j][: r.num_top], top_values_l[j][: r.num_top], strict=True))
                lps.append(Logprob(t, chosen_l[j], top, ranks_l[j]))
                j += 1
            out.append(lps)
        return out

    def _execute_or_error(self, step: StepInput) -> StepOutput:
        try:
            return self.execute(step)
        except WorkerFailed:
            raise
        except Exception as exc:  # a failed step ends its batch, not the engine
            self.sampled = None  # a step that would read its tokens fails too
            return StepOutput(error=f"{type(exc).__name__}: {exc}")

    async def run(
        self,
        steps: MemoryObjectReceiveStream[StepInput],
        results: MemoryObjectSendStream[StepOutput],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the steps in the order sent, on one thread that takes them back to back from a
        thread-safe queue: a step sent while the one before it runs (async scheduling) starts the
        moment that one ends, without waiting for the event loop (busy with that one's result)."""
        queued: queue.SimpleQueue[StepInput | None] = queue.SimpleQueue()
        done: queue.SimpleQueue[StepOutput | BaseException | None] = queue.SimpleQueue()
        async with steps, results, anyio.create_task_group() as tg:
            tg.start_soon(self._send_results, done, results)
            tg.start_soon(lambda: anyio.to_thread.run_sync(self._execute_queued, queued, done, limiter=self.limiter))
            task_status.started()
            try:
                async for step in steps:
                    queued.put(step)
            finally:
                queued.put(None)  # the thread ends after the step it is running

    def _execute_queued(self, queued: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
        try:
            while (step := queued.get()) is not None:
                done.put(self._execute_or_error(step))
        except BaseException as exc:  # WorkerFailed: no later step can run
            done.put(exc)
        finally:
            done.put(None)

    @staticmethod
    async def _send_results(done: queue.SimpleQueue, results: MemoryObjectSendStream[StepOutput]) -> None:
        while (out := await anyio.to_thread.run_sync(done.get, abandon_on_cancel=True)) is not None:
            if isinstance(out, BaseException):
                raise out
            await results.send(out)
