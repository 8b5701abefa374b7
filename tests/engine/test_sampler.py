import math

import pytest
import torch

from atom_anyio.engine import sampler as sampler_module
from atom_anyio.engine.logits_processors import process_logits
from atom_anyio.engine.sampler import INVALID_TOKEN, Sampler, SamplingInputs, _inverse_cdf
from atom_anyio.sampling_params import SamplingParams

EOS = 2


def make_inputs(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    eos: tuple[int, ...] = (EOS,),
) -> SamplingInputs:
    return SamplingInputs(
        params=params,
        prompt_token_ids=prompts or [[] for _ in params],
        output_token_ids=outputs or [[] for _ in params],
        seeds=[p.seed for p in params],
        eos_token_ids=eos,
    )


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> list[int]:
    return Sampler()(logits, make_inputs(params, **kwargs)).token_ids


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """``n`` independent unseeded draws from one row, as one batch."""
    torch.manual_seed(1234)
    return torch.tensor(sample(logits_row.expand(n, -1).contiguous(), [params] * n))


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(tokens, minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * (empirical - probs.double()).abs().sum().item()


def test_greedy_rows_take_argmax():
    logits = random_logits(8, 5000)
    assert sample(logits, [SamplingParams(temperature=0)] * 8) == logits.argmax(-1).tolist()


def test_logit_bias_forces_a_token_and_stays_in_its_row():
    logits = random_logits(3, 1000)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={11: 100.0}),
        SamplingParams(temperature=0),
    ]
    assert sample(logits, params) == [7, 11, logits[2].argmax().item()]


def test_logit_bias_is_added():
    logits = random_logits(2, 100)
    params = [SamplingParams(logit_bias={3: 1.5, 4: -2.0}), SamplingParams()]
    processed = process_logits(logits, make_inputs(params))
    expected = logits.clone()
    expected[0, 3] += 1.5
    expected[0, 4] -= 2.0
    torch.testing.assert_close(processed, expected, rtol=0, atol=0)


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, 1000)
    logits[0, EOS] = 10.0  # eos best, then the stop token, then 5
    logits[0, 9] = 9.0
    logits[0, 5] = 8.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    assert sample(logits, [params], outputs=[[1, 1]]) == [5]
    assert sample(logits, [params], outputs=[[1, 1, 1]]) == [EOS]


def test_min_tokens_leaves_eos_alone_with_ignore_eos():
    logits = torch.zeros(1, 1000)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert sample(logits, [params]) == [EOS]


def test_min_tokens_masks_every_eos_token_only_in_its_row():
    logits = torch.zeros(2, 100)
    logits[:, 40] = 10.0
    logits[:, 41] = 9.0
    logits[:, 7] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=1), SamplingParams(temperature=0)]
    assert sample(logits, params, eos=(40, 41)) == [7, 40]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(16, 5000, scale=0.5)
    assert sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 16) == logits.argmax(-1).tolist()


def test_top_k_only_picks_among_the_k_largest():
    logits = random_logits(1, 1000, scale=0.3)[0]
    tokens = draws(logits, SamplingParams(temperature=2.0, top_k=5), 4000)
    assert set(tokens.tolist()) == set(logits.topk(5).indices.tolist())


def nucleus_logits(head: list[float], vocab: int = 1000) -> torch.Tensor:
    """Logits whose softmax is ``head`` on the first tokens, the rest spread evenly."""
    tail = (1.0 - sum(head)) / (vocab - len(head))
    return torch.tensor(head + [tail] * (vocab - len(head))).log()


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.75, {0, 1}), (0.9, {0, 1, 2}), (0.4, {0})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, nucleus):
    logits = nucleus_logits([0.5, 0.3, 0.15])
    tokens = draws(logits, SamplingParams(top_p=top_p), 4000)
    assert set(tokens.tolist()) == nucleus
    head = torch.tensor([0.5, 0.3, 0.15])[sorted(nucleus)]
    assert total_variation(tokens, torch.cat([head / head.sum(), torch.zeros(1000 - len(nucleus))])) < 0.03


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    logits = nucleus_logits([0.4, 0.3, 0.19, 0.01])
    tokens = draws(logits, SamplingParams(min_p=0.45), 4000)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens = draws(logits, SamplingParams(min_p=0.5), 4000)
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_and_top_p_compose_on_the_renormalised_top_k():
    # top-2 renormalises to 0.625 / 0.375, so top_p = 0.6 keeps only the first
    logits = nucleus_logits([0.5, 0.3, 0.15])
    tokens = draws(logits, SamplingParams(top_k=2, top_p=0.6), 2000)
    assert set(tokens.tolist()) == {0}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    tokens = draws(logits, SamplingParams(temperature=temperature), 40_000)
    assert total_variation(tokens, (logits / temperature).softmax(-1)) < 0.015
    if temperature != 1.0:
        assert total_variation(tokens, logits.softmax(-1)) > 0.05


