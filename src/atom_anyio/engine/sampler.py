"""One step's logits to tokens: logit processors (``logits_processors.py``), then argmax or an
inverse-CDF sample, plus the logprobs each request asked for."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from atom_anyio.engine.logits_processors import column_tensor, long_tensor, process_logits
from atom_anyio.engine.stream import Logprob
from atom_anyio.sampling_params import SamplingParams

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
    # the rows whose output a grammar constrains now, and each one's allowed next tokens: row j of
    # ``bitmask`` (xgrammar's packed int32 bitmask, on the host) is the j-th of ``masked_rows``'s
    # grammar state, filled when the step was built (grammar.fill_bitmask)
    masked_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]  # None where params.logprobs is None
    ids: torch.Tensor | None = None  # token_ids on the device (async scheduling feeds them to the next step)


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
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(rows) == len(params):  # no greedy row: no argmax over the vocabulary
            token_ids = _sample(processed, params, inputs.seeds, [len(out) for out in inputs.output_token_ids])
        else:
            token_ids = processed.argmax(dim=-1)
            if rows:
                index = long_tensor(rows, logits.device)
                token_ids[index] = _sample(
                    processed[index],
                    [params[i] for i in rows],
                    [inputs.seeds[i] for i in rows],
                    [len(inputs.output_token_ids[i]) for i in rows],
                )
        return _to_output(logits, token_ids, params, finite)


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: list[int]
) -> torch.Tensor:
    """Temperature, then one uniform draw a row: through the whole row's CDF, or for a row that
    cuts (top_k under the vocabulary, top_p under 1 or min_p over 0) through its kept tokens'."""
    scaled = logits / column_tensor([p.temperature for p in params], logits)  # this function's own: changed in place
    u = _uniforms(seeds, steps, logits.device)
    vocab = scaled.shape[1]
    cut = [i for i, p in enumerate(params) if 0 < (p.top_k or vocab) < vocab or p.top_p < 1.0 or p.min_p > 0]
    if not cut:
        return _inverse_cdf(_weights(scaled), u)
    if len(cut) == len(params):
        return _cut_and_draw(scaled, params, u)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    whole = long_tensor([i for i in range(len(params)) if i not in set(cut)], logits.device)
    tokens[whole] = _inverse_cdf(_weights(scaled[whole]), u[whole])
    index = long_tensor(cut, logits.device)
    tokens[index] = _cut_and_draw(scaled[index], [params[i] for i in cut], u[index])
    return tokens


def _weights(logits: torch.Tensor) -> torch.Tensor:
    """``exp(logit - row max)``, unnormalised, in place (``logits`` must be the caller's own)."""
    return logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()


# the vocabulary entries a CDF block sums: the draw finds its block among a row's block sums, then
# its token within the block
CDF_BLOCK = 256


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative weight passes ``u[i]`` of the row's total.
    One draw a row, where an exponential race (``argmax(probs / q)``, ``q ~ Exp(1)``) draws one a
    vocabulary entry. The CDF is taken in two levels instead of whole: the row's blocks of
    ``CDF_BLOCK`` entries (their sums), then the drawn block's entries, in float64, as the
    fraction of the block the draw lies at. A whole float64 CDF wrote 25 MB for 64 rows of a 49k
    vocabulary, which with its widened copy took 11 ms a step on a Zen 4. A token's probability is
    its block's share (float32 sums: within a few ulps of the block's) times its share of the block
    (float64 sums), so the smallest probabilities keep their share: a float32 CDF entry near 1 is
    an ulp (6e-8) from the next, so a tail of smaller probabilities would be drawn in steps of an
    ulp (and summed in float32, as on GPUs, a token under half of one would add nothing). Each level
    is a function of the row alone: a seeded row's token is the same in any batch. A token of
    weight 0 (masked) is never drawn: a CDF does not pass anything at it, and where ``u * total``
    rounds up to the total the last block or entry with weight stands in. A row of NaNs (logits not
    all finite: reported as ``INVALID_TOKEN``) gets an id in range, which async scheduling feeds
    to the next step."""
    vocab = weights.shape[1]
    whole = vocab // CDF_BLOCK * CDF_BLOCK
    parts = [weights[:, :whole].unflatten(1, (-1, CDF_BLOCK)).sum(dim=-1)] if whole else []
    if whole < vocab:  # a last, shorter block
        parts.append(weights[:, whole:].sum(dim=-1, keepdim=True))
    sums = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).double()
    block, into = _first_passing(sums, u)
    start = block * CDF_BLOCK
    index = start.unsqueeze(1) + torch.arange(CDF_BLOCK, device=weights.device)
    entries = weights.gather(1, index.clamp(max=vocab - 1)).masked_fill_(index >= vocab, 0.0)
    entry, _ = _first_passing(entries.double(), into)
    return (start + entry).clamp_(max=vocab - 1)


def _first_passing(values: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first column at which ``values``' running sum (float64) passes ``u`` of the
    row's total, and where in that column's value it does (a fraction in [0, 1)). Where it passes
    nowhere (``u * total`` rounded up to the total, or a NaN row), the last column with a value
    instead (column 0 in a NaN row)."""
    cdf = values.cumsum(dim=1)
    total = cdf[:, -1:]
    target = u.unsqueeze(1) * total
    column = torch.searchsorted(cdf, target, right=True).squeeze(1)
    past = column >= values.shape[1]
    if past.any():
        column = torch.where(past, (cdf < total).sum(dim=1), column)  # the column that reaches the total
    at = column.unsqueeze(1)
    before = torch.where(at > 0, cdf.gather(1, (at - 1).clamp(min=0)), 0.0)
    fraction = ((target - before) / values.gather(1, at)).squeeze(1)
    return column, fraction.clamp_(0.0, math.nextafter(1.0, 0.0))


