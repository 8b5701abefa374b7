"""Speculative decoding: the proposers on their own, then the real engine with a tiny random model,
where every output must equal the one without speculation, token for token, with every KV block
free afterwards. The tiny model never copies by itself, so the engine cases draft from the suffix
store, warmed by a first run of the same prompts: its second run is mostly accepted drafts."""

from __future__ import annotations

import collections
import math
import random
from dataclasses import replace

import anyio
import numpy as np
import pytest
from support_models import WORDS

from atom_anyio import LLM, SamplingParams
from atom_anyio.api.usage import Usage
from atom_anyio.config import Config
from atom_anyio.engine import speculative
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import Grammars
from atom_anyio.engine.proposers import SuffixStore, ngram_draft, suffix_draft
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.sequence import Sequence
from atom_anyio.engine.speculative import SpeculativeConfig, Speculator, within_grammar
from atom_anyio.engine.stream import RequestStream
from atom_anyio.engine.wind_down import WIND_DOWN_TOKENS
from atom_anyio.obs.metrics import Metrics
from atom_anyio.sampling_params import StructuredOutputs
from atom_anyio.settings import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
SMALL = {"max_model_len": 1024, "kv_cache_gib": 0.05}


def tokens(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


# the proposers


def test_ngram_drafts_what_followed_the_most_recent_longest_match():
    #            0  1  2  3  4  5  6  7  8  9
    seq = tokens(1, 2, 3, 9, 2, 3, 4, 5, 2, 3)
    # "2 3" occurs ending at 2 and 5; the most recent, at 5, was followed by 4 5 2 3
    assert ngram_draft(seq, 3, 1, 2) == (2, [4, 5, 2])
    # "1 2 3"? no: the longest match within [1, 3] is still "2 3"
    assert ngram_draft(seq, 8, 1, 3) == (2, [4, 5, 2, 3])
    assert ngram_draft(seq, 3, 3, 3) == (0, [])  # no match of 3 tokens


def test_ngram_prefers_a_longer_match_over_a_more_recent_one():
    seq = tokens(7, 8, 9, 1, 5, 5, 9, 2, 5, 7, 8, 9)
    # "9" alone last occurs at 6 (then 2), but "7 8 9" at 0..2 is longer (then 1)
    assert ngram_draft(seq, 2, 1, 3) == (3, [1, 5])


def test_suffix_store_keeps_at_most_its_bounds_least_recently_used_out_first():
    store = SuffixStore(max_requests=3, max_tokens=10)
    for out in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        store.add(out)
    assert suffix_draft(tokens(0, 1, 2), store, 4, 8, 10.0) == (2, [3])  # a match in [1, 2, 3]: it is used
    store.add([10, 11, 12])  # four outputs: the least recently used, [4, 5, 6], goes
    assert [list(a) for a in store.outputs.values()] == [[7, 8, 9], [1, 2, 3], [10, 11, 12]]
    store.add([13, 14])  # 11 tokens: [7, 8, 9] goes too
    assert store.num_tokens == 8 and len(store.outputs) == 3
    corpus, _, _ = store.corpus()
    assert len(corpus) == 8 + 3  # a separator after each


def test_suffix_draft_takes_the_higher_scoring_match_and_drafts_at_most_factor_times_its_length():
    store = SuffixStore(10, 1000)
    store.add([5, 6, 7, 8, 20, 21, 22, 23, 24])
    own = tokens(6, 30, 31, 5, 6, 7, 8)
    # its own tokens match "6" (then 30: one token, score 1); the store "5 6 7 8" (then 20 ...: score 4)
    assert suffix_draft(own, store, 8, 24, 1.0) == (4, [20, 21, 22, 23])
    assert suffix_draft(own, store, 8, 24, 0.5) == (4, [20, 21])
    assert suffix_draft(tokens(40, 41), store, 8, 24, 1.0) == (0, [])


def test_suffix_draft_follows_the_most_frequent_continuation_while_its_probability_holds():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13
    seq = tokens(1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2)
    store = SuffixStore(10, 1000)
    # "1 2" was followed by 3, 3, 4: 3 at 2/3; then "1 2 3" by 5 and 6, a tie the most recent (6)
    # takes, at 2/3 * 1/2; after "1 2 3 6" one place, so each next token keeps 1/3
    assert suffix_draft(seq, store, 8, 24, 10.0, 0.3) == (2, [3, 6, 1, 2, 4, 7, 1, 2])
    assert suffix_draft(seq, store, 8, 24, 10.0, 0.5) == (2, [3])
    assert suffix_draft(seq, store, 8, 24, 10.0, 0.7) == (0, [])  # not even the first token
    # a place where the text ends counts against its continuation: "1 2" ends one of the store's outputs
    store.add([1, 2, 3, 8])
    store.add([1, 2])
    assert suffix_draft(tokens(4, 1, 2), store, 8, 24, 10.0, 0.5) == (2, [3, 8])  # 1/2, then 1/2 * 1
    assert suffix_draft(tokens(4, 1, 2), store, 8, 24, 10.0, 0.6) == (0, [])


def test_suffix_draft_takes_its_own_draft_unless_the_stores_scores_higher():
    store = SuffixStore(10, 1000)
    store.add([7, 8, 9, 10, 11, 12])
    own = tokens(7, 8, 20, 7, 8)
    assert suffix_draft(own, store, 2, 24, 1.0) == (2, [20, 7])  # both score 2: its own
    assert suffix_draft(own, store, 4, 24, 4.0) == (2, [9, 10, 11, 12])  # its own ends after 3 tokens: 3 < 4


def test_the_draft_context_follows_the_sequence_copying_only_what_was_appended():
    seq = Sequence(EngineRequest(list(range(50)), [], GREEDY, 400), RequestStream(4).sender(), None)
    first = speculative.draft_context(seq)
    assert first.dtype == np.int64 and first.tolist() == seq.token_ids
    for n in range(200):
        seq.token_ids.append(1000 + n)
        if n % 37 == 0:
            assert speculative.draft_context(seq).tolist() == seq.token_ids
    seq.draft_context[:50] = -1  # what was copied once is not copied again
    assert speculative.draft_context(seq).tolist() == [-1] * 50 + seq.token_ids[50:]


def test_auto_speculates_only_where_a_verifying_step_is_exact_and_says_why_not(caplog):
    spec = speculative.speculator_for(speculative.AUTO, async_scheduling=False, exact=True)
    cfg = spec.cfg
    assert (cfg.method, cfg.disable_by_batch_size, cfg.suffix_decoding_min_token_prob) == ("suffix", 1, 0.5)
    assert spec.is_active(1) and not spec.is_active(2)
    assert "spec_decode.on" in caplog.text
    assert speculative.speculator_for(speculative.AUTO, async_scheduling=False, exact=False) is None
    assert "auto: not exact: batch invariance is off" in caplog.text
    assert speculative.speculator_for(speculative.AUTO, async_scheduling=True, exact=True) is None
    assert "auto: async_scheduling" in caplog.text
    assert speculative.speculator_for(None, async_scheduling=False, exact=True) is None


def test_speculative_config_takes_vllm_defaults_and_refuses_bad_values_in_one_line():
    cfg = Config.from_env({"ATOM_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'})
    spec = cfg.engine.speculative_config
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 5, 5)
    assert SpeculativeConfig("ngram", 2, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig("suffix").num_speculative_tokens == 24  # the tree depth, as vLLM
    assert Config.from_env({}).engine.speculative_config == speculative.AUTO  # auto by default
    for off in ("off", "none", "OFF"):
        assert Config.from_env({"ATOM_SPECULATIVE_CONFIG": off}).engine.speculative_config is None
    for raw, needle in (
        ('{"method": "eagle"}', "method must be one of ngram, suffix"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "is more"),
        ('{"method": "ngram", "k": 2}', "unknown key 'k'"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "min_token_prob must be in [0, 1]"),
        ("automatic", '"auto", "off" or a JSON object'),
        ("[1]", '"auto", "off" or a JSON object'),
    ):
        with pytest.raises(ConfigError) as err:
            Config.from_env({"ATOM_SPECULATIVE_CONFIG": raw})
        assert needle in str(err.value) and "ATOM_SPECULATIVE_CONFIG" in str(err.value)
        assert "\n" not in str(err.value)


def test_a_draft_token_the_grammar_forbids_is_cut_before_verification(tiny_model):
    tok = tiny_model.tokenizer
    grammars = Grammars(tok, tiny_model.config.vocab_size, [tok.eos_token_id])
    matcher = grammars.constraint(StructuredOutputs("choice", ["yes please", "no"])).new_matcher()
    yes = tok.encode("yes please", add_special_tokens=False)
    assert within_grammar(matcher, [*yes, tok.eos_token_id]) == yes  # the end token would end it: cut
    assert within_grammar(matcher, [yes[0], *tok.encode(" maybe", add_special_tokens=False)]) == [yes[0]]
    assert within_grammar(matcher, tok.encode("maybe", add_special_tokens=False)) == []
    assert matcher.accept_token(yes[0])  # left as it was


# the engine, greedy: equal with and without speculation


def mixed_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))))["input_ids"] for _ in range(count)
    ]


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return mixed_prompts(tiny_model.tokenizer, 6)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """Each prompt alone, no speculation, no prefix cache."""
    llm = LLM(tiny_model, enable_prefix_caching=False, **SMALL)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0] for p in prompts]


def ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


def warm(llm: LLM, prompts, params=GREEDY) -> Speculator:
    """The suffix store holds these prompts' outputs; the counters start at zero."""
    ids(llm, prompts, params)
    spec = llm.engine.speculator
    spec.num_draft_tokens = spec.num_accepted_tokens = 0
    return spec


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.has_work


def test_greedy_equal_alone_and_batched_with_sequences_that_draft_nothing(tiny_model, prompts, reference):
    llm = LLM(tiny_model, enable_prefix_caching=False, speculative_config=SUFFIX, **SMALL)
    spec = warm(llm, prompts[:3])
    assert ids(llm, [prompts[0]]) == [reference[0].token_ids]
    assert spec.num_accepted_tokens > 30  # it speculated, and most of it was taken
    assert ids(llm, prompts) == [r.token_ids for r in reference]  # three draft, three do not
    assert all_blocks_free(llm)


def test_greedy_equal_beside_chunked_prefill_with_a_prefix_hit(tiny_model, prompts, reference):
    llm = LLM(tiny_model, max_num_batched_tokens=12, speculative_config=SUFFIX, **SMALL)
    spec = warm(llm, prompts[:2])
    hits = llm.engine.block_manager.num_hit_tokens
    assert ids(llm, prompts[:4]) == [r.token_ids for r in reference[:4]]  # 2 prefill in chunks of <= 12
    assert llm.engine.block_manager.num_hit_tokens > hits
    assert spec.num_accepted_tokens > 0
    assert all_blocks_free(llm)


