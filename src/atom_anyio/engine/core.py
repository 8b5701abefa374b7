"""The async engine loop: the only async engine code.

    inbox -> scheduler.schedule() -> worker step (channel out, channel back)
          -> postprocess: append token, detokenize, stop checks, send_nowait

Each request owns a ``DeltaStream`` (bounded: a slow reader gets merged
deltas, the engine never waits); every sequence of the request holds a
sender. A closed stream makes the next ``send_nowait`` fail (or is seen
before scheduling) and the sequence is aborted and its blocks freed. A finished sequence sends its last
delta, closes its send stream and is dropped: nothing keeps finished ones.

With ``async_scheduling`` the next step is scheduled and sent while the worker
runs this one (``_overlapped_step``); the synchronous round is unchanged.
"""

from __future__ import annotations

import contextlib
import math
import time
from array import array
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import TaskStatus

from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.detokenizer import IncrementalDetokenizer
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.scheduler import ScheduledBatch, Scheduler
from atom_anyio.engine.sequence import Sequence, Status
from atom_anyio.engine.step import StepInput, StepOutput, build_step
from atom_anyio.engine.stream import Delta, DeltaStream, Logprob
from atom_anyio.engine.tp_workers import TensorParallelWorker
from atom_anyio.engine.worker import Worker, kv_bytes_per_token, kv_pool_bytes
from atom_anyio.models.loader import LoadedModel
from atom_anyio.obs.kv_events import KVEventPublisher

log = structlog.get_logger("atom_anyio.engine")


class EngineStopped(RuntimeError):
    """The engine loop is not running (it crashed or was stopped): nothing can be submitted."""


