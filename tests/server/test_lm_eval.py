"""lm-evaluation-harness against atom_anyio (issue 13): its ``local-completions`` model scores tasks through
a real ``hypercorn atom_anyio:app`` process, and its ``hf`` backend on the same float32 weights is the
reference, per sample: the same loglikelihoods (``echo`` + ``logprobs`` prompt logprobs), the same greedy
generations, the same accuracy. The tasks are local YAML + JSONL files; nothing comes from the hub."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from support_servers import Served, clean_env, free_port, running

MAX_MODEL_LEN = 2048
WORDS = ["river", "stone", "bird", "cloud", "tree", "light", "water", "sand", "wind", "fire"]
MC_DOCS = [
    {
        "question": f"The {w} and the {WORDS[i - 1]} met by the",
        "choices": [f" {WORDS[(i + k) % 10]}" for k in (1, 3, 6, 8)],
        "answer": i % 4,
    }
    for i, w in enumerate(WORDS)
]
GEN_PROMPTS = [f"A story of the {w}: once upon a time the {w}" for w in WORDS[:6]]
MAX_GEN_TOKS = 8
ROLLING_DOCS = [" ".join((WORDS[i:] + WORDS[:i]) * 3) for i in range(3)]
METRIC = {"aggregation": "mean", "higher_is_better": True}


def json_task(directory: Path, name: str, docs: list[dict[str, Any]], **config: Any) -> None:
    """A task over a local JSONL file; the YAML is written as JSON (a YAML subset)."""
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    dataset = {"data_files": {"test": str(directory / f"{name}.jsonl")}, "cache_dir": str(directory / "cache")}
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": dataset, "test_split": "test", **config}
    (directory / f"{name}.yaml").write_text(json.dumps(task, indent=1))


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tuple[Any, Any]:
    """transformers' model and tokenizer over the served weights, in float32."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tokenizer