def test_greedy_equal_when_preempted(tiny_model, prompts, reference):
    llm = LLM(tiny_model, num_kv_blocks=16, max_model_len=256, speculative_config=SUFFIX)
    spec = warm(llm, prompts)
    assert ids(llm, prompts) == [r.token_ids for r in reference]
    assert llm.engine.scheduler.num_preemptions > 0 and spec.num_accepted_tokens > 0
    assert all_blocks_free(llm)


def test_a_stop_string_or_max_tokens_inside_an_accepted_run_ends_the_output_there(tiny_model, prompts, reference):
    llm = LLM(tiny_model, enable_prefix_caching=False, speculative_config=SUFFIX, **SMALL)
    warm(llm, prompts[:1])
    ref = reference[0]
    stop = tiny_model.tokenizer.decode(ref.token_ids[20:22])
    stopped = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    plain = LLM(tiny_model, enable_prefix_caching=False, **SMALL).generate([prompts[0]], stopped, use_tqdm=False)
    out = llm.generate([prompts[0]], stopped, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (
        plain[0].outputs[0].text,
        plain[0].outputs[0].token_ids,
        "stop",
    )
    assert len(out.token_ids) < 23
    short = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), use_tqdm=False)
    assert short[0].outputs[0].token_ids == ref.token_ids[:13] and short[0].outputs[0].finish_reason == "length"
    assert all_blocks_free(llm)


