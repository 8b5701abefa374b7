"""The async engine loop: the only async engine code.

    inbox -> scheduler.schedule() -> worker step (channel out, channel back)
          -> postprocess: append token, detokenize, stop checks, send_nowait

Each request owns a ``DeltaStream`` (bounded: a slow reader gets merged
deltas, the engine never waits); every sequence of the request holds a
sender. A closed stream makes the next ``send_nowait`` fail (or is seen
before scheduling) and the sequence is aborted and its blocks freed. A finished sequence sends its last
delta, closes its send stream and is dropped: nothing keeps finished ones.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence as Seq

import anyio
import structlog
import xgrammar as xgr
from anyio.abc import TaskStatus

from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.config import EngineConfig
from atom_anyio.engine.detokenizer import IncrementalDetokenizer
from atom_anyio.engine.grammar import Constraint
from atom_anyio.engine.sampler import SamplingInputs
from atom_anyio.engine.scheduler import ScheduledBatch, Scheduler
from atom_anyio.engine.sequence import Delta, Sequence, Status
from atom_anyio.engine.stream import DeltaStream
from atom_anyio.engine.worker import StepInput, StepOutput, Worker, kv_bytes_per_token
from atom_anyio.models.loader import LoadedModel
from atom_anyio.sampling_params import SamplingParams

log = structlog.get_logger("atom_anyio.engine")


class EngineError(ValueError):
    """A request the engine can never serve (refused at submit)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (crashed or stopped)."""


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
        num_blocks = cfg.num_kv_blocks or max(1, int(cfg.kv_cache_gib * 2**30) // per_block)
        self.block_manager = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_prefix_caching
        )
        self.worker = Worker(loaded.model, num_blocks, cfg.block_size, cfg.cpu_threads)
        self._inbox: list[Sequence] = []
        self._wakeup: anyio.Event | None = None  # created by run(): an Event belongs to one event loop
        self.is_running = False
        self.error: str | None = None  # why the engine stopped serving, when it did
        self.num_consecutive_failures = 0
        self.step_timings: dict[str, float] = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "postprocess": 0.0}
        self.num_steps = 0
        log.info("engine.kv_pool", num_blocks=num_blocks, block_size=cfg.block_size, max_model_len=self.max_model_len)

    # submit

    def submit(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        block_hashes: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> DeltaStream:
        """Queue a request; its deltas arrive on the returned stream, tagged
        with the choice index, until every choice has finished. ``constraint``:
        a compiled grammar every choice's output follows."""
        return self.submit_many([(prompt_token_ids, block_hashes, params, constraint)])

    def submit_many(
        self, prompts: Seq[tuple[Seq[int], list[int] | None, SamplingParams, Constraint | None]]
    ) -> DeltaStream:
        """Several prompts as one request on one stream: prompt ``i``'s
        choices are numbered after those of the prompts before it."""
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine is not running")
        checked = [(list(ids), hashes, params, c, self.check(len(ids), params)) for ids, hashes, params, c in prompts]
        stream = DeltaStream(self.cfg.max_pending_deltas)
        index = 0
        for ids, hashes, params, constraint, max_tokens in checked:
            if hashes is None:
                hashes = block_hash_chain(ids, self.cfg.block_size)
            seqs = [
                self._new_sequence(ids, hashes, params, max_tokens, stream.sender(), index + i, constraint)
                for i in range(params.n)
            ]
            index += params.n
            seqs[0].siblings = seqs[1:]  # released once the first has prefilled the shared prompt
            self._inbox.append(seqs[0])
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

    def check(self, num_prompt: int, params: SamplingParams) -> int:
        """Refuse a request that can never be served; return its max_tokens."""
        if num_prompt == 0:
            raise EngineError("the prompt is empty")
        max_tokens = params.max_tokens or self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion)."
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if num_prompt + max_tokens > capacity:
            raise EngineError(
                f"the request needs {num_prompt + max_tokens} tokens of KV cache but the pool holds {capacity}"
            )
        vocab = self.model_config.vocab_size
        for t in [*params.logit_bias, *params.stop_token_ids]:
            if not 0 <= t < vocab:
                raise EngineError(f"token id {t} is out of range for a vocabulary of {vocab}")
        return max_tokens

    def _new_sequence(self, ids, hashes, params, max_tokens, stream, index, constraint=None) -> Sequence:
        detok = IncrementalDetokenizer(
            self.tokenizer,
            ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        seed = None if params.seed is None else params.seed + index  # choices differ, runs repeat
        seq = Sequence(list(ids), params, stream, detok, list(hashes), index=index, seed=seed)
        seq.max_tokens = max_tokens
        if constraint is not None:  # each choice its own matcher: their outputs differ
            seq.matcher = xgr.GrammarMatcher(constraint.grammar)
            seq.grammar_gate = constraint.start_after
        return seq

    # the loop

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. Every sequence still in flight at exit gets
        an error delta, so no request waits forever."""
        step_tx, step_rx = anyio.create_memory_object_stream[StepInput](1)
        result_tx, result_rx = anyio.create_memory_object_stream[StepOutput](1)
        self._wakeup = anyio.Event()
        try:
            async with anyio.create_task_group() as tg, step_tx, result_rx:
                await tg.start(self.worker.run, step_rx, result_tx)
                self.is_running = True
                self.error = None
                task_status.started()
                await self._serve(step_tx, result_rx)
        except BaseException as exc:
            if not isinstance(exc, anyio.get_cancelled_exc_class()) and self.error is None:
                self.error = f"engine loop crashed: {type(exc).__name__}: {exc}"
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
        step = self._build_step(batch)
        t1 = time.perf_counter()
        await step_tx.send(step)
        result = await result_rx.receive()
        t2 = time.perf_counter()
        self._postprocess(batch, step, result)
        self._account(t1 - t0, result, time.perf_counter() - t2, batch)

    def _admit_inbox(self) -> None:
        for seq in self._inbox:
            self.scheduler.add(seq)
        self._inbox.clear()

    def _reap_abandoned(self) -> None:
        """Abort sequences whose client closed its receive stream."""
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting]:
            if seq.stream.is_abandoned:
                self._abort(seq)

    def _build_step(self, batch: ScheduledBatch) -> StepInput:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        context_lens = []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            context_lens.append(start + n)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            if start + n == len(seq):
                sample_rows.append(row)
                sampled.append(seq)
        sampling = SamplingInputs(
            params=[s.params for s in sampled],
            prompt_token_ids=[s.prompt_token_ids for s in sampled]
            if any(s.params.repetition_penalty != 1.0 for s in sampled)
            else [[] for _ in sampled],
            output_token_ids=[s.output_token_ids for s in sampled],
            seeds=[s.seed for s in sampled],
            eos_token_ids=self.eos_token_ids,
            matchers=[s.active_matcher for s in sampled] if any(s.matcher is not None for s in sampled) else [],
        )
        return StepInput(
            input_ids=input_ids,
            positions=positions,
            block_tables=[s.block_table for s in batch.seqs],
            context_lens=context_lens,
            query_lens=batch.num_tokens,
            sample_rows=sample_rows,
            sampling=sampling,
        )

    def _postprocess(self, batch: ScheduledBatch, step: StepInput, result: StepOutput) -> None:
        if result.error is not None:
            self._fail_batch(batch, result.error)
            return
        self.num_consecutive_failures = 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
            if self.cfg.enable_prefix_caching:
                self.block_manager.commit(seq)
        rejected = set(result.rejected)
        for i, (row, token, lp) in enumerate(zip(step.sample_rows, result.token_ids, result.logprobs, strict=True)):
            if i in rejected:  # cannot happen while the mask is applied; never run past a broken grammar
                self._end_with_error(batch.seqs[row], f"token {token} violates the request's output grammar")
            else:
                self._append_token(batch.seqs[row], token, lp)

    def _append_token(self, seq: Sequence, token: int, lp) -> None:
        if seq.status is not Status.RUNNING:  # aborted while its step ran
            return
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            self._release_siblings(seq)
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
        )
        if finish is not None:
            delta.metrics = self._request_metrics(seq)
        try:
            seq.stream.send_nowait(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._abort(seq)
            return
        if finish is not None:
            self._finish(seq)

    def _release_siblings(self, seq: Sequence) -> None:
        for sib in reversed(seq.siblings):
            self.scheduler.add(sib, front=True)
        seq.siblings = []

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

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seq.stream.close()
        for sib in seq.siblings:  # never released (no token was produced)
            sib.stream.close()
        seq.siblings = []

    def _abort(self, seq: Sequence) -> None:
        for sib in seq.siblings:
            sib.stream.close()
        seq.siblings = []
        self.scheduler.finish(seq)
        seq.stream.close()

    def _end_with_error(self, seq: Sequence, error: str) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            seq.stream.send_nowait(
                Delta(
                    index=seq.index,
                    text="",
                    token_ids=[],
                    finish_reason="error",
                    error=error,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=seq.num_output_tokens,
                )
            )
        for sib in seq.siblings:
            self._end_with_error(sib, error)
        seq.siblings = []
        self.scheduler.finish(seq)
        seq.stream.close()

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> None:
        self.num_consecutive_failures += 1
        log.error("engine.step_failed", error=error, num_seqs=len(batch), consecutive=self.num_consecutive_failures)
        for seq in batch.seqs:
            self._end_with_error(seq, f"model step failed: {error}")
        if self.num_consecutive_failures >= self.cfg.max_consecutive_step_failures:
            self.error = f"{self.num_consecutive_failures} consecutive model steps failed; last: {error}"
            raise RuntimeError(self.error)

    def _end_all(self, error: str) -> None:
        sched = self.scheduler
        for seq in [*sched.running, *sched.waiting, *self._inbox]:
            self._end_with_error(seq, error)
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


def _is_terminated(seq: Sequence) -> bool:
    return seq.active_matcher is not None and seq.active_matcher.is_terminated()