def _uniforms(seeds: list[int | None], steps: list[int], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw a row (float64); a seeded row's from a generator seeded by (seed, step)."""
    u = torch.rand(len(seeds), dtype=torch.float64, device=device)
    for i, (seed, step) in enumerate(zip(seeds, steps, strict=True)):
        if seed is not None:
            # a function of (seed, step) alone: the same token in any batch and after a recompute
            generator = torch.Generator(device=device).manual_seed(hash((seed, step)) & _SEED_MASK)
            u[i] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
    return u


# a row's largest logits that its top-k / top-p / min-p cut is looked for among first
CUT_CANDIDATES = 256


def _cut_and_draw(
    logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, candidates: int = CUT_CANDIDATES
) -> torch.Tensor:
    """Each row's top-k / top-p / min-p cut, looked for among its ``candidates`` largest logits,
    and its token drawn among the tokens it keeps there. A row whose cut may lie past them (a top_k
    above them, or a top_p or min_p that keeps every candidate: a flat distribution) looks among 16
    times as many, and is sorted whole where that is not under the vocabulary (a row of 49k: 0.3 ms
    for its top 4,096 against 1.7 ms sorted, Zen 4). Which of these decides a row depends on the
    row alone, so a seeded row's token is the same in any batch."""
    vocab = logits.shape[1]
    if candidates >= vocab:
        return _inverse_cdf(_weights(_sorted_cut(logits, params)), u)
    order, values, beyond = _candidates_cut(logits, params, candidates)
    tokens = _draw_among(order, values, u)
    if beyond:
        index = long_tensor(beyond, logits.device)
        rows = [params[i] for i in beyond]
        tokens[index] = _cut_and_draw(logits[index], rows, u[index], candidates * 16)
    return tokens


def _candidates_cut(
    logits: torch.Tensor, params: list[SamplingParams], candidates: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each row's cut as ``_sorted_cut`` makes it, among the row's ``candidates`` largest logits
    (a partial top-k: 64 rows of a 49k vocabulary, 7.5 against 142 ms for the full sort on a Zen
    3): their ids, their logits (-inf where cut; the first, the row's largest, is always kept),
    and the rows whose cut may lie past them."""
    vocab = logits.shape[1]
    top_k = [min(p.top_k or vocab, vocab) for p in params]
    width = min(candidates, max(top_k))  # every row's top k among them: no more
    values, order = logits.topk(width, dim=-1)
    k = long_tensor(top_k, logits.device).unsqueeze(1)
    values.masked_fill_(torch.arange(width, device=logits.device) >= k, float("-inf"))
    # top_p's mass is of the top k: among the candidates, or the whole row's without a top_k
    normaliser = values.logsumexp(dim=-1, keepdim=True)
    if max(top_k) > width:
        normaliser = torch.where(k <= width, normaliser, logits.logsumexp(dim=-1, keepdim=True))
    drop = _drops(values - normaliser, params)
    values.masked_fill_(drop, float("-inf"))
    cut_within = drop.any(dim=-1).tolist()
    beyond = [i for i, kk in enumerate(top_k) if kk > width and (kk < vocab or not cut_within[i])]
    return order, values, beyond


def _draw_among(order: torch.Tensor, values: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token among its candidates (ids ``order``, logits ``values`` largest first, -inf
    where cut) through their float64 CDF, largest first. A row's token does not depend on how many
    candidates the batch looked among: the extra ones come after its own, cut (exact zeros)."""
    weights = (values - values[:, :1]).exp_()
    column, _ = _first_passing(weights.double(), u)
    return order.gather(1, column.unsqueeze(1)).squeeze(1)


def _sorted_cut(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p and min-p over the renormalised top k, by sorting each row whole."""
    vocab = logits.shape[1]
    top_k = long_tensor([min(p.top_k or vocab, vocab) for p in params], logits.device).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits.masked_fill_(torch.arange(vocab, device=logits.device) >= top_k, float("-inf"))
    sorted_logits.masked_fill_(_drops(sorted_logits.log_softmax(dim=-1), params), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _drops(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Over each row's log-probabilities in descending order: top_p keeps every token whose
    predecessors hold less than p (top_p == 1 keeps all); min_p drops those under min_p of the first."""
    top_p = column_tensor([p.top_p for p in params], logprobs)
    min_p = column_tensor([p.min_p for p in params], logprobs)
    probs = logprobs.exp()
    mass_ahead = probs.cumsum(dim=-1) - probs
    return ((mass_ahead >= top_p) & (top_p < 1.0)) | (probs < min_p * probs[:, :1])


def _to_output(
    raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams], finite: torch.Tensor | None
) -> SamplerOutput:
    """Logprobs are log_softmax of the raw model logits, computed only for the rows that asked."""
    reported = token_ids if finite is None else torch.where(finite, token_ids, INVALID_TOKEN)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return SamplerOutput(reported.tolist(), [None] * len(params), token_ids)
    index = long_tensor(rows, raw.device)
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