def test_logprobs_and_n_choices_keep_their_meaning(tiny_model, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, n=2)
    plain = LLM(tiny_model, **SMALL).generate([prompts[1]], params, use_tqdm=False)[0]
    llm = LLM(tiny_model, speculative_config=SUFFIX, **SMALL)
    spec = warm(llm, [prompts[1]], params)
    out = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    assert spec.num_accepted_tokens > 0
    for a, b in zip(out.outputs, plain.outputs, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        assert [round(lp.logprob, 3) for lp in a.logprobs] == [round(lp.logprob, 3) for lp in b.logprobs]
    assert all_blocks_free(llm)


async def generate(engine: Engine, items) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in items]

    async def one(i: int, prompt, params, constraint) -> None:
        async with engine.submit(EngineRequest.of_tokens(prompt, params, engine, constraint)) as stream:
            async for d in stream:
                results[i] += d.token_ids

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with anyio.create_task_group() as inner:
            for i, item in enumerate(items):
                inner.start_soon(one, i, *item)
        tg.cancel_scope.cancel()
    return results


@pytest.mark.anyio
async def test_grammar_constrained_greedy_equal_with_drafts_masked_per_position(tiny_model, prompts):
    tok = tiny_model.tokenizer
    grammars = Grammars(tok, tiny_model.config.vocab_size, [tok.eos_token_id])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    constraint = grammars.constraint(StructuredOutputs("json", schema))
    params = SamplingParams(temperature=0, max_tokens=60 + WIND_DOWN_TOKENS)  # no drafts in the wind-down
    items = [(p, params, constraint) for p in prompts[:3]]
    cfg = EngineConfig(**SMALL)
    plain = await generate(Engine(tiny_model, cfg), items)
    engine = Engine(tiny_model, EngineConfig(**SMALL, speculative_config=SUFFIX))
    await generate(engine, items)  # warms the store
    engine.speculator.num_accepted_tokens = 0
    assert await generate(engine, items) == plain
    assert engine.speculator.num_accepted_tokens > 10
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture
def anyio_backend():
    return "asyncio"


# sampled: the target distribution, exactly


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_model, prompts):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=32, ignore_eos=True) for s in range(6)]
    plain = ids(LLM(tiny_model, **SMALL), prompts, params)
    llm = LLM(tiny_model, speculative_config=SUFFIX, **SMALL)
    # the store holds half the prompts' outputs under these seeds (their drafts are right) and the
    # other half's under other seeds (drafts of another sample: rejected where the two part)
    spec = warm(llm, prompts, [replace(p, seed=p.seed + 100 * (i % 2)) for i, p in enumerate(params)])
    assert ids(llm, prompts, params) == plain
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens  # both branches


T, K = 1.5, 3  # a flat top-3 at each position: both branches of the rule are taken often


def top_k_distribution(llm: LLM, prompt: list[int]) -> dict[int, float]:
    """The target at the next position: the model's top K, at temperature T, renormalised."""
    params = SamplingParams(temperature=T, top_k=K, max_tokens=1, logprobs=K)
    top = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0].top
    weights = {t: math.exp(lp / T) for t, lp in top[:K]}
    return {t: w / sum(weights.values()) for t, w in weights.items()}


def assert_follows(target: dict, samples: list) -> None:
    counts = collections.Counter(samples)
    tv = 0.5 * sum(abs(counts[k] / len(samples) - target.get(k, 0.0)) for k in {*counts, *target})
    assert tv < 0.12, f"total variation {tv:.3f} from the target over {len(samples)} samples"