def seeded_token(logits_row: torch.Tensor, seed: int, history: list[int], position: int, batch: int) -> int:
    """The token a seeded row gets at ``position`` in a batch of mixed seeded and unseeded rows."""
    logits = random_logits(batch, logits_row.numel(), seed=99)
    logits[position] = logits_row
    params = [SamplingParams(temperature=1.0, seed=1000 + i if i % 2 else None) for i in range(batch)]
    params[position] = SamplingParams(temperature=1.0, seed=seed)
    outputs = [[0] * (i % 5) for i in range(batch)]
    outputs[position] = history
    return sample(logits, params, outputs=outputs)[position]


def test_seeded_row_is_the_same_alone_and_anywhere_in_a_batch():
    logits_row = random_logits(1, 2000, seed=5, scale=0.5)[0]
    for step in range(8):
        history = list(range(step))
        alone = seeded_token(logits_row, 42, history, position=0, batch=1)
        assert seeded_token(logits_row, 42, history, position=3, batch=4) == alone
        assert seeded_token(logits_row, 42, history, position=11, batch=16) == alone


def test_seeded_rows_differ_by_seed_and_by_step():
    logits_row = random_logits(1, 2000, seed=5, scale=0.5)[0]
    run = {seed: [seeded_token(logits_row, seed, [0] * step, 0, 1) for step in range(20)] for seed in (1, 2)}
    assert run[1] != run[2]
    assert len(set(run[1])) > 10


def test_seeded_sampling_follows_the_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(5000)]
    tokens = torch.tensor(sample(logits.expand(5000, -1).contiguous(), params))
    assert total_variation(tokens, logits.softmax(-1)) < 0.04


def test_a_token_of_probability_zero_is_never_drawn_at_either_end_of_u():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]] * 4)
    u = torch.tensor([0.0, 0.25, 0.5, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert _inverse_cdf(probs, u).tolist() == [1, 3, 3, 4]


def test_a_masked_vocabulary_is_sampled_over_what_is_left():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2]).repeat(4)
    allowed = torch.tensor([5, 6, 13, 30])  # a grammar's few tokens, spread over the vocabulary
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    tokens = draws(masked, SamplingParams(temperature=1.0), 20_000)
    assert set(tokens.tolist()) == set(allowed.tolist())
    assert total_variation(tokens, masked.softmax(-1)) < 0.02


def test_tokens_spread_over_the_cdf_blocks_are_drawn_in_proportion():
    """The draw finds a block of CDF_BLOCK entries, then a token in it: tokens at both edges of a
    block, alone in theirs, and in a shorter last block are each drawn as often as their probability."""
    vocab = 3 * sampler_module.CDF_BLOCK + 37
    allowed = torch.tensor([0, 255, 256, 300, 767, 768, vocab - 1])
    logits = torch.full((vocab,), float("-inf"))
    logits[allowed] = torch.tensor([0.5, 1.0, 0.0, 2.0, -1.0, 0.7, 1.5])
    tokens = draws(logits, SamplingParams(temperature=1.0), 20_000)
    assert set(tokens.tolist()) == set(allowed.tolist())
    assert total_variation(tokens, logits.softmax(-1)) < 0.02


def test_a_draw_at_the_total_takes_the_last_token_with_weight_past_masked_blocks():
    """``u * total`` rounded up to the total passes no CDF entry: the last block with weight, and
    its last entry with weight, stand in (never a masked token after them)."""
    weights = torch.zeros(2, 4 * sampler_module.CDF_BLOCK)
    weights[:, [3, 300, 301]] = torch.tensor([0.25, 0.5, 0.25])
    u = torch.tensor([1.0, 0.5], dtype=torch.float64)
    assert _inverse_cdf(weights, u).tolist() == [301, 300]


