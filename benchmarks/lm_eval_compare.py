"""lm-evaluation-harness scoring atom_anyio against its own ``hf`` backend: same weights, same tasks.

    python benchmarks/lm_eval_compare.py [--model HF_DIR] [--dtype float32] [--batch-size 8]

Writes two local tasks (no hub): a multiple-choice one scored by loglikelihood (capitals, sums,
opposites; four choices each) and a generate_until one (the same facts as two-shot questions with
short answers). Runs lm-eval's ``hf`` backend in this process and its ``local-completions`` model
against ``hypercorn atom_anyio:app`` serving the same directory, alternating, ``--repeats`` times
each, and prints per task each backend's accuracy and fastest wall time, the largest per-sample
loglikelihood gap and how many generations differ; then one JSON line. Default model: the default
GGUF exported to a Hugging Face directory (benchmarks/export_hf.py, float32 weights). Never fails
on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentic import free_port, launched
from machine import machine

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
    "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
    "Poland": "Warsaw", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "China": "Beijing", "Kenya": "Nairobi", "Peru": "Lima", "Cuba": "Havana",
    "Hungary": "Budapest", "Belgium": "Brussels", "Thailand": "Bangkok", "Turkey": "Ankara", "Canada": "Ottawa",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "light": "dark", "old": "young",
    "happy": "sad", "early": "late", "hard": "soft", "wet": "dry", "open": "closed", "full": "empty",
    "rich": "poor", "high": "low", "strong": "weak",
}  # fmt: skip
SUMS = {f"{a} plus {b}": str(a + b) for a, b in [(i % 7 + 1, (3 * i) % 8 + 1) for i in range(25)]}
FACTS = [
    ("What is the capital of {}?", "The capital of {} is", CAPITALS),
    ("What is the opposite of {}?", "The opposite of {} is", OPPOSITES),
    ("What is {}?", "{} is", SUMS),
]
SHOTS = "Q: What is the capital of Chile?\nA: Santiago\nQ: What is the opposite of loud?\nA: quiet\n"


def documents(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(multiple-choice docs, generation docs) over the same facts; distractors from the same table."""
    rng = random.Random(seed)
    mc, gen = [], []
    for question, statement, table in FACTS:
        for key, answer in table.items():
            others = rng.sample([v for v in table.values() if v != answer], 3)
            choices = [answer, *others]
            rng.shuffle(choices)
            mc.append(
                {"text": statement.format(key), "choices": [f" {c}" for c in choices], "answer": choices.index(answer)}
            )
            gen.append({"text": f"{SHOTS}Q: {question.format(key)}\nA:", "answer": answer})
    return mc, gen


def write_tasks(directory: Path) -> list[str]:
    mc, gen = documents()
    metric = {"aggregation": "mean", "higher_is_better": True}
    tasks = {
        "facts_mc": (mc, {
            "output_type": "multiple_choice", "doc_to_text": "{{text}}", "doc_to_choice": "choices",
            "doc_to_target": "answer", "metric_list": [{"metric": "acc", **metric}, {"metric": "acc_norm", **metric}],
        }),
        "facts_gen": (gen, {
            "output_type": "generate_until", "doc_to_text": "{{text}}", "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n", ".", ","], "max_gen_toks": 8, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "ignore_case": True, "regexes_to_ignore": [" "], **metric}],
        }),
    }  # fmt: skip
    for name, (docs, config) in tasks.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        dataset = {"data_files": {"test": str(directory / f"{name}.jsonl")}, "cache_dir": str(directory / "cache")}
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": dataset, "test_split": "test", **config}
        (directory / f"{name}.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML
    return list(tasks)


def evaluate(lm: Any, task: str, tasks: Any) -> dict:
    import lm_eval

    t = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tasks, bootstrap_iters=0)
    wall_s = time.perf_counter() - t
    metrics = {k.split(",")[0]: v for k, v in out["results"][task].items() if k.endswith(",none")}
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return {"wall_s": wall_s, "metrics": metrics, "responses": [s["filtered_resps"] for s in samples]}


def compare(hf: dict, served: dict) -> dict:
    """The largest per-choice loglikelihood gap (multiple choice) or the number of differing answers."""
    pairs = list(zip(hf["responses"], served["responses"], strict=True))
    if isinstance(pairs[0][0][0], list | tuple):
        gaps = [abs(a[0] - b[0]) for h, s in pairs for a, b in zip(h, s, strict=True)]
        return {"max_loglikelihood_gap": max(gaps)}
    return {"num_different_answers": sum(h != s for h, s in pairs), "num_docs": len(pairs)}


