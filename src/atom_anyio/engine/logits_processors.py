"""The logit processors a step applies before sampling: logit_bias, min_tokens (stop tokens held
back) and the repetition, frequency and presence penalties, all rows at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from atom_anyio.sampling_params import SamplingParams


class ProcessorInputs(Protocol):
    """What the processors read of a step's ``sampler.SamplingInputs`` (a protocol: the sampler imports
    this module)."""

    params: list[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]
    eos_token_ids: Sequence[int]
    masked_rows: Sequence[int]


def process_logits(logits: torch.Tensor, inputs: ProcessorInputs) -> torch.Tensor:
    """Applies logit_bias, min_tokens, then repetition, frequency and presence
    penalties. Returns ``logits`` itself when no row needs any of them, else a copy."""
    params = inputs.params
    # a grammar decides itself when its output may end: min_tokens does not hold back its end token
    constrained = set(inputs.masked_rows)
    under_min = [
        i for i, p in enumerate(params) if len(inputs.output_token_ids[i]) < p.min_tokens and i not in constrained
    ]
    has_bias = any(p.logit_bias for p in params)
    penalised = any(has_penalty(p) for p in params)
    if not (has_bias or under_min or penalised):
        return logits
    logits = logits.clone()
    if has_bias:
        _add_logit_bias(logits, params)
    if under_min:
        _mask_stop_tokens(logits, inputs, under_min)
    if penalised:
        _apply_penalties(logits, inputs)
    return logits


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def column_tensor(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        rows += [i] * len(p.logit_bias)
        cols += p.logit_bias.keys()
        values += p.logit_bias.values()
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    logits.index_put_((long_tensor(rows, logits.device), long_tensor(cols, logits.device)), bias, accumulate=True)


def _mask_stop_tokens(logits: torch.Tensor, inputs: ProcessorInputs, under_min: list[int]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for i in under_min:
        p = inputs.params[i]
        # with ignore_eos the end token does not stop the row, so it need not be held back
        stops = [*p.stop_token_ids, *(() if p.ignore_eos else inputs.eos_token_ids)]
        rows += [i] * len(stops)
        cols += stops
    logits[long_tensor(rows, logits.device), long_tensor(cols, logits.device)] = float("-inf")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(map(len, rows), default=0)
    return long_tensor([[*r, *[pad] * (width - len(r))] for r in rows], device)


def _apply_penalties(logits: torch.Tensor, inputs: ProcessorInputs) -> None:
    params = inputs.params
    num_rows, vocab = logits.shape
    # padding lands in an extra column that is dropped
    outputs = _padded(inputs.output_token_ids, vocab, logits.device)
    counts = logits.new_zeros(num_rows, vocab + 1)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
    counts = counts[:, :vocab]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [
            t if p.repetition_penalty != 1.0 else [] for p, t in zip(params, inputs.prompt_token_ids, strict=True)
        ]
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, _padded(prompts, vocab, logits.device), True)
        seen = seen[:, :vocab] | (counts > 0)
        penalty = column_tensor([p.repetition_penalty for p in params], logits)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    frequency = column_tensor([p.frequency_penalty for p in params], logits)
    presence = column_tensor([p.presence_penalty for p in params], logits)
    logits -= frequency * counts + presence * (counts > 0)