def test_the_smallest_probabilities_keep_their_share_after_a_large_one():
    # 100k tokens of 4e-9 each after one of 0.9996: float32 CDF entries near 1 are an ulp (6e-8,
    # 15 of these tokens) apart, rounded to the nearest; so where the draw lands on a float32
    # value, a float32 CDF answers about 7 tokens away from the first that passes it
    tail = 100_000
    probs = torch.cat([torch.tensor([1 - tail * 4e-9]), torch.full((tail,), 4e-9)]).unsqueeze(0)
    head, each = (probs[0, i].double().item() for i in (0, 1))
    x = torch.tensor(0.9998, dtype=torch.float32).item()  # in the tail, on a float32 value
    u = torch.tensor([head / 2, x / (head + tail * each)], dtype=torch.float64)
    first, middle = _inverse_cdf(probs.expand(2, -1), u).tolist()
    assert first == 0
    assert abs(middle - (math.floor((x - head) / each) + 1)) <= 1  # the first that passes u of the total


def test_a_row_of_non_finite_logits_stays_in_range_for_the_next_step():
    logits = random_logits(3, 500)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)]
    out = Sampler()(logits, make_inputs(params), finite=torch.isfinite(logits).all(dim=-1))
    assert out.token_ids[1] == INVALID_TOKEN and INVALID_TOKEN not in (out.token_ids[0], out.token_ids[2])
    assert int(out.ids.min()) >= 0 and int(out.ids.max()) < 500


def test_the_cut_among_the_largest_logits_is_the_full_sorts_and_a_row_it_may_miss_looks_wider_then_sorts(monkeypatch):
    """Candidates 256, then 4,096 for the rows whose cut may lie past them, then the full sort for
    those whose cut may lie past those too (a vocabulary of 5,000: 16 x 4,096 is past it); each
    row keeps the tokens the full sort's cut keeps, and its token is one of them."""
    vocab = 5000
    peaked, flat = random_logits(5, vocab, seed=1, scale=4.0), random_logits(4, vocab, seed=2, scale=0.05)
    logits = torch.cat([peaked, flat, random_logits(1, vocab, seed=3, scale=1.0)])
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.0, top_k=200, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=1000),  # above the first candidates, among the wider
        SamplingParams(temperature=1.0, top_p=0.9),  # flat: every candidate kept, wider too: sorted
        SamplingParams(temperature=1.0, min_p=0.5),  # flat: every candidate kept, wider too: sorted
        SamplingParams(temperature=1.0, top_k=100, top_p=0.95),  # flat, but the top 100 are candidates
        SamplingParams(temperature=1.0, top_p=0.001),  # flat, cut at the first
        # top_p of the top 1000's mass (57% of the row's): the cut is among the candidates, its
        # measure is not: among the wider
        SamplingParams(temperature=1.0, top_k=1000, top_p=0.2),
    ]
    looked: dict[int | str, list[int]] = {}
    kept: dict[int, set[int]] = {}
    real, real_candidates = sampler_module._sorted_cut, sampler_module._candidates_cut

    def rows_of(rows_params):
        return [next(i for i, q in enumerate(params) if q is p) for p in rows_params]

    def spied(rows_logits, rows_params):
        out = real(rows_logits, rows_params)
        looked["sorted"] = rows_of(rows_params)
        for j, i in enumerate(looked["sorted"]):
            kept[i] = set(out[j].isfinite().nonzero().flatten().tolist())
        return out

    def spied_candidates(rows_logits, rows_params, candidates):
        order, values, beyond = real_candidates(rows_logits, rows_params, candidates)
        looked[candidates] = rows_of(rows_params)
        for j, i in enumerate(looked[candidates]):
            if j not in beyond:
                kept[i] = set(order[j][values[j].isfinite()].tolist())
        return order, values, beyond

    monkeypatch.setattr(sampler_module, "_sorted_cut", spied)
    monkeypatch.setattr(sampler_module, "_candidates_cut", spied_candidates)
    u = torch.rand(len(params), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tokens = sampler_module._cut_and_draw(logits.clone(), params, u).tolist()
    assert looked == {256: list(range(10)), 4096: [4, 5, 6, 9], "sorted": [5, 6]}
    for i, p in enumerate(params):
        expected = set(real(logits[i : i + 1], [p])[0].isfinite().nonzero().flatten().tolist())
        assert kept[i] == expected, i
        assert tokens[i] in expected
    assert 3 < len(kept[0]) < 256 and len(kept[5]) > 256


def test_a_seeded_row_that_cuts_draws_the_same_alone_and_beside_other_rows():
    """A cut row draws among its kept candidates; how many candidates the batch looks among (the
    largest top_k of its rows) and the rows beside it (cut, whole, greedy) do not change its token."""
    row = random_logits(1, 3000, seed=8, scale=2.0)
    others = [
        SamplingParams(temperature=1.0, top_k=200),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
    ]
    batch = torch.cat([random_logits(3, 3000, seed=9), row])
    for p in (
        SamplingParams(temperature=0.8, top_k=40, seed=5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(temperature=0.8, min_p=0.05, seed=5),
    ):
        drawn = []
        for step in range(6):
            alone = sample(row, [p], outputs=[[0] * step])[0]
            assert sample(batch, [*others, p], outputs=[[], [], [], [0] * step])[3] == alone
            drawn.append(alone)
        assert len(set(drawn)) > 1


def test_a_cut_row_is_drawn_in_proportion_among_what_it_keeps():
    logits = random_logits(1, 320, seed=6, scale=1.0)[0]  # the candidates are 256 of them
    kept = logits.topk(3).indices
    tokens = draws(logits, SamplingParams(temperature=1.0, top_k=3), 20_000)
    top3 = torch.full_like(logits, float("-inf"))
    top3[kept] = logits[kept]
    assert set(tokens.tolist()) == set(kept.tolist())
    assert total_variation(tokens, top3.softmax(-1)) < 0.02


def test_presence_penalty_subtracts_once_per_seen_token():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    params = [SamplingParams(temperature=0, presence_penalty=1.0)]
    processed = process_logits(logits, make_inputs(params, outputs=[[0, 0, 3]]))
    torch.testing.assert_close(processed, torch.tensor([[1.0, 1.5, 0.0, -1.0]]))
    assert sample(logits, params, outputs=[[0, 0, 3]]) == [1]


def test_frequency_penalty_scales_with_the_count():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=0.2)]
    processed = process_logits(logits, make_inputs(params, outputs=[[0, 0, 0, 3]]))
    torch.testing.assert_close(processed, torch.tensor([[1.4, 1.5, 0.0, -0.2]]))
    assert sample(logits, params, outputs=[[0, 0, 0]]) == [1]
    assert sample(logits, params, outputs=[[0, 0]]) == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2, 0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    inputs = make_inputs(params, prompts=[[0]], outputs=[[2, 2]])
    torch.testing.assert_close(process_logits(logits, inputs), torch.tensor([[1.0, 1.5, -2.0, -1.2, 0.5]]))
    assert Sampler()(logits, inputs).token_ids == [1]