def atom_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    settings = {"model": args.model, "dtype": args.dtype, "max_model_len": "2048", "log_format": "json"}
    return {**env, "HF_HUB_OFFLINE": "1", **{f"ATOM_{k.upper()}": v for k, v in settings.items()}}


def run(args: argparse.Namespace, task_dir: Path) -> dict:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    names = write_tasks(task_dir)
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    t = time.perf_counter()
    hf_lm = HFLM(pretrained=args.model, dtype=args.dtype, device="cpu", batch_size=args.batch_size)
    hf_load_s = time.perf_counter() - t
    port = free_port()
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    t = time.perf_counter()
    with launched("atom_anyio", cmd, atom_env(args), port, timeout_s=300) as target:
        start_s = time.perf_counter() - t
        served_lm = LocalCompletionsAPI(
            base_url=f"{target.url}/v1/completions",
            model=Path(args.model).name,
            tokenizer=args.model,
            tokenizer_backend="huggingface",
            batch_size=args.batch_size,
            num_concurrent=args.num_concurrent,
            max_length=2048,
        )
        # alternate the two, and keep each one's fastest run: other load on the machine moves the times
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):
            for name in names:
                runs.setdefault(("hf", name), []).append(evaluate(hf_lm, name, tasks))
                runs.setdefault(("atom_anyio", name), []).append(evaluate(served_lm, name, tasks))
    hf, served = ({n: min(runs[b, n], key=lambda r: r["wall_s"]) for n in names} for b in ("hf", "atom_anyio"))
    return {
        "model": args.model,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "num_concurrent": args.num_concurrent,
        "repeats": args.repeats,
        "hf_load_s": hf_load_s,
        "atom_start_s": start_s,
        "tasks": {
            name: {"hf": _summary(hf[name]), "atom_anyio": _summary(served[name]), **compare(hf[name], served[name])}
            for name in names
        },
    }


def _summary(result: dict) -> dict:
    return {"wall_s": round(result["wall_s"], 2), **{k: v for k, v in result["metrics"].items() if "stderr" not in k}}


def print_table(out: dict) -> None:
    print(
        f"model={out['model']} dtype={out['dtype']} batch_size={out['batch_size']} "
        f"num_concurrent={out['num_concurrent']} (wall: fastest of {out['repeats']} alternating runs)"
    )
    print(
        f"hf model load {out['hf_load_s']:.1f} s; atom_anyio start (hypercorn atom_anyio:app) {out['atom_start_s']:.1f} s"
    )
    print(f"{'task':<11}{'backend':<12}{'metric':<13}{'score':>7}{'wall s':>8}{'ratio':>7}  agreement")
    for name, r in out["tasks"].items():
        agreement = (
            f"max |loglik gap| {r['max_loglikelihood_gap']:.2e}"
            if "max_loglikelihood_gap" in r
            else f"{r['num_docs'] - r['num_different_answers']}/{r['num_docs']} answers identical"
        )
        for backend in ("hf", "atom_anyio"):
            row = r[backend]
            ratio = row["wall_s"] / r["hf"]["wall_s"]
            for i, metric in enumerate(k for k in row if k != "wall_s"):
                wall = f"{row['wall_s']:>8.2f}{ratio:>7.2f}" if i == 0 else " " * 15
                note = agreement if backend == "atom_anyio" and i == 0 else ""
                print(f"{name:<11}{backend:<12}{metric:<13}{row[metric]:>7.3f}{wall}  {note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: the exported GGUF)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-size", type=int, default=8, help="hf batch; prompts per local-completions request")
    ap.add_argument("--num-concurrent", type=int, default=1, help="local-completions requests in flight")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each backend, alternating; the fastest counts")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="lm-eval-compare-") as tmp:
        if args.model is None:
            from export_hf import export

            from atom_anyio.models.loader import default_model_path

            args.model = str(Path(tmp) / "smollm2")
            export(default_model_path(), args.model)
        (Path(tmp) / "tasks").mkdir()
        out = run(args, Path(tmp) / "tasks")
    out["machine"] = machine()
    print_table(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
