"""A model step as the worker sees it: plain, picklable data out (``StepInput``: rows, positions,
block tables, sampling parameters and the grammar masks), sampled tokens back (``StepOutput``),
built whole from a scheduled batch by ``build_step``, which reads the sequences and changes none
of them. Nothing here outlives the step or is read by the worker as a ``Sequence``; what a sampled
token becomes (the wind-down, the reasoning budget, the grammar advanced) is the output side's
decision (``OutputProcessor.decide``)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from atom_anyio.engine.grammar import fill_bitmask
from atom_anyio.engine.sampler import SamplingInputs
from atom_anyio.engine.scheduler import ScheduledBatch
from atom_anyio.engine.sequence import Sequence
from atom_anyio.engine.stream import Logprob

PLACEHOLDER_TOKEN = 0  # async scheduling: an input the worker replaces with the previous step's token


@dataclass
class PromptRows:
    """Rows of one sequence's prefill chunk whose next token's logprob is asked for (prompt logprobs):
    flattened rows ``start .. start + len(targets) - 1`` of the step, each followed by ``targets[j]``."""

    row: int  # the sequence's row in the step
    start: int  # its first row in the flattened input
    targets: list[int]
    num_top: int


@dataclass
class StepInput:
    input_ids: list[int]  # the step's tokens, flattened: decodes first, then prefill chunks
    positions: list[int]
    block_tables: list[array]  # each sequence's block ids, int32 (read without a copy loop)
    context_lens: list[int]  # per sequence, including this step's tokens
    query_lens: list[int]
    sample_rows: list[int]  # which sequences sample a token this step
    sampling: SamplingInputs
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # async scheduling: (flattened input row, sample row of the previous step) pairs: that input
    # token is the one the previous step sampled for that row (its input_ids entry is a placeholder)
    prev_tokens: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding, one per sample row when any sequence has a draft (else empty): the draft
    # tokens after its last input; the sampling inputs then have one row per position (1 + draft)
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # the KV cache's second tier (kv_tier.py), run before the forward: (pool block, slot) saves,
    # then (slot, pool block) loads
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepOutput:
    token_ids: list[int] = field(default_factory=list)  # one per sample row (with drafts: per position)
    logprobs: list[Logprob | None] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)  # with drafts: each sample row's accepted draft tokens
    error: str | None = None
    prompt_logprobs: list[list[Logprob]] = field(default_factory=list)  # one list per StepInput.prompt_rows entry
    timings: dict[str, float] = field(default_factory=dict)


def build_step(
    batch: ScheduledBatch,
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    prev_rows: dict[int, int] | None = None,
    copy_tables: bool = False,
) -> StepInput:
    """``prev_rows`` (async scheduling): the step in flight's sample row of each sequence it samples;
    ``copy_tables``: the step holds copies of the block tables (scheduling the next step grows them
    while this one runs)."""
    input_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sampled: list[Sequence] = []
    context_lens = []
    prompt_rows: list[PromptRows] = []
    prev_tokens: list[tuple[int, int]] = []
    drafts: list[list[int]] = []
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
        start = seq.num_computed_tokens + seq.num_scheduled_tokens
        if seq.computes_prompt_logprobs and (rows := _prompt_rows(seq, row, len(input_ids), start, n)):
            prompt_rows.append(rows)
        draft = batch.drafts.get(seq.seq_id, [])
        input_ids += seq.token_ids[start : start + n - len(draft)]
        input_ids += draft
        if seq.num_placeholders:  # its last input is the token the step in flight samples
            assert start + n == len(seq) + 1
            prev_tokens.append((len(input_ids), prev_rows[seq.seq_id]))
            input_ids.append(PLACEHOLDER_TOKEN)
        positions += range(start, start + n)
        context_lens.append(start + n)
        if start + n - len(draft) == len(seq) + seq.num_placeholders and seq.max_tokens > 0:
            sample_rows.append(row)
            sampled.append(seq)
            drafts.append(draft)
    if not any(drafts):
        drafts = []
    return StepInput(
        input_ids=input_ids,
        positions=positions,
        block_tables=[array("i", s.block_table) if copy_tables else s.block_table for s in batch.seqs],
        context_lens=context_lens,
        query_lens=batch.num_tokens,
        sample_rows=sample_rows,
        sampling=_sampling_inputs(sampled, drafts, eos_token_ids, vocab_size),
        prompt_rows=prompt_rows,
        prev_tokens=prev_tokens,
        draft_token_ids=drafts,
        kv_saves=batch.kv_saves,
        kv_loads=batch.kv_loads,
    )


def _sampling_inputs(
    sampled: list[Sequence], drafts: list[list[int]], eos_token_ids: tuple[int, ...], vocab_size: int
) -> SamplingInputs:
    """One row per sampling sequence; with drafts, one per position, each seeing the draft tokens
    before it as generated (its seed's step, ``min_tokens``, penalties, the grammar: as a plain
    decode there)."""
    spans = [len(d) + 1 for d in drafts] if drafts else [1] * len(sampled)
    rows = [(j, s, i) for j, (s, span) in enumerate(zip(sampled, spans, strict=True)) for i in range(span)]
    penalised = any(s.params.repetition_penalty != 1.0 for s in sampled)
    masked_rows, bitmask = [], None
    if any(s.active_matcher is not None for s in sampled):
        masked_rows, bitmask = fill_bitmask([s.active_matcher for s in sampled], drafts, vocab_size)
    return SamplingInputs(
        params=[s.params for _, s, _ in rows],
        prompt_token_ids=[s.prompt_token_ids if penalised else [] for _, s, _ in rows],
        output_token_ids=[_output_token_ids(s) + drafts[j][:i] if i else _output_token_ids(s) for j, s, i in rows],
        seeds=[s.seed for _, s, _ in rows],
        eos_token_ids=eos_token_ids,
        masked_rows=masked_rows,
        bitmask=bitmask,
    )


def _output_token_ids(seq: Sequence) -> list[int]:
    """The generated tokens the sampler sees. A token still being sampled (async scheduling) is a
    placeholder: only a row that ``runs_ahead`` has one, and of it the sampler reads just the count
    (its seed's step, ``min_tokens``)."""
    out = seq.output_token_ids
    return out + [PLACEHOLDER_TOKEN] * seq.num_placeholders if seq.num_placeholders else out


def _prompt_rows(seq: Sequence, row: int, flat_start: int, start: int, n: int) -> PromptRows | None:
    """The rows of this chunk (positions ``start .. start + n - 1``) whose next prompt token's logprob
    is not yet known: from the first missing one to the prompt's second last position."""
    first = max(start, len(seq.prompt_logprobs) - 1)
    end = min(start + n, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    targets = seq.token_ids[first + 1 : end + 1]
    return PromptRows(row, flat_start + first - start, targets, seq.num_prompt_logprobs)