def test_penalties_stay_in_their_row():
    logits = random_logits(3, 500)
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={1: 2.0}),
        SamplingParams(),
        SamplingParams(min_tokens=4),
    ]
    inputs = make_inputs(params, prompts=[[1, 2], [1, 2], [1, 2]], outputs=[[3, 4], [3, 4], [3, 4]], eos=(5,))
    processed = process_logits(logits, inputs)
    assert torch.equal(processed[1], logits[1])
    expected = logits[2].clone()
    expected[5] = -math.inf
    assert torch.equal(processed[2], expected)
    assert not torch.equal(processed[0], logits[0])


def test_no_processing_returns_the_logits_untouched():
    logits = random_logits(2, 100)
    params = [SamplingParams(min_tokens=2), SamplingParams(temperature=0.5, top_k=3)]
    assert process_logits(logits, make_inputs(params, outputs=[[1, 1], []])) is logits


def test_logprobs_are_of_the_raw_logits():
    logits = random_logits(4, 3000)
    params = [
        SamplingParams(temperature=0.7, logprobs=5, logit_bias={9: 50.0}),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=20, logprobs=20),
    ]
    out = Sampler()(logits, make_inputs(params))
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    assert out.token_ids[0] == 9
    for row, n in ((0, 5), (1, 0), (3, 20)):
        lp = out.logprobs[row]
        assert lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(raw[row, lp.token_id].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == raw[row].topk(n).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(raw[row].topk(n).values.tolist(), abs=1e-5)
    assert out.logprobs[1].top == []


def test_greedy_row_among_hot_rows_is_argmax():
    logits = random_logits(32, 4000, scale=0.5)
    params = [SamplingParams(temperature=1.5, top_p=0.95, seed=i if i % 3 else None) for i in range(32)]
    params[7] = SamplingParams(temperature=0)
    params[20] = SamplingParams(temperature=0, logprobs=2)
    tokens = sample(logits, params)
    assert tokens[7] == logits[7].argmax().item()
    assert tokens[20] == logits[20].argmax().item()
    hot_rows = [i for i in range(32) if i not in (7, 20)]
    assert sum(tokens[i] == logits[i].argmax().item() for i in hot_rows) < len(hot_rows) / 2