@dataclass
class InFlight:
    """Async scheduling: a step sent to the worker whose result is not yet postprocessed."""

    batch: ScheduledBatch
    step: StepInput
    schedule_s: float
    failed: bool = False  # its sequences failed with the step before it: its result is dropped

    def sample_rows(self) -> dict[int, int]:
        """Each sampling sequence's sample row in this step, by ``seq_id``."""
        return {self.batch.seqs[row].seq_id: j for j, row in enumerate(self.step.sample_rows)}


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig = EngineConfig()):
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = cfg.max_model_len or loaded.config.max_position_embeddings
        self.eos_token_ids = tuple(loaded.config.eos_token_ids) or tuple(
            t for t in [loaded.tokenizer.eos_token_id] if t is not None
        )
        param = next(loaded.model.parameters())
        per_block = kv_bytes_per_token(loaded.model, param.dtype) * cfg.block_size
        num_blocks = cfg.num_kv_blocks or self._num_pool_blocks(per_block, kv_pool_bytes(cfg, loaded.model))
        self.kv_events = KVEventPublisher(cfg.kv_events) if cfg.kv_events else None  # runs with run()
        self.block_manager = BlockManager(num_blocks, cfg.block_size, record_events=self.kv_events is not None)
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching
        )
        graphs = (self.max_model_len, cfg.max_num_seqs) if cfg.cuda_graphs else None
        if cfg.tensor_parallel_size > 1:  # rank 0, driving the other ranks' processes
            self.worker = TensorParallelWorker(loaded, num_blocks, cfg)
        else:
            self.worker = Worker(
                loaded.model,
                num_blocks,
                cfg.block_size,
                cfg.cpu_threads,
                decode_graphs=graphs,
                native_kernels=cfg.cpu_native_kernels,
            )
        self._inbox: list[Sequence] = []
        self._in_flight: deque[InFlight] = deque()  # async scheduling: at most two steps
        self._wakeup: anyio.Event | None = None  # created by run(): an Event belongs to one event loop
        self.is_running = False
        self.error: str | None = None  # why the engine stopped serving, when it did
        self.num_consecutive_failures = 0
        self.step_timings: dict[str, float] = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "postprocess": 0.0}
        self.num_steps = 0
        log.info(
            "engine.kv_pool",
            num_tokens=num_blocks * cfg.block_size,
            num_blocks=num_blocks,
            gib=round(num_blocks * per_block / 2**30, 3),
            max_model_len=self.max_model_len,
        )

    def _num_pool_blocks(self, bytes_per_block: int, pool_bytes: int) -> int:
        """The ``pool_bytes`` budget (``kv_pool_bytes``), or less when ``max_num_seqs`` sequences of ``max_model_len``
        tokens cannot use it all (a 135M model need not hold 2 GiB at idle)."""
        cfg = self.cfg
        budget = max(1, pool_bytes // bytes_per_block)
        usable = cfg.max_num_seqs * math.ceil(self.max_model_len / cfg.block_size)
        return min(budget, usable)

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens (prompt and completion) one sequence can hold in the pool."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    # submit

    def submit(self, request: EngineRequest) -> DeltaStream:
        """Queue a request; its deltas arrive on the returned stream, tagged
        with the choice index, until every choice has finished."""
        return self.submit_many([request])

    def submit_many(self, requests: Seq[EngineRequest]) -> DeltaStream:
        """Several prompts as one request on one stream: prompt ``i``'s
        choices are numbered after those of the prompts before it."""
        if not self.is_running:
            raise EngineStopped(self.error or "the engine is not running")
        stream = DeltaStream(self.cfg.max_pending_deltas)
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

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences submitted and not yet running (unreleased choices of n > 1 included)."""
        return sum(1 + len(s.siblings) for s in (*self._inbox, *self.scheduler.waiting))

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences have yet to prefill (a choice of n > 1 counts its prompt)."""
        return sum(len(s) * (1 + len(s.siblings)) for s in (*self._inbox, *self.scheduler.waiting))

    def _new_sequence(
        self, request: EngineRequest, stream: DeltaStream, index: int, siblings: Seq[Sequence] = ()
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
                overlapped = self.cfg.async_scheduling
                await tg.start(self.worker.run_overlapped if overlapped else self.worker.run, step_rx, result_tx)
                self.is_running = True
                self.error = None
                task_status.started()
                await (self._serve_overlapped if overlapped else self._serve)(step_tx, result_rx)
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()) and self.error is None:
                cause = _crash_cause(exc)
                self.error = f"engine loop crashed: {type(cause).__name__}: {cause}"
                log.exception("engine.crashed")
            elif self.error is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
                log.error("engine.unhealthy", error=self.error)
            raise
        finally:
            self.is_running = False
            self._end_all(self.error or "the engine stopped")

    async def _serve(self, step_tx, result_rx) -> None:
        sched = self.scheduler
        while True:
            self._admit_inbox()
            self._reap_abandoned()
            if not sched.has_work:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            await self._step(step_tx, result_rx)

    async def _step(self, step_tx, result_rx) -> None:
        """One schedule-run-postprocess round. Its locals (the batch and so
        its sequences) die when it returns, not when the loop next wakes."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:  # nothing fits right now (cannot happen with a sane pool): yield and retry
            await anyio.sleep(0)
            return
        step = build_step(batch, self.eos_token_ids)
        t1 = time.perf_counter()
        await step_tx.send(step)
        result = await result_rx.receive()
        t2 = time.perf_counter()
        self._postprocess(batch, step, result)
        if self.kv_events is not None and (events := self.block_manager.take_events()):
            self.kv_events.publish(events)
        self._account(t1 - t0, result, time.perf_counter() - t2, batch)

    async def _serve_overlapped(self, step_tx, result_rx) -> None:
        sched = self.scheduler
        while True:
            self._admit_inbox()
            self._reap_abandoned()
            if not sched.has_work and not self._in_flight:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            await self._overlapped_step(step_tx, result_rx)

    async def _overlapped_step(self, step_tx, result_rx) -> None:
        """Async scheduling's round: schedule a step as if the step in flight had sampled one token
        for each of its sampling rows (the worker fills those in) and send it; then, with two steps
        in flight or nothing new to send, postprocess the older one's result while the newer runs.
        Its locals die when it returns, as ``_step``'s do."""
        in_flight = self._in_flight
        t0 = time.perf_counter()
        batch = self.scheduler.schedule() if self.scheduler.has_work else ScheduledBatch()
        if batch.seqs:
            step = build_step(batch, self.eos_token_ids, in_flight[-1].sample_rows() if in_flight else {})
            # copies: scheduling the next step grows these tables while this step runs
            step.block_tables = [array("i", table) for table in step.block_tables]
            for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
                seq.num_scheduled_tokens += n
            for row in step.sample_rows:
                batch.seqs[row].num_placeholders += 1
            in_flight.append(InFlight(batch, step, time.perf_counter() - t0))
            await step_tx.send(step)  # the worker takes it as soon as the step before it ends
            if len(in_flight) == 1:
                return  # schedule the next one while this one runs
        elif not in_flight:  # nothing fits right now: yield and retry, as _step does
            await anyio.sleep(0)
            return
        result = await result_rx.receive()
        done = in_flight.popleft()  # after the wait: a cancelled loop still finds it in _end_all
        t2 = time.perf_counter()
        self._postprocess_overlapped(done, result)
        if self.kv_events is not None and (events := self.block_manager.take_events()):
            self.kv_events.publish(events)
        self._account(done.schedule_s, result, time.perf_counter() - t2, done.batch)

    def _postprocess_overlapped(self, done: InFlight, result: StepOutput) -> None:
        """``_postprocess`` for a step that may have a later one in flight: a sequence that ended
        meanwhile has its token dropped, and its blocks are freed once no step in flight has it."""
        batch = done.batch
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_scheduled_tokens -= n
        for row in done.step.sample_rows:
            batch.seqs[row].num_placeholders -= 1
        if result.error is not None and not done.failed:
            for later in self._in_flight:  # their inputs came from this step's tokens
                later.failed = True
            seqs = [*batch.seqs, *(s for later in self._in_flight for s in later.batch.seqs)]
            self._fail_batch(ScheduledBatch([s for s in dict.fromkeys(seqs) if not s.is_finished]), result.error)
        elif not done.failed:
            self._postprocess(batch, done.step, result)
        for seq in batch.seqs:
            if seq.is_finished and not seq.num_scheduled_tokens:
                self.block_manager.free_seq(seq)

    def _admit_inbox(self) -> None:
        for seq in self._inbox:
            self.scheduler.add(seq)
        self._inbox.clear()

    def _reap_abandoned(self) -> None:
        """Abort sequences whose client closed its receive stream."""
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            if seq.stream.is_abandoned:
                self._retire(seq)

    def _postprocess(self, batch: ScheduledBatch, step: StepInput, result: StepOutput) -> None:
        if result.error is not None:
            self._fail_batch(batch, result.error)
            return
        self.num_consecutive_failures = 0
        for rows, lps in zip(step.prompt_rows, result.prompt_logprobs, strict=True):
            batch.seqs[rows.row].prompt_logprobs += lps
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.is_finished:  # async scheduling: it ended while this step ran
                continue
            seq.num_computed_tokens += n
            if self.cfg.enable_prefix_caching:
                self.block_manager.commit(seq)
            if seq.max_tokens == 0 and not seq.num_uncomputed_tokens:
                self._end_prefill_only(seq)
        rejected = set(result.rejected)
        for i, (row, token, lp) in enumerate(zip(step.sample_rows, result.token_ids, result.logprobs, strict=True)):
            if i in rejected:  # cannot happen while the mask is applied; never run past a broken grammar
                self._retire(batch.seqs[row], f"token {token} violates the request's output grammar")
            else:
                self._append_token(batch.seqs[row], token, lp)

    def _append_token(self, seq: Sequence, token: int, lp) -> None:
        if seq.status is not Status.RUNNING:  # aborted while its step ran
            return
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            self._release_siblings(seq)
        if seq.reasoning_budget is not None:
            token, lp = _within_reasoning_budget(seq, token, lp)
        seq.token_ids.append(token)
        if seq.grammar_gate and seq.token_ids[-len(seq.grammar_gate) :] == list(seq.grammar_gate):
            seq.grammar_gate = ()  # the reasoning block closed: the grammar applies from the next token
        params, detok = seq.params, seq.detokenizer
        finish, stop_reason = None, None
        # a terminated grammar ends the output even under ignore_eos: it allows nothing more
        is_eos = token in self.eos_token_ids and (not params.ignore_eos or _is_terminated(seq))
        if is_eos or token in params.stop_token_ids:
            finish, stop_reason = "stop", None if is_eos else token
            text = detok.flush()
        else:
            text = detok.add_token(token)
            if detok.stop_matched is not None:
                finish, stop_reason = "stop", detok.stop_matched
            elif seq.num_output_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
                finish = "length"
                text += detok.flush()
        delta = Delta(
            index=seq.index,
            text=text,
            token_ids=[token],
            logprobs=[lp] if lp is not None else None,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            prompt_logprobs=seq.take_prompt_logprobs(),
        )
        if finish is not None:
            delta.metrics = self._request_metrics(seq)
        try:
            seq.stream.send_nowait(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._retire(seq)  # the reader left
            return
        if finish is not None:
            self._retire(seq)

    def _release_siblings(self, seq: Sequence) -> None:
        for sib in reversed(seq.siblings):
            sib.prompt_logprobs = list(seq.prompt_logprobs)  # the same prompt: computed once, its prefix is cached
            self.scheduler.add(sib, front=True)
        seq.siblings = []

    def _end_prefill_only(self, seq: Sequence) -> None:
        """A request for the prompt alone (``max_tokens`` 0: its prompt logprobs) ends after its
        prefill, with no token sampled; its choices end together, sharing one prefill."""
        seq.first_token_time = time.monotonic()
        prompt_logprobs = seq.take_prompt_logprobs()  # None when not asked; never changed once taken
        for s in (seq, *seq.siblings):
            delta = Delta(
                index=s.index,
                text="",
                token_ids=[],
                finish_reason="length",
                num_prompt_tokens=s.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                prompt_logprobs=prompt_logprobs,
                metrics=self._request_metrics(seq),
            )
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                s.stream.send_nowait(delta)
        self._retire(seq)

    @staticmethod
    def _request_metrics(seq: Sequence) -> dict[str, float]:
        now = time.monotonic()
        first_sched = seq.first_scheduled_time or now
        first_tok = seq.first_token_time or now
        return {
            "queue_time": first_sched - seq.arrival_time,
            "ttft": first_tok - seq.arrival_time,
            "e2e": now - seq.arrival_time,
        }

    def _retire(self, seq: Sequence, error: str | None = None) -> None:
        """The one way out of the engine (finished, aborted or failed): the choices not yet
        released end with it, with an error delta each when ``error`` is given; blocks are freed
        and the senders closed, after which nothing refers to the sequences."""
        for s in (seq, *seq.siblings):
            if error is not None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    s.stream.send_nowait(_error_delta(s, error))
            s.stream.close()
        seq.siblings = []
        self.scheduler.finish(seq)

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> None:
        self.num_consecutive_failures += 1
        log.error("engine.step_failed", error=error, num_seqs=len(batch), consecutive=self.num_consecutive_failures)
        for seq in batch.seqs:
            self._retire(seq, f"model step failed: {error}")
        if self.num_consecutive_failures >= self.cfg.max_consecutive_step_failures:
            self.error = f"{self.num_consecutive_failures} consecutive model steps failed; last: {error}"
            raise RuntimeError(self.error)

    def _end_all(self, error: str) -> None:
        for done in self._in_flight:  # the worker is done with them: the loop's task group has exited
            for seq in done.batch.seqs:
                seq.num_scheduled_tokens = seq.num_placeholders = 0
                if seq.is_finished:
                    self.block_manager.free_seq(seq)
        self._in_flight.clear()
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting, *self._inbox]:
            self._retire(seq, error)
        self._inbox.clear()

    def _account(self, schedule_s: float, result: StepOutput, post_s: float, batch: ScheduledBatch) -> None:
        t = self.step_timings
        t["schedule"] += schedule_s
        t["forward"] += result.timings.get("forward", 0.0)
        t["sample"] += result.timings.get("sample", 0.0)
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


def _is_terminated(seq: Sequence) -> bool:
    return seq.active_matcher is not None and seq.active_matcher.is_terminated()


def _within_reasoning_budget(seq: Sequence, token: int, lp: Logprob | None) -> tuple[int, Logprob | None]:
    """The token to append: past the budget, the reasoning block's end tag instead of the sampled
    one (no logprob: the model did not choose it). Clears the budget once the block has closed."""
    budget = seq.reasoning_budget
    assert budget is not None
    end = budget.end_token_ids
    num_forced = seq.num_output_tokens - budget.num_tokens
    if num_forced >= 0:
        token, lp = end[num_forced], None
    if num_forced >= len(end) - 1 or [*seq.token_ids[len(seq.token_ids) - len(end) + 1 :], token] == list(end):
        seq.reasoning_budget = None
    return token, lp


def _error_delta(seq: Sequence, error: str) -> Delta:
    return Delta(
        index=seq.index,
        text="",
        token_ids=[],
        finish_reason="error",
        error=error,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
    )
