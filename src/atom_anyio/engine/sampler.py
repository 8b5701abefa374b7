"""One step's logits to tokens: logit processors, then argmax or an
exponential-race sample, plus the logprobs each request asked for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from atom_anyio.engine.stream import Logprob
from atom_anyio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_anyio.engine.wind_down import Closing

_SEED_MASK = 0xFFFF_FFFF_FFFF
MIN_LOGPROB = -9999.0
INVALID_TOKEN = -1  # the id reported for a row whose logits were not all finite


@dataclass
class SamplingInputs:
    """Per-row state the sampler reads; row ``i`` of every list is row ``i`` of the logits."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # generated so far; its length is the seeded row's step
    seeds: list[int | None]
    eos_token_ids: tuple[int, ...]
    # the row's xgrammar GrammarMatcher where its output is constrained now (the worker masks the
    # logits with it and advances it); empty or None: unconstrained
    matchers: list[Any | None] = field(default_factory=list)
    # where the row is constrained and near its max_tokens, how it keeps room to close its grammar
    # (wind_down.py); empty or None: nowhere
    closings: list[Closing | None] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]  # None where params.logprobs is None
    ids: torch.Tensor | None = None  # token_ids on the device (async scheduling feeds them to the next step)

    def replace(self, row: int, token_id: int) -> None:
        """Row ``row``'s token is ``token_id``, not the sampled one (no logprob: the model did not choose it)."""
        self.token_ids[row] = token_id
        self.logprobs[row] = None
        if self.ids is not None:
            self.ids[row] = token_id


class Sampler:
    """Samples one token per row of float32 ``[B, V]`` logits, on their device."""

    def __call__(
        self, logits: torch.Tensor, inputs: SamplingInputs, finite: torch.Tensor | None = None
    ) -> SamplerOutput:
        """``finite``: per row, whether its logits were all finite (on the device); a row that was
        not gets ``INVALID_TOKEN``, so the check costs no host sync of its own."""
        params = inputs.params
        assert logits.dim() == 2 and logits.shape[0] == len(params)
        processed = process_logits(logits, inputs)
        token_ids = processed.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            index = _long(rows, logits.device)
            token_ids[index] = _sample(
                processed if len(rows) == len(params) else processed[index],
                [params[i] for i in rows],
                [inputs.seeds[i] for i in rows],
                [len(inputs.output_token_ids[i]) for i in rows],
            )
        return _to_output(logits, token_ids, params, finite)


def process_logits(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Applies logit_bias, min_tokens, then repetition, frequency and presence
    penalties. Returns ``logits`` itself when no row needs any of them, else a copy."""
    params = inputs.params
    # a grammar decides itself when its output may end: min_tokens does not hold back its end token
    under_min = [
        i
        for i, p in enumerate(params)
        if len(inputs.output_token_ids[i]) < p.min_tokens and not (inputs.matchers and inputs.matchers[i] is not None)
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


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
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
    logits.index_put_((_long(rows, logits.device), _long(cols, logits.device)), bias, accumulate=True)


def _mask_stop_tokens(logits: torch.Tensor, inputs: SamplingInputs, under_min: list[int]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for i in under_min:
        p = inputs.params[i]
        # with ignore_eos the end token does not stop the row, so it need not be held back
        stops = [*p.stop_token_ids, *(() if p.ignore_eos else inputs.eos_token_ids)]
        rows += [i] * len(stops)
        cols += stops
    logits[_long(rows, logits.device), _long(cols, logits.device)] = float("-inf")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(map(len, rows), default=0)
    return _long([[*r, *[pad] * (width - len(r))] for r in rows], device)


def _apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> None:
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
        penalty = _column([p.repetition_penalty for p in params], logits)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    frequency = _column([p.frequency_penalty for p in params], logits)
    presence = _column([p.presence_penalty for p in params], logits)
    logits -= frequency * counts + presence * (counts > 0)


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: list[int]
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then ``argmax(probs / q)`` with ``q ~ Exp(1)``."""
    logits = logits / _column([p.temperature for p in params], logits)
    if any(p.top_k or p.top_p < 1.0 or p.min_p for p in params):
        logits = _top_k_top_p_min_p(logits, params)
    probs = logits.softmax(dim=-1)
    return probs.div_(_exponentials(probs, seeds, steps)).argmax(dim=-1)


def _top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    top_k = _long([min(p.top_k or vocab, vocab) for p in params], logits.device).unsqueeze(1)
    top_p = _column([p.top_p for p in params], logits)
    min_p = _column([p.min_p for p in params], logits)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits.masked_fill_(torch.arange(vocab, device=logits.device) >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # renormalised over the top k
    mass_ahead = probs.cumsum(dim=-1) - probs
    # top_p keeps every token whose predecessors hold less than p; top_p == 1 keeps all
    drop = ((mass_ahead >= top_p) & (top_p < 1.0)) | (probs < min_p * probs[:, :1])
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponentials(probs: torch.Tensor, seeds: list[int | None], steps: list[int]) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_()
    for i, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        if seed is not None:
            # a function of (seed, step) alone: the same token in any batch and after a recompute
            generator = torch.Generator(device=probs.device).manual_seed(hash((seed, step)) & _SEED_MASK)
            q[i].exponential_(generator=generator)
    # a zero draw would turn a masked token's 0 / 0 into a NaN that argmax picks
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _to_output(
    raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams], finite: torch.Tensor | None
) -> SamplerOutput:
    """Logprobs are log_softmax of the raw model logits, computed only for the rows that asked."""
    reported = token_ids if finite is None else torch.where(finite, token_ids, INVALID_TOKEN)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return SamplerOutput(reported.tolist(), [None] * len(params), token_ids)
    index = _long(rows, raw.device)
    logprobs = torch.log_softmax(raw[index].float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(max(params[i].logprobs for i in rows), dim=-1)
    # one copy of ids and one of values: row j is [chosen, top...]
    ids = torch.cat([reported, top_ids.flatten()]).tolist()
    # a masked token's -inf has no JSON form: reported as -9999.0, as OpenAI and vLLM do
    values = torch.cat([chosen.unsqueeze(1), top_values], dim=1).clamp_min(MIN_LOGPROB).tolist()
    top_ids_list = ids[len(params) :]
    width = top_values.shape[1]
    out: list[Logprob | None] = [None] * len(params)
    for j, i in enumerate(rows):
        n = params[i].logprobs
        top = list(zip(top_ids_list[j * width : j * width + n], values[j][1 : 1 + n], strict=True))
        out[i] = Logprob(ids[i], values[j][0], top)
    return SamplerOutput(ids[: len(params)], out, token_ids)
