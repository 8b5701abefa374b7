"""Structured outputs: the per-token cost of grammar masks, and grammar compile time.

    python benchmarks/structured.py [--model smollm2|tiny] [--batch 16] [--output-len 64]

Decode at batch ``--batch`` through the real engine, unconstrained and then every sequence
constrained by a JSON schema that cannot finish within ``--output-len`` tokens, and report the
time per decode step of each and their ratio (the sample column holds the mask fill, the mask
and the grammar advance). Then compile a large schema (100+ properties, nested) cold (a new
compiler) and cached, and time one GrammarMatcher's construction (the engine makes one per
sequence, on its loop). Prints a table and one JSON line. Never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import anyio
import torch
from agentic import write_tiny_model
from machine import machine
from words import WORDS

from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.grammar import Constraint, Grammars
from atom_anyio.engine.request import EngineRequest
from atom_anyio.models.loader import LoadedModel, load_model
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs

LONG_SCHEMA = {  # at least 40 items: no output of --output-len tokens completes it
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "kind": {"enum": ["fruit", "tool", "book"]},
                },
                "required": ["name", "qty", "kind"],
            },
            "minItems": 40,
        }
    },
    "required": ["items"],
}


def large_schema(num_groups: int = 12, fields_per_group: int = 10) -> dict:
    """``num_groups`` nested objects of ``fields_per_group`` mixed fields each (120 leaf properties)."""
    leaves = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["a", "b", "c", "d"]},
        {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,8}$"}, "maxItems": 5},
        {"anyOf": [{"type": "string"}, {"type": "null"}]},
    ]
    groups = {}
    for g in range(num_groups):
        props = {f"field_{g}_{f}": leaves[(g + f) % len(leaves)] for f in range(fields_per_group)}
        groups[f"group_{g}"] = {"type": "object", "properties": props, "required": list(props)[: fields_per_group // 2]}
    return {"type": "object", "properties": groups, "required": list(groups)}


def tiny_model() -> LoadedModel:
    """The tests' 2-layer random Llama with the SmolLM2 tokenizer."""
    return load_model(str(write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-")), 4096, hidden_size=64)))


async def decode(loaded: LoadedModel, prompts: list[list[int]], output_len: int, constraint: Constraint | None) -> dict:
    engine = Engine(loaded, EngineConfig(max_model_len=2048, kv_cache_gib=0.25, max_num_seqs=len(prompts)))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    num_tokens = 0

    async def one(ids: list[int]) -> None:
        nonlocal num_tokens
        async with engine.submit(EngineRequest.of_tokens(ids, params, engine, constraint)) as stream:
            async for d in stream:
                num_tokens += len(d.token_ids)

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await one(prompts[0][:8])  # warm-up
        engine.step_timings = dict.fromkeys(engine.step_timings, 0.0)
        engine.num_steps, num_tokens = 0, 0
        t = time.perf_counter()
        async with anyio.create_task_group() as inner:
            for ids in prompts:
                inner.start_soon(one, ids)
        elapsed = time.perf_counter() - t
        tg.cancel_scope.cancel()
    steps = engine.num_steps
    timings = engine.step_timings
    return {
        "tokens": num_tokens,
        "steps": steps,
        "wall_ms_per_step": 1e3 * elapsed / steps,
        "forward_ms_per_step": 1e3 * timings["forward"] / steps,
        "sample_ms_per_step": 1e3 * timings["sample"] / steps,
        "host_ms_per_step": 1e3 * (timings["schedule"] + timings["postprocess"]) / steps,
    }


def compile_times(loaded: LoadedModel, eos: tuple[int, ...]) -> dict:
    schema = large_schema()
    spec = StructuredOutputs("json", schema)
    t = time.perf_counter()
    grammars = Grammars(loaded.tokenizer, loaded.config.vocab_size, eos)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = grammars.compile(spec)
    cold = time.perf_counter() - t
    cached = min(_timed(lambda: grammars.compile(spec)) for _ in range(5))
    matcher = min(_timed(lambda: __import__("xgrammar").GrammarMatcher(grammar)) for _ in range(5))
    grammars.close()
    return {
        "num_leaf_properties": sum(len(g["properties"]) for g in schema["properties"].values()),
        "schema_bytes": len(json.dumps(schema)),
        "compiler_setup_ms": 1e3 * setup,
        "cold_ms": 1e3 * cold,
        "cached_ms": 1e3 * cached,
        "matcher_ms": 1e3 * matcher,
    }


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores but one)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None) if args.model == "smollm2" else tiny_model()
    tok = loaded.tokenizer
    prompts = [
        tok.encode(f"List {i}: " + " ".join(WORDS[i : i + 12]), add_special_tokens=False) for i in range(args.batch)
    ]
    eos = tuple(loaded.config.eos_token_ids) or (tok.eos_token_id,)
    grammars = Grammars(tok, loaded.config.vocab_size, eos)
    constraint = Constraint(grammars.compile(StructuredOutputs("json", LONG_SCHEMA)))
    # alternate the two, twice, and keep each one's fastest run: other load on the machine moves the forward
    runs = {"unconstrained": [], "json schema": []}
    for _ in range(args.repeats):
        runs["unconstrained"].append(anyio.run(decode, loaded, prompts, args.output_len, None))
        runs["json schema"].append(anyio.run(decode, loaded, prompts, args.output_len, constraint))
    free, constrained = (min(r, key=lambda x: x["wall_ms_per_step"]) for r in runs.values())
    compiled = compile_times(loaded, eos)
    ratio = constrained["wall_ms_per_step"] / free["wall_ms_per_step"]
    mask_ms = constrained["sample_ms_per_step"] - free["sample_ms_per_step"]  # fill + apply + advance
    mask_ratio = (free["wall_ms_per_step"] + mask_ms) / free["wall_ms_per_step"]
    print(f"model={args.model} batch={args.batch} output_len={args.output_len} torch_threads={torch.get_num_threads()}")
    m = machine()
    print(f"CPU: {m['cpu']} ({' '.join(m['isa'])}), {m['cores']} cores")
    print(f"{'decode':<14}{'tokens':>8}{'steps':>7}{'ms/step':>10}{'forward':>10}{'sample':>10}{'host':>10}")
    for name, r in (("unconstrained", free), ("json schema", constrained)):
        print(
            f"{name:<14}{r['tokens']:>8}{r['steps']:>7}{r['wall_ms_per_step']:>10.2f}"
            f"{r['forward_ms_per_step']:>10.2f}{r['sample_ms_per_step']:>10.2f}{r['host_ms_per_step']:>10.2f}"
        )
    print(f"constrained / unconstrained time per step: {ratio:.2f}x (wall, fastest of {args.repeats} each)")
    print(
        f"masking adds {mask_ms:.2f} ms per step ({1e3 * mask_ms / args.batch:.0f} us per token): "
        f"{mask_ratio:.3f}x the unconstrained step"
    )
    print(
        f"large schema ({compiled['num_leaf_properties']} leaf properties, {compiled['schema_bytes']} bytes): "
        f"cold {compiled['cold_ms']:.1f} ms, cached {compiled['cached_ms']:.2f} ms, "
        f"matcher {compiled['matcher_ms']:.3f} ms (compiler setup {compiled['compiler_setup_ms']:.0f} ms)"
    )
    out = {"model": args.model, "batch": args.batch, "machine": m, "unconstrained": free, "constrained": constrained}
    print(
        json.dumps({**out, "ratio": ratio, "mask_ms_per_step": mask_ms, "mask_ratio": mask_ratio, "compile": compiled})
    )


if __name__ == "__main__":
    main()