def greedy_lines(reference: tuple[Any, Any], prompts: list[str]) -> list[str]:
    """transformers' greedy continuation of each prompt, up to the first newline (the gen task's ``until``)."""
    model, tokenizer = reference
    lines = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1] :])
        lines.append(text.split("\n")[0].split(tokenizer.eos_token)[0])
    return lines


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, reference) -> Path:
    """Three tasks: multiple choice (loglikelihood), generate_until, and rolling loglikelihood (perplexity).
    Half the generation targets are the model's own greedy answer, so a right score is 0.5, not 0."""
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    json_task(
        directory,
        "atom_mc",
        MC_DOCS,
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_choice="choices",
        doc_to_target="answer",
        metric_list=[{"metric": "acc", **METRIC}, {"metric": "acc_norm", **METRIC}],
    )
    answers = greedy_lines(reference, GEN_PROMPTS)
    gen_docs = [
        {"prompt": p, "answer": a if i % 2 else "no"} for i, (p, a) in enumerate(zip(GEN_PROMPTS, answers, strict=True))
    ]
    json_task(
        directory,
        "atom_gen",
        gen_docs,
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{answer}}",
        generation_kwargs={"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        metric_list=[{"metric": "exact_match", **METRIC}],
    )
    json_task(
        directory,
        "atom_rolling",
        [{"text": t} for t in ROLLING_DOCS],
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
        metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
    )
    return directory


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    env = clean_env(model=str(tiny_model_dir), dtype="float32", max_model_len=str(MAX_MODEL_LEN), kv_cache_gib="0.1")
    env |= {"HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    with running(cmd, env, port, tmp_path_factory.mktemp("lm-eval") / "hypercorn.log") as served:
        yield served


@pytest.fixture(scope="module")
def evaluate(task_dir, reference, tiny_model_dir, server) -> Iterator[Callable[[str, str], dict[str, Any]]]:
    """``evaluate(backend, task)``: lm-eval's results for one task, "hf" or "served", each run once."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
        model, tokenizer = reference
        backends = {
            "hf": HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1),
            "served": LocalCompletionsAPI(
                base_url=f"{server.url}/v1/completions",
                model=Path(tiny_model_dir).name,
                tokenizer=str(tiny_model_dir),  # lm-eval counts the context's tokens itself
                tokenizer_backend="huggingface",
                batch_size=4,  # several prompts per request
                num_concurrent=2,  # and requests in parallel
                max_retries=1,
            ),
            # no local tokenizer: lm-eval asks the server (GET /tokenizer_info, POST /tokenize, /detokenize)
            "remote": LocalCompletionsAPI(
                base_url=f"{server.url}/v1/completions",
                model=Path(tiny_model_dir).name,
                tokenizer_backend="remote",
                batch_size=4,
                max_retries=1,
            ),
        }

        @cache
        def run(backend: str, task: str) -> dict[str, Any]:
            results = lm_eval.simple_evaluate(
                model=backends[backend], tasks=[task], task_manager=tasks, bootstrap_iters=0
            )
            return {"metrics": results["results"][task], "samples": results["samples"][task]}

        yield run


def responses(result: dict[str, Any]) -> list[Any]:
    return [s["filtered_resps"] for s in sorted(result["samples"], key=lambda s: s["doc_id"])]


def metrics(result: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    return {name: result["metrics"][f"{name},none"] for name in names}


def test_generate_until_writes_the_hf_backends_greedy_answers(evaluate):
    hf, served = evaluate("hf", "atom_gen"), evaluate("served", "atom_gen")
    assert responses(served) == responses(hf)
    assert all(r[0] for r in responses(served))  # each wrote something before the newline
    assert metrics(served, ("exact_match",)) == metrics(hf, ("exact_match",)) == {"exact_match": 0.5}


def test_multiple_choice_loglikelihoods_match_the_hf_backend(evaluate):
    hf, served = evaluate("hf", "atom_mc"), evaluate("served", "atom_mc")
    for served_doc, hf_doc in zip(responses(served), responses(hf), strict=True):
        assert len(served_doc) == len(hf_doc) == len(MC_DOCS[0]["choices"])
        for (served_ll, served_greedy), (hf_ll, hf_greedy) in zip(served_doc, hf_doc, strict=True):
            assert served_ll < 0 and math.isclose(served_ll, hf_ll, rel_tol=1e-4, abs_tol=1e-4)
            assert served_greedy == hf_greedy
    assert metrics(served, ("acc", "acc_norm")) == metrics(hf, ("acc", "acc_norm"))


def test_rolling_loglikelihood_perplexity_matches_the_hf_backend(evaluate):
    hf, served = evaluate("hf", "atom_rolling"), evaluate("served", "atom_rolling")
    for (served_ll,), (hf_ll,) in zip(responses(served), responses(hf), strict=True):
        assert served_ll < 0 and math.isclose(served_ll, hf_ll, rel_tol=1e-5)
    names = ("word_perplexity", "byte_perplexity", "bits_per_byte")
    for name, value in metrics(served, names).items():
        assert math.isclose(value, metrics(hf, names)[name], rel_tol=1e-4)


def test_the_remote_tokenizer_backend_needs_no_local_tokenizer_and_scores_the_same(evaluate, server, reference):
    from lm_eval.utils import RemoteTokenizer

    _, tokenizer = reference
    remote = RemoteTokenizer(server.url)
    text = MC_DOCS[0]["question"] + MC_DOCS[0]["choices"][0]
    assert remote.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert remote.decode(remote.encode(text)) == text
    assert (remote.eos_token, remote.eos_token_id) == (tokenizer.eos_token, tokenizer.eos_token_id)
    messages = [{"role": "user", "content": "hi"}]
    assert remote.apply_chat_template(messages) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert responses(evaluate("remote", "atom_mc")) == responses(evaluate("served", "atom_mc"))
