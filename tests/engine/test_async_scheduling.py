"""Async scheduling (``async_scheduling``): step N+1 is scheduled and sent while step N runs, its
decode inputs filled in by the worker from step N's sampled ids. Every output must equal the
synchronous engine's (and transformers'), with nothing streamed or counted past a stop, and every
block back in the pool at the end."""

from __future__ import annotations

import gc
import json
import random
import threading

import anyio
import pytest
import torch
import transformers
from support_fakes import FakeSampler, ScriptedSampler
from support_models import WORDS
from support_servers import serving_app

from atom_anyio import LLM
from atom_anyio.cli import build_parser
from atom_anyio.config import Config
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import Grammars
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.scheduler import runs_ahead
from atom_anyio.engine.sequence import Sequence
from atom_anyio.engine.stream import ChoiceDelta, collect
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs
from atom_anyio.settings import ConfigError

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def prompts(tiny_model) -> list[list[int]]:
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 70))) for _ in range(10)]
    return [tiny_model.tokenizer(t)["input_ids"] for t in texts]


class StepLog:
    """Wraps the worker's ``execute`` (the real one runs): per step, how many input tokens came
    from the previous step's sampled ids. And checks, on every call of the real functions, that no
    sequence in a step in flight is preempted or has its blocks freed."""

    def __init__(self, engine: Engine):
        self.prev_tokens: list[int] = []
        self.num_freed = 0
        execute, free_seq, preempt = engine.worker.execute, engine.block_manager.free_seq, engine.scheduler._preempt

        def logged_execute(step):
            self.prev_tokens.append(len(step.prev_tokens))
            return execute(step)

        def checked_free_seq(seq, lease=False):
            assert not (seq.block_table and seq.num_scheduled_tokens), "blocks freed while a step writes them"
            self.num_freed += bool(seq.block_table)
            free_seq(seq, lease)

        def checked_preempt(seq):
            assert not seq.num_scheduled_tokens, "a sequence in a step in flight was preempted"
            preempt(seq)

        engine.worker.execute = logged_execute
        engine.block_manager.free_seq = checked_free_seq
        engine.scheduler._preempt = checked_preempt


def engine_of(tiny_model, overlapped: bool, **cfg) -> Engine:
    return Engine(tiny_model, EngineConfig(async_scheduling=overlapped, **{"max_model_len": 512, **cfg}))


async def run(
    engine: Engine, items: list[tuple[list[int], SamplingParams]], constraints=None
) -> list[list[ChoiceDelta]]:
    """Every request at once; each request's choices folded into one delta each."""
    results: list[list[ChoiceDelta]] = [[] for _ in items]
    constraints = constraints or [None] * len(items)

    async def one(i: int) -> None:
        ids, params = items[i]
        results[i] = await collect(
            engine.submit(EngineRequest.of_tokens(ids, params, engine, constraints[i])), params.n
        )

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with anyio.create_task_group() as requests:
            for i in range(len(items)):
                requests.start_soon(one, i)
        tg.cancel_scope.cancel()
    return results


def summary(results: list[list[ChoiceDelta]]) -> list[list[tuple]]:
    """What a client sees of each choice: text, tokens, why it ended, and the usage counts."""
    return [
        [(d.text, d.token_ids, d.finish_reason, d.stop_reason, d.num_output_tokens, d.num_prompt_tokens) for d in r]
        for r in results
    ]


async def both(tiny_model, items, constraints=None, **cfg) -> tuple[list, list, Engine]:
    """The same requests through the synchronous and the overlapped engine; checks that the
    overlapped one ran ahead (and never preempted or freed a sequence in flight), and that it ends
    with every block free and no step or sequence left in it."""
    sync = await run(engine_of(tiny_model, False, **cfg), items, constraints)
    engine = engine_of(tiny_model, True, **cfg)
    log = StepLog(engine)
    overlapped = await run(engine, items, constraints)
    assert sum(log.prev_tokens) > 0, "no step took its input from the step before it"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine._in_flight and not engine.scheduler.running and not engine.scheduler.waiting
    return summary(sync), summary(overlapped), engine


def hf_greedy(model_dir, prompt: list[int], num_tokens: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, min_new_tokens=num_tokens)
    return out[0, len(prompt) :].tolist()


