"""The engine end to end: exactness, batching, caching, preemption, abort."""

from __future__ import annotations

import copy
import gc
import random
import tracemalloc
import weakref
from pathlib import Path

import anyio
import pytest
import torch
from support_models import WORDS

from atom_anyio import LLM, SamplingParams
from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.engine.block_manager import BlockManager
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.sequence import Sequence
from atom_anyio.models.loader import load_model
from atom_anyio.prompt.prepare import PromptError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90)))
        out.append(tokenizer(text)["input_ids"])
    return out


def greedy_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model)


@pytest.fixture(scope="module")
def prompts16(tiny_model):
    return mixed_prompts(tiny_model.tokenizer, 16)


@pytest.fixture(scope="module")
def reference16(tiny_model, prompts16):
    """Each prompt alone, no prefix cache: the reference every variant must equal."""
    llm = LLM(tiny_model, enable_prefix_caching=False)
    return [greedy_ids(llm, [p])[0] for p in prompts16]


def first_divergence_within_top_k(ours: list[int], our_top: list[set[int]], ref: list[int], ref_top: list[set[int]]):
    """The standard low-precision comparison: the tokens are equal, or at the
    first step where they differ each side's token is in the other's top k
    (after that the two continue from different text)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            assert a in ref_top[i] and b in our_top[i], (
                f"step {i}: ours {a} not in {ref_top[i]} or {b} not in {our_top[i]}"
            )
            return i
    return None


@pytest.mark.slow
def test_smollm2_bfloat16_greedy_matches_transformers_bfloat16_within_top5(smollm2_transformers):
    from atom_anyio.models.loader import load_model

    hf = copy.deepcopy(smollm2_transformers).to(torch.bfloat16)  # what loading the GGUF in bfloat16 gives
    loaded = load_model(None, dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype is torch.bfloat16
    tok = loaded.tokenizer
    llm = LLM(loaded)
    for question in ["What is the capital of France?", "Write a haiku about the sea."]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        our_top = [{t for t, _ in lp.top} | {lp.token_id} for lp in out.logprobs]
        with torch.inference_mode():
            x = torch.tensor([ids])
            ref = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref_ids = ref.sequences[0, len(ids) :].tolist()
        ref_top = [set(step[0].topk(5).indices.tolist()) for step in ref.logits]
        first_divergence_within_top_k(list(out.token_ids), our_top, ref_ids, ref_top)


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(smollm2, smollm2_transformers):
    hf = smollm2_transformers
    tok = smollm2.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a hash table is in two sentences.",
        "List three prime numbers and say why they are prime.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    llm = LLM(smollm2)
    ours = greedy_ids(
        llm, [{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    )
    for prompt_ids, got in zip(ids, ours, strict=True):
        with torch.inference_mode():
            x = torch.tensor([prompt_ids])  # an explicit mask: the pad id (2) is <|im_end|>, inside every prompt
            ref = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False, eos_token_id=None
            )
        assert got == ref[0, len(prompt_ids) :].tolist()
    first = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert first.outputs[0].text.startswith("The capital of France is Paris.")


def test_greedy_alone_equals_greedy_in_a_batch_of_16(tiny_model, prompts16, reference16):
    llm = LLM(tiny_model, enable_prefix_caching=False)
    assert greedy_ids(llm, prompts16) == reference16


def test_prefix_cache_hit_leaves_greedy_output_unchanged(tiny_model, prompts16, reference16):
    llm = LLM(tiny_model)
    bm = llm.engine.block_manager
    first = greedy_ids(llm, prompts16[:4])
    hits_before = bm.num_hit_tokens
    again = greedy_ids(llm, prompts16[:4])
    assert first == again == reference16[:4]
    expected_hits = sum((len(p) - 1) // bm.block_size * bm.block_size for p in prompts16[:4])
    assert bm.num_hit_tokens - hits_before == expected_hits


def test_generated_tokens_become_cached_blocks(tiny_model, prompts16):
    llm = LLM(tiny_model)
    prompt = prompts16[0]
    out = greedy_ids(llm, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    before = llm.engine.block_manager.num_hit_tokens
    greedy_ids(llm, [prompt + out])
    bs = llm.engine.block_manager.block_size
    assert llm.engine.block_manager.num_hit_tokens - before == (len(prompt) + len(out) - 1) // bs * bs


def test_chunked_prefill_with_a_tiny_budget_leaves_greedy_output_unchanged(tiny_model, prompts16, reference16):
    llm = LLM(tiny_model, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert greedy_ids(llm, prompts16) == reference16


def test_forced_preemption_leaves_greedy_output_unchanged(tiny_model, prompts16, reference16):
    llm = LLM(tiny_model, num_kv_blocks=24, max_model_len=256)
    assert greedy_ids(llm, prompts16) == reference16
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_llm, prompts16):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = greedy_ids(tiny_llm, [prompts16[3]], seeded)[0]
    params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 16
    params[7] = seeded
    batch = [p for p in prompts16]
    batch[7] = prompts16[3]
    in_batch = [r.outputs[0].token_ids for r in tiny_llm.generate(batch, params, use_tqdm=False)]
    assert in_batch[7] == alone
    other = greedy_ids(
        tiny_llm, [prompts16[3]], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert other[0] != alone


def test_n_choices_share_the_prompt_blocks(tiny_llm, prompts16):
    prompt = prompts16[5]
    bm = tiny_llm.engine.block_manager
    before = bm.num_hit_tokens
    out = tiny_llm.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    full = (len(prompt) - 1) // bm.block_size * bm.block_size
    assert bm.num_hit_tokens - before >= 3 * full


def test_stop_string_ends_the_output_before_it(tiny_llm, prompts16):
    full = tiny_llm.generate([prompts16[2]], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 12
    stop = full[8:12]
    cut = full[: full.index(stop)]
    out = tiny_llm.generate([prompts16[2]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)
    o = out[0].outputs[0]
    assert (o.text, o.finish_reason, o.stop_reason) == (cut, "stop", stop)
    inc = SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert tiny_llm.generate([prompts16[2]], inc, use_tqdm=False)[0].outputs[0].text == cut + stop


def test_max_tokens_min_tokens_and_stop_token_ids(tiny_llm, prompts16):
    ref = greedy_ids(tiny_llm, [prompts16[1]])[0]
    stop_at = ref[5]
    first = ref.index(stop_at)
    o = tiny_llm.generate(
        [prompts16[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]), use_tqdm=False
    )
    out = o[0].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    o = tiny_llm.generate([prompts16[1]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert o[0].outputs[0].finish_reason == "length" and len(o[0].outputs[0].token_ids) == 7
    eos = tiny_llm.engine.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 100.0})
    out = tiny_llm.generate([prompts16[1]], forced, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_logprobs_are_returned_per_token(tiny_llm, prompts16):
    out = tiny_llm.generate([prompts16[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)
    o = out[0].outputs[0]
    assert len(o.logprobs) == len(o.token_ids)
    for tok, lp in zip(o.token_ids, o.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3 and lp.top[0][0] == tok and lp.logprob <= 0


def test_impossible_prompt_is_refused_at_submit(tiny_model):
    llm = LLM(tiny_model, max_model_len=64)
    with pytest.raises(PromptError, match="maximum context length is 64"):
        llm.generate([list(range(100))], SamplingParams(max_tokens=4), use_tqdm=False)
    small_pool = LLM(tiny_model, num_kv_blocks=2, max_model_len=1024)
    with pytest.raises(PromptError, match="KV cache"):
        small_pool.generate([list(range(40))], SamplingParams(max_tokens=4), use_tqdm=False)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_abort_frees_every_block_and_no_sequence_survives(tiny_model, prompts16):
    engine = Engine(tiny_model, EngineConfig(max_num_batched_tokens=64))
    bm = engine.block_manager
    initial_free = bm.num_free_blocks
    refs: list[weakref.ref] = []
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        streams = [engine.submit(EngineRequest.of_tokens(p, params, engine)) for p in prompts16[:6]]
        refs = [weakref.ref(s) for s in engine._inbox]
        # read a few deltas from some, none from others, then walk away from all
        for s in streams[:3]:
            await s.receive()
        for s in streams:
            await s.aclose()
        finished = engine.submit(
            EngineRequest.of_tokens(prompts16[7], SamplingParams(temperature=0, max_tokens=3), engine)
        )
        async with finished:
            deltas = [d async for d in finished]
        assert deltas[-1].finish_reason == "length"
        assert not engine.scheduler.running and not engine.scheduler.waiting
        tg.cancel_scope.cancel()
    assert bm.num_free_blocks == initial_free
    del streams, deltas, finished
    gc.collect()
    assert all(r() is None for r in refs)
    assert not [o for o in gc.get_objects() if isinstance(o, Sequence)]


def test_generate_cli_prints_the_completion(tiny_model_dir, capsys):
    from atom_anyio.cli import main

    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "4", "--chat"]) == 0
    llm_text = LLM(str(tiny_model_dir)).chat(
        [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert capsys.readouterr().out == llm_text[0].outputs[0].text + "\n"


def test_a_hash_collision_is_never_served_from_the_prefix_cache():
    """Two prompts made to share block hashes: only the one whose tokens match the stored block hits."""
    bm = BlockManager(num_blocks=8, block_size=4)
    forged = [101, 102]

    def sequence(token_ids: list[int]) -> Sequence:
        return Sequence(EngineRequest(token_ids, list(forged), SamplingParams(max_tokens=1), 1), None, None)

    first = sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.grow(first, len(first))
    first.num_computed_tokens = len(first)
    bm.commit(first)
    bm.free_seq(first)
    hits = bm.match_prefix(first).blocks
    assert bm.match_prefix(sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])).blocks == hits != []
    assert len(bm.match_prefix(sequence([1, 2, 3, 4, 5, 6, 7, 8, 10]))) == 2
    assert bm.match_prefix(sequence([1, 2, 3, 4, 5, 6, 0, 8, 9])).blocks == hits[:1]
    assert len(bm.match_prefix(sequence([0, 2, 3, 4, 5, 6, 7, 8, 9]))) == 0


def test_a_full_prefix_cache_costs_under_300_bytes_of_python_heap_per_block():
    bm = BlockManager(num_blocks=2048, block_size=16)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(bm.num_blocks // 4):
        tokens = list(range(n * 64 + 1000, n * 64 + 1064))  # four full blocks
        seq = Sequence(EngineRequest(tokens, block_hash_chain(tokens, 16), SamplingParams(max_tokens=1), 1), None, None)
        bm.grow(seq, len(seq))
        seq.num_computed_tokens = len(seq)
        bm.commit(seq)
        bm.free_seq(seq)
        del seq, tokens
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(bm.cached) == bm.num_blocks
    assert grown / bm.num_blocks < 300


def test_non_finite_logits_end_the_request_with_an_error_not_a_token(tiny_model_dir):
    """A NaN anywhere in a row's logits is caught on the device and read back with the sampled ids."""
    loaded = load_model(str(tiny_model_dir))
    with torch.no_grad():
        loaded.model.model.norm.weight[0] = float("nan")  # every logit NaN
    [out] = LLM(loaded).generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    [choice] = out.outputs
    assert choice.finish_reason == "error" and "non-finite logits" in choice.error
    assert choice.token_ids == []


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_the_kv_pool_is_backed_by_huge_pages_where_the_os_offers_them(tiny_model):
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    try:
        mode = thp.read_text()
    except OSError:
        pytest.skip("no transparent huge pages on this OS")
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off here ({thp}: never)")
    engine = Engine(tiny_model, EngineConfig(kv_cache_gib=0.0625))
    pool = engine.worker.kv_pool
    assert engine.worker.kv_huge_pages
    assert anon_huge_kib(pool.data_ptr() + pool.nbytes // 2) >= 2048
    assert not pool.any()  # advised before its first touch, zeroed all the same
