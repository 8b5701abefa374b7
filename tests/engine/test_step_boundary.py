"""The worker boundary is plain data: every step the real engine sends (grammar masks, a wind-down,
drafts, prompt logprobs included) and every result it gets back pickle, and the worker run on the
unpickled copy of a step gives the same result. The output side alone advances the grammar."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import anyio
import jsonschema
import pytest

from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import Grammars
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.step import StepInput, StepOutput
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs

pytestmark = pytest.mark.anyio

NOTE = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "tags"],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def same(a: StepOutput, b: StepOutput) -> bool:
    return replace(a, timings={}) == replace(b, timings={})


async def test_each_real_step_and_result_pickle_and_the_worker_runs_the_copy_the_same(tiny_model, monkeypatch):
    engine = Engine(tiny_model, EngineConfig(max_model_len=1024, kv_cache_gib=0.02, speculative_config=NGRAM))
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    constraint = grammars.constraint(StructuredOutputs("json", NOTE))
    worker, execute = engine.worker, engine.worker.execute
    seen: list[tuple[StepInput, StepOutput]] = []

    def spy(step: StepInput) -> StepOutput:
        out = execute(step)
        # the same step again from its pickled copy: it rewrites the same KV and samples the same
        # (the seeded rows' draws are functions of seed and step)
        again = execute(pickle.loads(pickle.dumps(step)))
        assert same(pickle.loads(pickle.dumps(out)), again), (step, out, again)
        seen.append((step, out))
        return out

    monkeypatch.setattr(worker, "execute", spy)
    echo = tiny_model.tokenizer.encode("one two three four one two three four one two three four")
    requests = [
        # free strings at temperature 1 near max_tokens: the wind-down closes them
        *(
            EngineRequest.of_tokens(
                [5, 6, 7], SamplingParams(temperature=1.0, seed=s, max_tokens=40), engine, constraint
            )
            for s in range(3)
        ),
        # greedy on a repeating prompt: ngram drafts, verified in the step
        EngineRequest.of_tokens(echo, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), engine),
        # prompt logprobs and sampled logprobs
        EngineRequest.of_tokens(
            echo, SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2), engine
        ),
    ]
    texts, closing = [""] * len(requests), [0] * len(requests)

    async def one(i: int, request: EngineRequest) -> None:
        async with engine.submit(request) as stream:
            async for d in stream:
                texts[i] += d.text
                closing[i] = d.num_closing_tokens or closing[i]

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with anyio.create_task_group() as inner:
            for i, request in enumerate(requests):
                inner.start_soon(one, i, request)
        tg.cancel_scope.cancel()

    steps = [step for step, _ in seen]
    assert any(s.sampling.masked_rows and s.sampling.bitmask is not None for s in steps)
    assert any(s.draft_token_ids for s in steps) and any(out.num_accepted for _, out in seen)
    assert any(s.prompt_rows for s in steps)
    assert all(closing[:3]), closing  # each constrained output was wound down, by the output side
    for text in texts[:3]:
        jsonschema.validate(json.loads(text), NOTE)
