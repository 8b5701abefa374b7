"""A step's result, turned into deltas: append each sampled token, detokenize, stop checks,
``send_nowait``; and the one way out of the engine for a sequence (``retire``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection
from dataclasses import dataclass

import anyio
import structlog

from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.in_flight import InFlight
from atom_anyio.engine.scheduler import ScheduledBatch, Scheduler
from atom_anyio.engine.sequence import Sequence, Status
from atom_anyio.engine.speculative import Speculator
from atom_anyio.engine.step import StepInput, StepOutput
from atom_anyio.engine.stream import ChoiceDelta, Logprob

log = structlog.get_logger("atom_anyio.engine")


class StepsFailing(RuntimeError):
    """``max_consecutive_step_failures`` model steps failed in a row: the engine stops."""


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        enable_prefix_caching: bool,
        max_consecutive_step_failures: int,
        speculator: Speculator | None = None,
    ):
        self.scheduler = scheduler
        self.speculator = speculator
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.num_consecutive_failures = 0

    def process(self, done: InFlight, result: StepOutput, later: Collection[InFlight]) -> None:
        """The result of ``done``, whose ``later`` steps may be in flight (async scheduling): a sequence
        that ended meanwhile has its token dropped, and its blocks are freed once no step in flight has it."""
        batch = done.batch
        done.settle()
        if result.error is not None and not done.failed:
            for step in later:  # their inputs came from this step's tokens
                step.failed = True
            seqs = [*batch.seqs, *(s for step in later for s in step.batch.seqs)]
            self._fail([s for s in dict.fromkeys(seqs) if not s.is_finished], result.error)
        elif not done.failed:
            self._process_tokens(batch, done.step, result)
        for seq in batch.seqs:
            if seq.is_finished and not seq.num_scheduled_tokens:
                self.block_manager.free_seq(seq, lease=True)

    def _process_tokens(self, batch: ScheduledBatch, step: StepInput, result: StepOutput) -> None:
        self.num_consecutive_failures = 0
        for rows, lps in zip(step.prompt_rows, result.prompt_logprobs, strict=True):
            batch.seqs[rows.row].prompt_logprobs += lps
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.is_finished:  # async scheduling: it ended while this step ran
                continue
            seq.num_computed_tokens += n - len(batch.drafts.get(seq.seq_id, ()))  # a draft's KV: once accepted
            if self.enable_prefix_caching:
                self.block_manager.commit(seq)
            if seq.max_tokens == 0 and not seq.num_uncomputed_tokens:
                self._end_prefill_only(seq)
        drafts = step.draft_token_ids or [[]] * len(step.sample_rows)
        accepted = result.num_accepted or [0] * len(step.sample_rows)
        first = 0  # each sample row's first position in the result
        for row, draft, num_accepted in zip(step.sample_rows, drafts, accepted, strict=True):
            seq, end = batch.seqs[row], first + num_accepted + 1
            if draft and self.speculator is not None:
                self.speculator.verified(seq, len(draft), num_accepted)
            if seq.status is Status.RUNNING:  # not aborted while its step ran
                decided = decide(seq, result.token_ids[first:end], result.logprobs[first:end])
                if isinstance(decided, Refused):  # the request's grammar admits no token here: its fault
                    self.retire(seq, decided.message, decided.param)
                elif isinstance(decided, str):  # cannot happen while the mask applies; never run past a broken grammar
                    self.retire(seq, decided)
                else:
                    self._append_tokens(seq, *decided, bool(draft))
            first += len(draft) + 1

    def _append_tokens(self, seq: Sequence, tokens: list[int], lps: list, drafted: bool) -> None:
        """A step's tokens for ``seq`` (an accepted draft and the token after it), in one delta; the
        output ends at the first that finishes it. Accepted draft tokens' KV was computed in the step."""
        delta = self._append_token(seq, tokens[0], lps[0])
        for token, lp in zip(tokens[1:], lps[1:], strict=True):
            if delta.finish_reason is not None:
                break
            delta.merge(self._append_token(seq, token, lp))
        if drafted and delta.finish_reason is None:
            seq.num_computed_tokens = len(seq) - 1
            if self.enable_prefix_caching:
                self.block_manager.commit(seq)
            self.block_manager.shrink(seq)  # blocks that held only rejected draft tokens
        self._send(seq, delta)

    def _append_token(self, seq: Sequence, token: int, lp) -> ChoiceDelta:
        """Append one token (as ``decide`` chose it): the stop checks; its delta."""
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
        delta = ChoiceDelta(
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
            delta.metrics = _request_metrics(seq)
            delta.num_draft_tokens, delta.num_accepted_tokens = seq.num_draft_tokens, seq.num_accepted_tokens
            delta.num_closing_tokens = seq.num_closing_tokens
        return delta

    def _send(self, seq: Sequence, delta: ChoiceDelta) -> None:
        try:
            seq.stream.send_nowait(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.retire(seq)  # the reader left
            return
        if delta.finish_reason is not None:
            self.retire(seq)

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
            delta = ChoiceDelta(
                index=s.index,
                text="",
                token_ids=[],
                finish_reason="length",
                num_prompt_tokens=s.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                prompt_logprobs=prompt_logprobs,
                metrics=_request_metrics(seq),
            )
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                s.stream.send_nowait(delta)
        self.retire(seq)

    def retire(self, seq: Sequence, error: str | None = None, error_param: str | None = None) -> None:
        """The one way out of the engine (finished, aborted or failed): the choices not yet
        released end with it, with an error delta each when ``error`` is given (``error_param``:
        the request's field at fault, where the request caused it); blocks are freed and the
        senders closed, after which nothing refers to the sequences."""
        if self.speculator is not None and error is None:
            self.speculator.finished(seq)
        for s in (seq, *seq.siblings):
            if error is not None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    s.stream.send_nowait(_error_delta(s, error, error_param))
            s.stream.close()
        seq.siblings = []
        self.scheduler.finish(seq)

    def _fail(self, seqs: list[Sequence], error: str) -> None:
        self.num_consecutive_failures += 1
        log.error("engine.step_failed", error=error, num_seqs=len(seqs), consecutive=self.num_consecutive_failures)
        for seq in seqs:
            self.retire(seq, f"model step failed: {error}")
        if self.num_consecutive_failures >= self.max_consecutive_step_failures:
            raise StepsFailing(f"{self.num_consecutive_failures} consecutive model steps failed; last: {error}")


def _request_metrics(seq: Sequence) -> dict[str, float]:
    now = time.monotonic()
    first_sched = seq.first_scheduled_time or now
    first_tok = seq.first_token_time or now
    return {
        "queue_time": first_sched - seq.arrival_time,
        "ttft": first_tok - seq.arrival_time,
        "e2e": now - seq.arrival_time,
    }


def _is_terminated(seq: Sequence) -> bool:
    return seq.active_matcher is not None and seq.active_matcher.is_terminated()


@dataclass(frozen=True)
class Refused:
    """Why a request's own grammar cannot go on (it admits no token here), and its field."""

    message: str
    param: str


def decide(seq: Sequence, tokens: list[int], lps: list[Logprob | None]) -> tuple[list[int], list] | str | Refused:
    """The one place a step's sampled tokens for ``seq`` become the tokens it appends: a reasoning
    block past its budget takes its end tag, a constrained row winding down keeps room to close its
    grammar (wind_down.py), and the grammar is advanced by each token. A token the model did not
    choose has no logprob. Returns the tokens and logprobs, or why the grammar refused one (then
    nothing is appended). A row with a draft (several tokens) has neither a budget nor a wind-down
    (the speculator drafts for neither). A grammar that admits no token at all here is the
    request's fault (``Refused``: a 400 naming its field), not a broken mask."""
    matcher = seq.active_matcher  # before the tokens: the end tag that closes a reasoning block is not the grammar's
    if seq.reasoning_budget is not None:
        token, lp = _within_reasoning_budget(seq, tokens[0], lps[0])
        tokens, lps = [token], [lp]
    elif (closing := seq.closing) is not None and (token := closing.replacement(matcher, tokens[0])) is not None:
        tokens, lps = [token], [None]
        seq.num_closing_tokens += 1
    if matcher is not None:
        for i, token in enumerate(tokens):
            if not matcher.accept_token(token):
                if seq.constraint is not None and not seq.constraint.admits_a_token(matcher):
                    param, n = seq.constraint.param, seq.num_output_tokens + i
                    why = f"no token of the vocabulary can follow its first {n} tokens"
                    return Refused(f"the grammar admits no output: {why}", param)
                return f"token {token} violates the request's output grammar"
    return tokens, lps


def _within_reasoning_budget(seq: Sequence, token: int, lp: Logprob | None) -> tuple[int, Logprob | None]:
    """The token to append: past the budget, the reasoning block's end tag instead of the sampled
    one. Clears the budget once the block has closed."""
    budget = seq.reasoning_budget
    assert budget is not None
    end = budget.end_token_ids
    num_forced = seq.num_output_tokens - budget.num_tokens
    if num_forced >= 0:
        token, lp = end[num_forced], None
    if num_forced >= len(end) - 1 or [*seq.token_ids[len(seq.token_ids) - len(end) + 1 :], token] == list(end):
        seq.reasoning_budget = None
    return token, lp


def _error_delta(seq: Sequence, error: str, error_param: str | None = None) -> ChoiceDelta:
    return ChoiceDelta(
        index=seq.index,
        text="",
        token_ids=[],
        finish_reason="error",
        error=error,
        error_param=error_param,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
    )