async def test_single_request_equals_transformers_and_steps_run_back_to_back(tiny_model, tiny_model_dir, prompts):
    engine = engine_of(tiny_model, True)
    log = StepLog(engine)
    (out,) = (await run(engine, [(prompts[0], GREEDY)]))[0]
    assert out.token_ids == hf_greedy(tiny_model_dir, prompts[0], GREEDY.max_tokens)
    assert out.num_output_tokens == GREEDY.max_tokens
    # the prefill, then every decode's input taken from the step before it (none past the last token)
    assert log.prev_tokens == [0] + [1] * (GREEDY.max_tokens - 1)


async def test_batched_mixed_lengths_and_chunked_prefill_equal_the_synchronous_engine(tiny_model, prompts):
    items = [(p, GREEDY) for p in prompts]
    sync, overlapped, _ = await both(tiny_model, items, enable_prefix_caching=False)
    assert overlapped == sync
    sync, overlapped, _ = await both(tiny_model, items, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert overlapped == sync


async def test_a_step_runs_with_the_blocks_it_was_scheduled_with(tiny_model):
    # 32-token prompts: the first decode needs a new block, which the loop adds while the prefill
    # runs; the prefill is held until that happened, then must still see its own block tables
    engine = engine_of(tiny_model, True)
    ahead = threading.Event()
    schedule, execute = engine.scheduler.schedule, engine.worker.execute
    seen: list[list[tuple[int, int]]] = []

    def scheduling():
        batch = schedule()
        if engine._in_flight and batch.seqs:
            ahead.set()
        return batch

    def checked(step):
        if not seen:
            assert ahead.wait(30)
        seen.append([(len(t), c) for t, c in zip(step.block_tables, step.context_lens, strict=True)])
        return execute(step)

    engine.scheduler.schedule, engine.worker.execute = scheduling, checked
    prompts = [[100 + i] * 32 for i in range(4)]
    await run(engine, [(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for p in prompts])
    bs = engine.block_manager.block_size
    assert len(seen) == 4 and all(n == -(-c // bs) for step in seen for n, c in step)


async def test_stops_end_the_output_at_the_same_token_with_the_same_usage(tiny_model, prompts):
    plain = await run(engine_of(tiny_model, False), [(prompts[2], GREEDY)])
    ref = plain[0][0]
    stop_text = ref.text[10:14]
    stop_token = ref.token_ids[6]
    eos_id = engine_of(tiny_model, False).eos_token_ids[0]
    eos = SamplingParams(temperature=0, max_tokens=16, logit_bias={eos_id: 100.0}, min_tokens=3)  # EOS 4th
    items = [
        (prompts[2], SamplingParams(temperature=0, max_tokens=16, stop=[stop_text])),
        (prompts[2], SamplingParams(temperature=0, max_tokens=16, stop=[stop_text], include_stop_str_in_output=True)),
        (prompts[2], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token])),
        (prompts[2], eos),
        (prompts[3], SamplingParams(temperature=0, max_tokens=1)),
        (prompts[4], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
        (prompts[5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        (prompts[1], GREEDY),
    ]
    sync, overlapped, _ = await both(tiny_model, items)
    assert overlapped == sync
    (by_string,), _, (by_token,), (by_eos,), (one,), (two,), (three,), _ = overlapped
    assert by_string[2:4] == ("stop", stop_text) and by_string[0] == ref.text[: ref.text.index(stop_text)]
    assert by_token[1] == ref.token_ids[: ref.token_ids.index(stop_token) + 1] and by_token[3] == stop_token
    assert by_eos[1][-1] == eos_id and by_eos[2] == "stop" and by_eos[4] == len(by_eos[1]) == 4
    assert [len(one[1]), len(two[1]), len(three[1])] == [1, 2, 3] == [one[4], two[4], three[4]]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_an_abandoned_request_frees_its_blocks_and_the_others_are_unaffected(tiny_model, prompts):
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (ref_a,), (ref_b,) = await run(engine_of(tiny_model, False), [(prompts[0], long), (prompts[1], long)])
    engine = engine_of(tiny_model, True)
    log = StepLog(engine)
    bm = engine.block_manager
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        leaving = engine.submit(EngineRequest.of_tokens(prompts[6], long, engine))
        kept_a = engine.submit(EngineRequest.of_tokens(prompts[0], long, engine))
        kept_b = engine.submit(EngineRequest.of_tokens(prompts[1], long, engine))
        got = [await leaving.receive() for _ in range(3)]  # mid-stream, steps in flight
        await leaving.aclose()
        a, b = await collect(kept_a, 1), await collect(kept_b, 1)
        assert not engine.scheduler.running and bm.num_free_blocks == bm.num_blocks
        tg.cancel_scope.cancel()
    assert [d.num_output_tokens for d in got] == [1, 2, 3] and log.num_freed == 3
    assert (a[0].token_ids, b[0].token_ids) == (ref_a.token_ids, ref_b.token_ids)
    assert (a[0].num_output_tokens, b[0].num_output_tokens) == (40, 40)
    del leaving, kept_a, kept_b, got
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Sequence)]


async def test_preemption_under_a_tiny_pool_equals_the_synchronous_engine(tiny_model, prompts):
    items = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in prompts]
    sync, overlapped, engine = await both(tiny_model, items, num_kv_blocks=24, max_model_len=256)
    assert engine.scheduler.num_preemptions > 0
    assert overlapped == sync


async def test_grammar_penalty_and_seeded_requests_fall_back_and_stay_exact(tiny_model, prompts):
    grammars = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size, [2])
    constraint = grammars.constraint(StructuredOutputs("choice", ["yes", "no", "maybe"]))
    # a biased token repeats until the penalty of its repeats outweighs the bias: the count matters
    repeat = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    penalised = SamplingParams(**repeat, logit_bias={100: 10.0}, repetition_penalty=2.0)
    presence = SamplingParams(**repeat, logit_bias={100: 20.0}, frequency_penalty=2.0)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True, min_tokens=5)
    items = [(prompts[0], GREEDY), (prompts[1], penalised), (prompts[2], GREEDY), (prompts[3], presence)]
    items += [(prompts[4], SamplingParams(temperature=0, max_tokens=8)), (prompts[5], seeded)]
    constraints = [None, None, None, None, constraint, None]
    sync, overlapped, _ = await both(tiny_model, items, constraints)
    assert overlapped == sync
    assert overlapped[4][0][0] in ("yes", "no", "maybe") and overlapped[4][0][2] == "stop"
    for _, ids, *_ in (overlapped[1][0], overlapped[3][0]):
        assert ids[0] == 100 and 1 <= ids.count(100) < len(ids)