@pytest.mark.parametrize("rule", ["standard", "broken: every draft token accepted"])
def test_sampled_tokens_after_a_draft_follow_the_target_distribution(tiny_model, monkeypatch, rule):
    """Every request drafts x after its first token; the pair of tokens after that first one must
    follow the model's own joint distribution (600 seeded requests: deterministic). Accepting a
    draft token that was not sampled (the rule broken on purpose) is caught by the same check."""
    prompt = tiny_model.tokenizer("the river runs over the stone")["input_ids"]
    plain = LLM(tiny_model, max_model_len=256, kv_cache_gib=0.05)
    first = top_k_distribution(plain, prompt)
    t0 = max(first, key=first.get)
    second = top_k_distribution(plain, [*prompt, t0])
    x = max(second, key=second.get)
    target = {
        (a, b): pa * pb for a, pa in second.items() for b, pb in top_k_distribution(plain, [*prompt, t0, a]).items()
    }
    monkeypatch.setattr(Speculator, "propose", lambda self, seq, limit: [x])
    if rule != "standard":
        monkeypatch.setattr(speculative, "num_accepted", lambda draft, sampled: len(draft))
    spec = {"method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": None}
    llm = LLM(tiny_model, max_model_len=256, kv_cache_gib=0.05, speculative_config=spec)
    params = [SamplingParams(temperature=T, top_k=K, seed=s, max_tokens=3, ignore_eos=True) for s in range(600)]
    outs = ids(llm, [prompt] * 600, params)
    pairs = [(o[1], o[2]) for o in outs if o[0] == t0]
    assert len(pairs) > 150 and llm.engine.speculator.num_accepted_tokens > 0
    if rule == "standard":
        assert llm.engine.speculator.num_accepted_tokens < llm.engine.speculator.num_draft_tokens  # both branches
        assert_follows(target, pairs)
    else:
        with pytest.raises(AssertionError, match="total variation"):
            assert_follows(target, pairs)


def test_smollm2_copying_a_passage_greedy_equal_and_mostly_accepted(smollm2):
    passage = (
        "The engine keeps a paged KV cache with reference counts. Each block holds sixteen tokens, and a "
        "block's hash is set only once all of its tokens have been computed."
    )
    chat = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{passage}"}]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(smollm2, max_model_len=1024, kv_cache_gib=0.05).chat(chat, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    llm = LLM(smollm2, max_model_len=1024, kv_cache_gib=0.05, speculative_config=spec)
    out = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain[0].outputs[0].token_ids
    assert out.text.startswith("The engine keeps a paged KV cache")
    assert llm.engine.speculator.num_accepted_tokens > 20  # of 40
    assert llm.engine.num_steps < 20
    assert all_blocks_free(llm)


