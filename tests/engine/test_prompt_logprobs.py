"""Prompt logprobs: computed in the prefill the request runs, exact against transformers in
float32, through the offline LLM and the OpenAI routes (completions' echo + logprobs, which
evaluation harnesses score with, and vLLM's prompt_logprobs)."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
import torch
import transformers
from support_models import TINY_VOCAB_SIZE

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config
from atom_anyio.llm import LLM
from atom_anyio.sampling_params import SamplingParams

NUM_TOP = 3


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(rng.randint(2, 70))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' float32 log_softmax over each prompt's positions."""

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return ref


def assert_prompt_logprobs_match(prompt_logprobs, ids: list[int], ref: torch.Tensor, num_top: int) -> None:
    """Token i's logprob (from position i - 1), its rank and its top alternatives equal transformers'."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        lp, row = prompt_logprobs[i], ref[i - 1]
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        rank = int((row > row[ids[i]]).sum()) + 1
        assert abs(lp.rank - rank) <= max(1, rank // 1000)  # ties deep in the vocabulary may order differently
        top_values, top_ids = row.topk(num_top)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)


# the offline LLM


def test_prompt_logprobs_equal_transformers_alone_batched_chunked_and_after_a_prefix_hit(tiny_model, reference):
    prompts = random_prompts(6)
    refs = [reference(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=NUM_TOP, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = LLM(tiny_model, max_num_batched_tokens=16)  # prefills in chunks of at most 16 tokens
    without = [r.outputs[0].token_ids for r in llm.generate(prompts, plain, use_tqdm=False)]  # now all cached
    batched = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:2]]
    for out, ids, ref in zip([*batched, *alone], [*prompts, *prompts[:2]], [*refs, *refs[:2]], strict=True):
        assert_prompt_logprobs_match(out.prompt_logprobs, ids, ref, NUM_TOP)
        assert out.num_cached_tokens == 0  # the cached prefix was recomputed: its rows were asked for
    assert [r.outputs[0].token_ids for r in batched] == without  # asking changes no token


def test_preempted_prefill_keeps_each_prompt_logprob_once(tiny_model, reference):
    prompts = random_prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0, ignore_eos=True)
    llm = LLM(tiny_model, num_kv_blocks=20, max_model_len=256, max_num_batched_tokens=32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, ids in zip(outs, prompts, strict=True):
        assert_prompt_logprobs_match(out.prompt_logprobs, ids, reference(ids), 0)


def test_max_tokens_0_returns_the_prompt_logprobs_alone_for_every_choice(tiny_model, reference):
    [ids] = random_prompts(1, seed=2)
    llm = LLM(tiny_model)
    [out] = llm.generate([ids], SamplingParams(n=2, max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in out.outputs] == [([], "length"), ([], "length")]
    assert_prompt_logprobs_match(out.prompt_logprobs, ids, reference(ids), 1)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_one_token_prompt_has_only_the_none_entry(tiny_model):
    [out] = LLM(tiny_model).generate([[42]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert out.prompt_logprobs == [None]


# the OpenAI routes


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def client(tiny_model):
    atom = AtomApp(Config.of(max_model_len=2048, kv_cache_gib=0.05), loaded=tiny_model)
    async with atom.serving():
        yield atom.quart.test_client()


async def post(client, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = await client.post(path, json=body)
    data = await r.get_json()
    assert r.status_code == status, data
    return data


def echo_body(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "echo": True, "logprobs": NUM_TOP, "max_tokens": 1, "temperature": 0, **fields}


def assert_echo_logprobs_match(logprobs: dict[str, Any], ids: list[int], ref: torch.Tensor, tokenizer) -> None:
    """The legacy shape over the echoed prompt: None first, then transformers' values; each position's
    alternatives hold its own token; offsets add up the token texts."""
    n = len(ids)
    texts = [tokenizer.decode([t]) for t in ids]
    assert logprobs["tokens"][:n] == texts
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, n):
        assert logprobs["token_logprobs"][i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = logprobs["top_logprobs"][i]
        assert top[texts[i]] == logprobs["token_logprobs"][i]
        best = ref[i - 1].max().item()
        assert max(top.values()) == pytest.approx(best, abs=1e-4)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(
        offsets[i + 1] - offsets[i] == len(logprobs["tokens"][i]) for i in range(len(offsets) - 1)
    )


@pytest.mark.anyio
async def test_completions_echo_with_logprobs_scores_token_id_and_batched_prompts(client, tiny_model, reference):
    prompts = random_prompts(3, seed=3)
    data = await post(client, "/v1/completions", echo_body(prompts))
    assert len(data["choices"]) == 3
    for choice, ids in zip(sorted(data["choices"], key=lambda c: c["index"]), prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one completion token
        assert_echo_logprobs_match(lp, ids, reference(ids), tiny_model.tokenizer)
        generated = ids + [tiny_model.tokenizer.convert_tokens_to_ids(lp["tokens"][-1])]
        assert lp["token_logprobs"][-1] == pytest.approx(reference(generated)[-2].max().item(), abs=1e-4)  # greedy
        assert choice["text"] == tiny_model.tokenizer.decode(ids) + lp["tokens"][-1]
    assert data["usage"]["prompt_tokens"] == sum(map(len, prompts))


@pytest.mark.anyio
async def test_completions_echo_of_a_string_prompt_and_max_tokens_0(client, tiny_model, reference):
    prompt = "The river runs over the bright stone"
    ids = tiny_model.tokenizer(prompt)["input_ids"]
    data = await post(client, "/v1/completions", echo_body(prompt, max_tokens=0))
    [choice] = data["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert_echo_logprobs_match(choice["logprobs"], ids, reference(ids), tiny_model.tokenizer)
    assert len(choice["logprobs"]["tokens"]) == len(ids)  # the prompt alone
    assert data["usage"]["completion_tokens"] == 0
    # without logprobs, the prompt alone and no logprobs
    plain = await post(client, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0})
    assert plain["choices"][0]["text"] == prompt and plain["choices"][0]["logprobs"] is None


@pytest.mark.anyio
async def test_streamed_echo_with_logprobs_equals_the_whole_response(client):
    prompts = random_prompts(2, seed=4)
    body = echo_body(prompts, max_tokens=4, ignore_eos=True, n=2)
    whole = await post(client, "/v1/completions", body)
    r = await client.post("/v1/completions", json={**body, "stream": True})
    lines = [ln.removeprefix("data: ") for ln in (await r.get_data()).decode().split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    merged: dict[int, dict[str, Any]] = {}
    for chunk in map(json.loads, lines[:-1]):
        for c in chunk["choices"]:
            m = merged.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []})
            m["text"] += c["text"]
            for key in ("tokens", "token_logprobs", "text_offset"):
                m[key] += (c["logprobs"] or {}).get(key, [])
    assert len(merged) == 4
    for c in whole["choices"]:
        m = merged[c["index"]]
        assert m["text"] == c["text"]
        assert m["tokens"] == c["logprobs"]["tokens"]
        assert m["text_offset"] == c["logprobs"]["text_offset"]
        assert [None if v is None else round(v, 4) for v in m["token_logprobs"]] == [
            None if v is None else round(v, 4) for v in c["logprobs"]["token_logprobs"]
        ]


@pytest.mark.anyio
async def test_vllm_prompt_logprobs_on_completions_and_chat(client, tiny_model, reference):
    [ids] = random_prompts(1, seed=5)
    data = await post(client, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2})
    [choice] = data["choices"]
    check_vllm_prompt_logprobs(choice["prompt_logprobs"], ids, reference(ids), 2)
    assert choice["logprobs"] is None  # the completion's were not asked for
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    chat = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1})
    encoded = tiny_model.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    chat_ids = list(encoded["input_ids"])
    check_vllm_prompt_logprobs(chat["prompt_logprobs"], chat_ids, reference(chat_ids), 1)


def check_vllm_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, num_top: int) -> None:
    """vLLM's shape: per token, {token id: {logprob, rank, decoded_token}} with its own and the top's."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top_ids = ref[i - 1].topk(num_top).indices.tolist()
        assert {str(t) for t in top_ids} <= set(entry) <= {str(t) for t in top_ids} | {str(ids[i])}
        for rank, t in enumerate(top_ids, 1):
            if t != ids[i]:
                assert entry[str(t)]["rank"] == rank
        assert all(isinstance(e["decoded_token"], str) and math.isfinite(e["logprob"]) for e in entry.values())


@pytest.mark.anyio
async def test_echo_with_structured_outputs_follows_the_grammar_after_the_prompt(client):
    data = await post(client, "/v1/completions", echo_body("Pick one:", max_tokens=4, guided_choice=["yes", "no"]))
    [choice] = data["choices"]
    assert choice["text"] in ("Pick one:yes", "Pick one:no")
    assert choice["logprobs"]["token_logprobs"][0] is None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 1, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": [5] * 2100, "echo": True, "logprobs": 1}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
    ],
)
async def test_prompt_logprob_requests_it_cannot_serve_are_a_400_naming_the_field(client, path, body, param):
    data = await post(client, path, body, status=400)
    assert data["error"]["param"] == param, data
