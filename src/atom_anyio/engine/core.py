"""The async engine loop: the only async engine code.

    inbox -> scheduler.schedule() -> build_step -> worker (channel out, channel back)
          -> OutputProcessor: append token, detokenize, stop checks, send_nowait

Each request owns a ``RequestStream`` (bounded: a slow reader gets merged
deltas, the engine never waits); every sequence of the request holds a
sender. A closed stream makes the next ``send_nowait`` fail (or is seen
before scheduling) and the sequence is aborted and its blocks freed. A finished sequence sends its last
delta, closes its send stream and is dropped: nothing keeps finished ones.

Up to ``depth`` steps are in flight: 1, or 2 with ``async_scheduling``, where the next
step is scheduled and sent while the worker runs this one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Sequence as Seq

import anyio
import structlog
from anyio.abc import TaskStatus

from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.detokenizer import IncrementalDetokenizer
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.in_flight import InFlight
from atom_anyio.engine.kv_events import KVEventPublisher
from atom_anyio.engine.kv_tier import TierIndex, num_tier_slots, tier_medium
from atom_anyio.engine.output_processor import OutputProcessor, StepsFailing
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.sampler import Sampler
from atom_anyio.engine.scheduler import ScheduledBatch, Scheduler
from atom_anyio.engine.sequence import Sequence, num_alive
from atom_anyio.engine.speculative import speculator_for
from atom_anyio.engine.stats import Buckets, EngineStats, SpecStats, TierStats
from atom_anyio.engine.step import StepInput, StepOutput, build_step
from atom_anyio.engine.stream import RequestStream
from atom_anyio.engine.tp_workers import TensorParallelWorker
from atom_anyio.engine.worker import Worker, kv_bytes_per_token, kv_pool_bytes
from atom_anyio.models.attention.metadata import kv_cache_torch_dtype
from atom_anyio.models.loader import LoadedModel

log = structlog.get_logger("atom_anyio.engine")


class EngineStopped(RuntimeError):
    """The engine loop is not running (it crashed or was stopped): nothing can be submitted."""


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig = EngineConfig(), sampler: Sampler | None = None):
        """``sampler``: the worker's (a fake's, in tests); default the real ``Sampler``."""
        cfg.check_loaded_as(loaded.plan)
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.vocab_size = loaded.config.vocab_size  # the logits' width: the grammar masks' too
        self.max_model_len = cfg.max_model_len or loaded.config.max_position_embeddings
        self.eos_token_ids = tuple(loaded.config.eos_token_ids) or tuple(
            t for t in [loaded.tokenizer.eos_token_id] if t is not None
        )
        param = next(loaded.model.parameters())
        kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, param.dtype)
        per_block = kv_bytes_per_token(loaded.model, kv_dtype) * cfg.block_size
        num_blocks = cfg.num_kv_blocks or self._num_pool_blocks(per_block, kv_pool_bytes(cfg, loaded.model))
        self.kv_events = KVEventPublisher(cfg.kv_events) if cfg.kv_events else None  # runs with run()
        # per_block is a rank's (its shard of the KV heads); the size is all ranks' together, as vLLM's
        tier_gib = cfg.kv_offloading_size / cfg.tensor_parallel_size
        tier_slots = num_tier_slots(tier_gib, per_block) if cfg.enable_prefix_caching else 0
        medium = tier_medium(param.device)
        self.block_manager = BlockManager(
            num_blocks,
            cfg.block_size,
            record_events=self.kv_events is not None,
            lease_ttl_s=cfg.kv_lease_ttl_s,
            lease_fraction=cfg.kv_lease_fraction,
            tier=TierIndex(tier_slots, cfg.block_size, medium, self.kv_events is not None) if tier_slots else None,
        )
        plan = loaded.plan  # a draft's step gives a plain decode's bits where the kernels are batch-invariant
        exact = plan is not None and bool(plan.batch_invariant)
        self.speculator = speculator_for(cfg.speculative_config, cfg.async_scheduling, exact)
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.enable_prefix_caching,
            self.speculator,
            by_priority=cfg.scheduling_policy == "priority",
        )
        graphs = (self.max_model_len, cfg.max_num_seqs) if cfg.cuda_graphs else None
        if cfg.tensor_parallel_size > 1:  # rank 0, driving the other ranks' processes
            self.worker = TensorParallelWorker(loaded, num_blocks, cfg, sampler, tier_slots)
        else:
            self.worker = Worker(
                loaded.model,
                num_blocks,
                cfg.block_size,
                cfg.cpu_threads,
                decode_graphs=graphs,
                tier_slots=tier_slots,
                tier_dir=cfg.kv_offloading_dir,
                sampler=sampler,
                kv_cache_dtype=cfg.kv_cache_dtype,
            )
        self.outputs = OutputProcessor(
            self.scheduler,
            self.block_manager,
            self.eos_token_ids,
            self.max_model_len,
            cfg.enable_prefix_caching,
            cfg.max_consecutive_step_failures,
            self.speculator,
        )
        self.depth = 2 if cfg.async_scheduling else 1  # steps in flight at once
        self._inbox: list[Sequence] = []
        self._in_flight: deque[InFlight] = deque()  # at most ``depth`` steps
        self._wakeup: anyio.Event | None = None  # created by run(): an Event belongs to one event loop
        self.is_running = False
        self.error: str | None = None  # why the engine stopped serving, when it did
        self.step_timings: dict[str, float] = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "postprocess": 0.0}
        self.num_steps = 0
        self.step_seconds, self.tier_copy_seconds = Buckets(), Buckets()  # for /metrics: fixed sizes
        self.kv_bytes_per_block = per_block
        log.info(
            "engine.kv_pool",
            num_tokens=num_blocks * cfg.block_size,
            num_blocks=num_blocks,
            gib=round(num_blocks * per_block / 2**30, 3),
            dtype=str(kv_dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            huge_pages=self.worker.kv_huge_pages,
            tier_blocks=tier_slots,
            tier_gib=round(tier_slots * per_block / 2**30, 3),
        )

    def _num_pool_blocks(self, bytes_per_block: int, pool_bytes: int) -> int:
        """The ``pool_bytes`` budget (``kv_pool_bytes``), or less when ``max_num_seqs`` sequences of ``max_model_len``
        tokens cannot use it all (a 135M model need not hold 2 GiB at idle)."""
        cfg = self.cfg
        budget = max(1, pool_bytes // bytes_per_block)
        usable = cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size)
        return min(budget, usable)

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache's configuration as vLLM's ``vllm:cache_config_info`` labels (its ``CacheConfig``'s
        fields as strings, the pool's size resolved), which KV-aware routers read for a replica's
        capacity (``num_gpu_blocks`` x ``block_size`` tokens; vLLM on a CPU names its pool so too)."""
        cfg, bm = self.cfg, self.block_manager
        tokens = bm.num_blocks * bm.block_size
        return {
            "block_size": str(bm.block_size),
            "cache_dtype": cfg.kv_cache_dtype,
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "prefix_caching_hash_algo": "builtin",
            "num_gpu_blocks": str(bm.num_blocks),
            "num_gpu_blocks_override": str(cfg.num_kv_blocks),
            "num_cpu_blocks": "None",
            "kv_cache_memory_bytes": str(bm.num_blocks * self.kv_bytes_per_block * cfg.tensor_parallel_size),
            "kv_cache_size_tokens": str(tokens),
            "kv_cache_max_concurrency": str(tokens / self.max_model_len),
            "kv_offloading_size": str(cfg.kv_offloading_size) if bm.tier is not None else "None",
            "sliding_window": str(getattr(self.model_config, "sliding_window", None)),
        }

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens (prompt and completion) one sequence can hold in the pool."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    # submit

    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request; its deltas arrive on the returned stream, tagged
        with the choice index, until every choice has finished."""
        return self.submit_many([request])

    def submit_many(self, requests: Seq[EngineRequest]) -> RequestStream:
        """Several prompts as one request on one stream: prompt ``i``'s
        choices are numbered after those of the prompts before it."""
        if not self.is_running:
            raise EngineStopped(self.error or "the engine is not running")
        stream = RequestStream(self.cfg.max_pending_deltas)
        index = 0
        for request in requests:
            assert (
                request.num_prompt_tokens > 0 and request.num_prompt_tokens + request.max_tokens <= self.max_kv_tokens
            )
            assert request.num_prompt_tokens + request.max_tokens <= self.max_model_len
            n = request.params.n
            siblings = [self._new_sequence(request, stream, index + i) for i in range(1, n)]
            self._inbox.append(self._new_sequence(request, stream, index, siblings))  # siblings wait for its prefill
            index += n
        self._wakeup.set()
        return stream

    def stats(self) -> EngineStats:
        sched, bm, spec = self.scheduler, self.block_manager, self.speculator
        return EngineStats(
            num_running=len(sched.running),
            num_scheduled_waiting=len(sched.waiting),
            num_waiting_seqs=self.num_waiting_seqs,
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            num_prefix_queried_tokens=bm.num_queried_tokens,
            num_prefix_hit_tokens=bm.num_hit_tokens,
            num_leased_blocks=bm.num_leased_blocks,
            num_leased_hit_tokens=bm.num_leased_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_sequences_alive=num_alive(),
            num_kv_events_dropped=None if self.kv_events is None else self.kv_events.num_dropped,
            tier=None
            if (tier := bm.tier) is None
            else TierStats(
                tier.num_slots,
                len(tier),
                tier.num_saved_blocks,
                tier.num_restored_blocks,
                bm.num_tier_queried_tokens,
                bm.num_tier_hit_tokens,
                self.tier_copy_seconds.snapshot(),
            ),
            step_seconds=self.step_seconds.snapshot(),
            spec=None
            if spec is None
            else SpecStats(
                spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, tuple(spec.num_accepted_per_pos)
            ),
        )

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences submitted and not yet running (unreleased choices of n > 1 included)."""
        return sum(1 + len(s.siblings) for s in (*self._inbox, *self.scheduler.waiting))

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences have yet to prefill (a choice of n > 1 counts its prompt)."""
        return sum(len(s) * (1 + len(s.siblings)) for s in (*self._inbox, *self.scheduler.waiting))

    def _new_sequence(
        self, request: EngineRequest, stream: RequestStream, index: int, siblings: Seq[Sequence] = ()
    ) -> Sequence:
        params = request.params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        return Sequence(request, stream.sender(), detok, index, siblings)

    # the loop

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. Every sequence still in flight at exit gets
        an error delta, so no request waits forever."""
        step_tx, step_rx = anyio.create_memory_object_stream[StepInput](1)
        result_tx, result_rx = anyio.create_memory_object_stream[StepOutput](1)
        self._wakeup = anyio.Event()
        try:
            async with anyio.create_task_group() as tg, step_tx, result_rx, self.kv_events or contextlib.nullcontext():
                await tg.start(self.worker.run, step_rx, result_tx)
                self.is_running = True
                self.error = None
                task_status.started()
                await self._serve(step_tx, result_rx)
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                self._record_crash(exc)
            raise
        finally:
            self.is_running = False
            self._end_all(self.error or "the engine stopped")

    def _record_crash(self, exc: BaseException) -> None:
        cause = _crash_cause(exc)
        if self.error is None and isinstance(cause, StepsFailing):
            self.error = str(cause)
        if self.error is None:
            self.error = f"engine loop crashed: {type(cause).__name__}: {cause}"
            log.exception("engine.crashed")
        else:
            log.error("engine.unhealthy", error=self.error)

    async def _serve(self, step_tx, result_rx) -> None:
        while True:
            self._admit_inbox()
            self._reap_abandoned()
            if not self.scheduler.has_work and not self._in_flight:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            await self._step(step_tx, result_rx)

    async def _step(self, step_tx, result_rx) -> None:
        """One round: schedule a step and send it; then, with ``depth`` steps in flight or nothing new
        to send, process the oldest one's result. At depth 2 the next step is scheduled as if the step
        in flight had sampled one token for each of its sampling rows (the worker fills those in), and
        runs while the loop processes that one's result. Its locals (the batch and so its sequences)
        die when it returns, not when the loop next wakes."""
        in_flight = self._in_flight
        t0 = time.perf_counter()
        batch = self.scheduler.schedule() if self.scheduler.has_work else ScheduledBatch()
        if batch.seqs:
            prev_rows = in_flight[-1].sample_rows() if in_flight else {}
            step = build_step(batch, self.eos_token_ids, self.vocab_size, prev_rows, copy_tables=self.depth > 1)
            in_flight.append(sent := InFlight(batch, step, time.perf_counter() - t0))
            sent.hold()
            await step_tx.send(step)  # the worker takes it as soon as the step before it ends
            if len(in_flight) < self.depth:
                return  # schedule the next one while this one runs
        elif not in_flight:  # nothing fits right now (cannot happen with a sane pool): yield and retry
            await anyio.sleep(0)
            return
        result = await result_rx.receive()
        done = in_flight.popleft()  # after the wait: a cancelled loop still finds it in _end_all
        t2 = time.perf_counter()
        self.outputs.process(done, result, in_flight)
        if self.kv_events is not None and (events := self.block_manager.take_events()):
            self.kv_events.publish(events)
        self._account(done.schedule_s, result, time.perf_counter() - t2, done.batch)

    def _admit_inbox(self) -> None:
        for seq in self._inbox:
            self.scheduler.add(seq)
        self._inbox.clear()

    def _reap_abandoned(self) -> None:
        """Abort sequences whose client closed its receive stream."""
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            if seq.stream.is_abandoned:
                self.outputs.retire(seq)

    def _end_all(self, error: str) -> None:
        for done in self._in_flight:  # the worker is done with them: the loop's task group has exited
            done.settle()
            for seq in done.batch.seqs:
                if seq.is_finished:
                    self.block_manager.free_seq(seq)
        self._in_flight.clear()
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting, *self._inbox]:
            self.outputs.retire(seq, error)
        self._inbox.clear()

    def _account(self, schedule_s: float, result: StepOutput, post_s: float, batch: ScheduledBatch) -> None:
        t = self.step_timings
        t["schedule"] += schedule_s
        t["forward"] += (forward := result.timings.get("forward", 0.0))
        t["sample"] += (sample := result.timings.get("sample", 0.0))
        self.step_seconds.observe(forward + sample)
        if "kv_copy" in result.timings:
            self.tier_copy_seconds.observe(result.timings["kv_copy"])
        t["postprocess"] += post_s
        self.num_steps += 1
        if batch.num_preempted:
            log.info("engine.preempted", num_seqs=batch.num_preempted, free_blocks=self.block_manager.num_free_blocks)


def _crash_cause(exc: BaseException) -> BaseException:
    """What crashed the loop: out of a task group's errors, the first that is not the closed channel it left."""
    while isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(anyio.EndOfStream)
        exc = (rest or exc).exceptions[0]
    return exc