def test_smollm2_at_its_defaults_drafts_for_a_lone_stream_where_exact_and_not_beside_another(smollm2_path):
    """Auto: suffix drafts where the kernels are batch-invariant (bfloat16 with AVX512-BF16 or AMX),
    none elsewhere; only while one sequence runs; the greedy text is the plain server's."""
    llm = LLM(None, max_model_len=1024, kv_cache_gib=0.05)  # dtype auto, as the server
    spec = llm.engine.speculator
    assert (spec is not None) == bool(llm.loaded.plan.batch_invariant)
    if spec is None:
        pytest.skip("batch invariance is off on this CPU kind: auto speculates nothing (asserted)")
    plain = LLM(llm.loaded, max_model_len=1024, kv_cache_gib=0.05, speculative_config="off")
    assert plain.engine.speculator is None
    passage = "Each block holds sixteen tokens, and a block's hash is set once all of its tokens are computed."
    chats = [
        [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{passage}"}],
        [{"role": "user", "content": "Write two sentences about the sea."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    alone = [llm.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    assert alone == [plain.chat(c, params, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    assert spec.num_accepted_tokens > 10 and llm.engine.num_steps < 2 * 32 + 2
    drafted = spec.num_draft_tokens
    together = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    assert together == alone and spec.num_draft_tokens == drafted  # two running: no drafts
    assert all_blocks_free(llm)


def test_counters_under_vllm_names_and_the_request_acceptance_on_its_last_delta(tiny_model, prompts):
    llm = LLM(tiny_model, speculative_config=SUFFIX, **SMALL)
    spec = warm(llm, prompts[:1])
    spec.num_drafts, spec.num_accepted_per_pos = 0, [0] * spec.max_tokens
    usage = Usage()

    async def fold() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(llm.engine.run)
            async with llm.engine.submit(EngineRequest.of_tokens(prompts[0], GREEDY, llm.engine)) as stream:
                async for d in stream:
                    usage.add(d)
            tg.cancel_scope.cancel()

    anyio.run(fold)
    assert usage.num_draft_tokens == spec.num_draft_tokens > 0
    assert usage.spec_acceptance == round(spec.num_accepted_tokens / spec.num_draft_tokens, 3)
    metrics = Metrics()
    metrics.bind_engine(llm.engine, "tiny")
    text = metrics.render().decode()
    label = 'engine="0",model_name="tiny"'
    assert f"vllm:spec_decode_num_drafts_total{{{label}}} {float(spec.num_drafts)}" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {float(spec.num_draft_tokens)}" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {float(spec.num_accepted_tokens)}" in text
    first = spec.num_accepted_per_pos[0]
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}} {float(first)}' in text
    assert 0 < spec.num_accepted_per_pos[-1] <= first


def test_suffix_draft_skips_a_store_match_with_nothing_after_it():
    store = SuffixStore(10, 1000)
    store.add([1, 2, 3])  # "1 2 3" ends this output: nothing to draft from it
    assert suffix_draft(tokens(3, 9, 1, 2, 3), store, 4, 24, 4.0) == (1, [9, 1, 2, 3])


def test_greedy_equal_at_two_tensor_parallel_ranks(tiny_model_dir, tiny_model, prompts, reference):
    """The ranks run the same forward over the same rows, the draft positions included."""
    llm = LLM(str(tiny_model_dir), dtype="float32", tensor_parallel_size=2, speculative_config=SUFFIX, **SMALL)
    try:
        spec = warm(llm, prompts[:2])
        assert ids(llm, prompts[:2]) == [r.token_ids for r in reference[:2]]
        assert spec.num_accepted_tokens > 0
        assert all_blocks_free(llm)
    finally:
        llm.engine.worker.close()  # one tensor-parallel engine per process at a time


def test_a_sequence_whose_drafts_are_rejected_backs_off_and_one_accepted_draft_resets_it(tiny_model):
    spec = Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    seq = Sequence(EngineRequest([1, 2, 3, 1, 2], [], GREEDY, 40), RequestStream(4).sender(), None)
    assert spec.propose(seq, 8) == [3, 1, 2]
    waits = []
    for _ in range(3):
        spec.verified(seq, 3, 0)
        waits.append(next(n for n in range(20) if spec.propose(seq, 8)))  # steps without a draft
    assert waits == [1, 2, 4]
    spec.verified(seq, 3, 1)
    assert seq.num_steps_without_draft == 0 and seq.num_speculative_tokens == 2
    assert spec.propose(seq, 8) == [3, 1]


def test_no_draft_while_a_reasoning_budget_may_replace_tokens_or_near_max_tokens():
    spec = Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=1))
    prompt = [1, 2, 3, 1, 2]
    budgeted = SamplingParams(temperature=0, max_tokens=40, reasoning_budget=8)
    thinking = EngineRequest(prompt, [], budgeted, 40, reasoning_end_ids=(7,))
    assert thinking.reasoning_budget is not None
    assert spec.propose(Sequence(thinking, RequestStream(4).sender(), None), 8) == []
    assert spec.propose(Sequence(EngineRequest(prompt, [], budgeted, 40), RequestStream(4).sender(), None), 8)
    near_end = Sequence(EngineRequest(prompt, [], GREEDY, 3), RequestStream(4).sender(), None)
    assert spec.propose(near_end, 8) == [3, 1]  # two more tokens after the next one, at most


def test_speculation_is_off_beside_async_scheduling_and_says_so(tiny_model, caplog):
    engine = Engine(tiny_model, EngineConfig(async_scheduling=True, speculative_config=SUFFIX, **SMALL))
    assert engine.speculator is None and engine.scheduler.speculator is None
    assert "spec_decode.off" in caplog.text and "async_scheduling" in caplog.text