async def test_n_choices_equal_the_synchronous_engine(tiny_model, prompts):
    items = [
        (prompts[5], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)),
        (prompts[6], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)),
        (prompts[7], GREEDY),
    ]
    sync, overlapped, _ = await both(tiny_model, items)
    assert overlapped == sync
    assert overlapped[0][0][1] == overlapped[0][1][1]
    assert len({tuple(choice[1]) for choice in overlapped[1]}) > 1


async def test_prefix_cache_hits_and_generated_blocks_are_exact(tiny_model, prompts):
    engine = engine_of(tiny_model, True)
    bm = engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = summary(await run(engine, [(p, params) for p in prompts[:4]]))
    before = bm.num_hit_tokens
    again = summary(await run(engine, [(p, params) for p in prompts[:4]]))
    assert again == first
    assert bm.num_hit_tokens - before == sum((len(p) - 1) // bm.block_size * bm.block_size for p in prompts[:4])
    # the generated tokens' blocks were committed with their own tokens only: a prompt made of a
    # prompt and its output hits them all and continues exactly as the synchronous engine does
    extended = [p + out[0][1] for p, out in zip(prompts[:4], first, strict=True)]
    before = bm.num_hit_tokens
    cont = summary(await run(engine, [(p, GREEDY) for p in extended]))
    assert bm.num_hit_tokens - before == sum((len(p) - 1) // bm.block_size * bm.block_size for p in extended)
    assert cont == summary(
        await run(engine_of(tiny_model, False, enable_prefix_caching=False), [(p, GREEDY) for p in extended])
    )
    assert bm.num_free_blocks == bm.num_blocks


async def test_a_failed_step_fails_both_steps_in_flight_and_the_engine_serves_on(tiny_model, prompts):
    sampler = FakeSampler()
    engine = Engine(tiny_model, EngineConfig(async_scheduling=True, max_model_len=512), sampler)
    sampler.fake = ScriptedSampler(tiny_model.tokenizer, "one two three four five six seven", fail_at=4)
    params = SamplingParams(temperature=0, max_tokens=12)
    failed = await run(engine, [(prompts[0], params), (prompts[1], params)])
    assert [r[0].finish_reason for r in failed] == ["error", "error"]
    assert all("device lost" in r[0].error and r[0].num_output_tokens == 4 for r in failed)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and engine.outputs.num_consecutive_failures == 1
    sampler.fake = ScriptedSampler(tiny_model.tokenizer, "fine")
    ((ok,),) = await run(engine, [(prompts[2], params)])
    assert (ok.text, ok.finish_reason) == ("fine", "stop")


async def test_the_server_answers_the_same_with_it_on(tiny_model):
    async def answers(**config) -> list:
        async with serving_app(tiny_model, kv_cache_gib=0.05, max_model_len=512, **config) as atom:
            client = atom.quart.test_client()
            whole = {"prompt": "The river runs", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
            full = (await (await client.post("/v1/completions", json=whole)).get_json())["choices"][0]["text"]
            stopped = {**whole, "stop": [full[6:9]], "stream": True, "stream_options": {"include_usage": True}}
            body = (await (await client.post("/v1/completions", json=stopped)).get_data()).decode()
            events = [json.loads(f.removeprefix("data: ")) for f in body.split("\n\n")[:-2]]
            text = "".join(c["text"] for e in events for c in e["choices"])
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            return [full, text, finish, events[-1]["usage"]]

    sync, overlapped = await answers(), await answers(async_scheduling=True)
    assert overlapped == sync and sync[2] == ["stop"] and sync[3]["completion_tokens"] < 12


def test_the_cuda_graph_path_takes_the_previous_tokens_too(tiny_model_dir):
    # the padded static-buffer decode (CUDA graphs without the capture, on a CPU) fills them on the host
    cfg = {"attention_backend": "torch", "cuda_graphs": True, "max_num_seqs": 4, "num_kv_blocks": 16}
    sync, overlapped = (LLM(str(tiny_model_dir), async_scheduling=a, max_model_len=256, **cfg) for a in (False, True))
    log = StepLog(overlapped.engine)
    prompts = [sync.tokenizer("the river runs over the stone " * n)["input_ids"] for n in (1, 2, 3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (sync, overlapped)
    ]
    assert ids[0] == ids[1] and all(len(i) == 6 for i in ids[1])
    assert 4 in overlapped.engine.worker.graphs.metas and log.prev_tokens[1:] == [3] * 5


def test_the_eligibility_rule(tiny_model, prompts):
    engine = engine_of(tiny_model, True)

    def seq(params: SamplingParams, **request) -> Sequence:
        return engine._new_sequence(EngineRequest.of_tokens(prompts[0], params, engine, **request), _Stream(), 0)

    assert runs_ahead(seq(GREEDY))
    assert not runs_ahead(seq(SamplingParams(max_tokens=4, frequency_penalty=0.5)))
    assert not runs_ahead(seq(SamplingParams(max_tokens=4, prompt_logprobs=1)))
    last = seq(SamplingParams(max_tokens=1))
    assert runs_ahead(last)
    last.num_placeholders = 1  # its one token is in flight: nothing after it is wanted
    assert not runs_ahead(last)
    parent = seq(GREEDY)
    parent.siblings = [seq(GREEDY)]
    assert not runs_ahead(parent)


class _Stream:
    def sender(self):
        return None


def test_the_setting_is_wired_and_refused_with_tensor_parallelism():
    assert Config.of().engine.async_scheduling is False
    assert Config.from_env({"ATOM_ASYNC_SCHEDULING": "1"}).engine.async_scheduling is True
    args = build_parser().parse_args(["serve", "--async-scheduling"])
    assert Config.from_env({}, async_scheduling=args.async_scheduling).engine.async_scheduling is True
    args = build_parser().parse_args(["serve", "--async-scheduling", "false"])
    assert args.async_scheduling is False
    with pytest.raises(ConfigError, match="async_scheduling runs with tensor_parallel_size 1 only"):
        Config.of(async_scheduling=True, tensor_parallel_size=2)
