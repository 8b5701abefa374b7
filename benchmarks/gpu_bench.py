"""The GPU check: exactness of every attention backend present, decode step time
against the memory-bandwidth bound, and offline throughput against transformers'
continuous batching, all in one run on random-weight models built here (no downloads).

    python benchmarks/gpu_bench.py                       # cuda:0, H200 bandwidth (4.8 TB/s)
    python benchmarks/gpu_bench.py --bandwidth-tbs 3.35  # an H100 SXM
    python benchmarks/gpu_bench.py --device cpu --tiny   # the dry run: every code path at toy sizes

1. exactness: float32 greedy of a random Llama-shaped model equals transformers', per backend,
   with chunked prefill and a second pass over prefix-cache hits;
2. decode step time at batch 1 and 64 over 2k-token contexts (a Llama-3-8B-shaped bfloat16 model)
   against (weights + KV read) / bandwidth, targets 1.3x and 1.5x;
3. output tok/s of 256 prompts x 1024 tokens, 128 output tokens, against ``generate_batch``.

Prints a table per part and one JSON line. Never fails on a number.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import transformers
from machine import machine

from atom_anyio import LLM, SamplingParams
from atom_anyio.engine.sampler import SamplingInputs
from atom_anyio.engine.step import StepInput
from atom_anyio.engine.worker import Worker, kv_bytes_per_token
from atom_anyio.models.attention import BACKENDS, load_backend
from atom_anyio.models.decoder import ModelConfig
from atom_anyio.models.loader import LoadedModel, build_model


@dataclass(frozen=True)
class Sizes:
    exact: dict  # LlamaConfig of the exactness model
    speed: dict  # LlamaConfig of the speed model
    context: int
    batches: tuple[int, ...]
    num_prompts: int
    prompt_len: int
    output_len: int
    exact_prompts: tuple[int, ...]  # prompt lengths of the exactness check
    exact_output: int


FULL = Sizes(
    exact=dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=32000),
    speed=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    context=2048, batches=(1, 64), num_prompts=256, prompt_len=1024, output_len=128,
    exact_prompts=(5, 90, 300, 700), exact_output=32,
)  # fmt: skip
TINY = Sizes(
    exact=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512),
    speed=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512),
    context=128, batches=(1, 4), num_prompts=8, prompt_len=64, output_len=8,
    exact_prompts=(5, 40), exact_output=6,
)  # fmt: skip


def tokenizer(vocab_size: int):
    """A word-level tokenizer over ``<0> .. <V-1>`` built in memory: the engine detokenizes, nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<1>", eos_token="<2>")


def random_llama(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random transformers Llama built on ``device`` in ``dtype`` (a large init std keeps greedy choices clear)."""
    config = transformers.LlamaConfig(
        **shape, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, initializer_range=0.2
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return hf.eval().requires_grad_(False)


def ours(hf, dtype: torch.dtype, device: torch.device, backend: str) -> LoadedModel:
    """The same weights in atom_anyio's model, on ``backend``."""
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(cfg, dict(hf.state_dict()), dtype, device, backend)
    return LoadedModel(model, tokenizer(cfg.vocab_size), cfg, None, f"random-{backend}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def present_backends(device: torch.device, head_dim: int) -> list[str]:
    names = []
    for name in BACKENDS[1:]:
        try:
            load_backend(name, device, head_dim)
        except (ValueError, RuntimeError) as exc:
            print(f"  {name}: not here ({exc})", flush=True)
            continue
        names.append(name)
    return names


def check_exactness(args, sizes: Sizes, device: torch.device) -> dict:
    hf = random_llama(sizes.exact, torch.float32, device)
    g = torch.Generator().manual_seed(1)
    vocab = sizes.exact["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in sizes.exact_prompts]
    refs = []
    for p in prompts:
        x = torch.tensor([p], device=device)
        with torch.inference_mode():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=sizes.exact_output,
                do_sample=False,
                eos_token_id=None,
            )
        refs.append(out[0, len(p) :].tolist())
    params = SamplingParams(temperature=0, max_tokens=sizes.exact_output, ignore_eos=True)
    results = {}
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    for name in present_backends(device, head_dim):
        try:
            results[name] = greedy_against(refs, prompts, ours(hf, torch.float32, device, name), params, args, device)
        except Exception as exc:  # one backend's failure must not cost the others' numbers
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"  {name:<11} {results[name]}", flush=True)
        free(device)
    return results


def greedy_against(refs, prompts, loaded: LoadedModel, params, args, device: torch.device) -> dict:
    """Greedy in chunks of at most 64 tokens, then again over the prefix cache, against ``refs``."""
    llm = LLM(loaded, max_num_batched_tokens=64, **engine_memory(args, device))
    first = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    equal = first == refs and [r.outputs[0].token_ids for r in again] == refs
    return {"equal": equal, "cached_tokens": sum(r.num_cached_tokens for r in again)}


def engine_memory(args, device: torch.device) -> dict:
    return {"gpu_memory_utilization": args.gpu_memory_utilization} if device.type == "cuda" else {"kv_cache_gib": 1.0}


def decode_step(batch: int, context: int, block_size: int, vocab: int) -> StepInput:
    """One decode step of ``batch`` sequences whose ``context`` tokens fill consecutive blocks."""
    from array import array

    per_seq = -(-context // block_size)
    return StepInput(
        input_ids=[(7 * i) % vocab for i in range(batch)],
        positions=[context - 1] * batch,
        block_tables=[array("i", range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)],
        context_lens=[context] * batch,
        query_lens=[1] * batch,
        sample_rows=list(range(batch)),
        sampling=SamplingInputs(
            params=[SamplingParams(temperature=0)] * batch,
            prompt_token_ids=[[] for _ in range(batch)],
            output_token_ids=[[] for _ in range(batch)],
            seeds=[None] * batch,
            eos_token_ids=(2,),
        ),
    )


def time_decode(loaded: LoadedModel, sizes: Sizes, args, device: torch.device) -> list[dict]:
    """Mean wall time of ``Worker.execute`` on decode batches (inputs staged, forward, greedy sampling, ids read),
    eager and on CUDA graphs (on a CPU: the same padded static path, uncaptured)."""
    rows = []
    for graphs in (False, True):
        try:
            rows += time_decode_mode(loaded, sizes, args, device, graphs)
        except Exception as exc:  # the graph path has not run on a GPU before: keep the eager numbers
            print(f"  decode {'graphs' if graphs else 'eager'} failed: {type(exc).__name__}: {exc}", flush=True)
        free(device)
    return rows


def time_decode_mode(loaded: LoadedModel, sizes: Sizes, args, device: torch.device, graphs: bool) -> list[dict]:
    model, block_size = loaded.model, 16
    dtype = next(model.parameters()).dtype
    per_seq = -(-sizes.context // block_size)
    shape = (sizes.context, max(sizes.batches)) if graphs else None
    worker = Worker(model, max(sizes.batches) * per_seq, block_size, decode_graphs=shape)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    read_weights = params - (0 if model.lm_head.weight is embed else embed.numel() * embed.element_size())
    rows = []
    for batch in sizes.batches:
        step = decode_step(batch, sizes.context, block_size, loaded.config.vocab_size)
        for _ in range(3):
            worker.execute(step)  # warm-up: kernels compiled, allocator settled
        sync(device)
        t = time.perf_counter()
        for _ in range(args.decode_iters):
            worker.execute(step)
        sync(device)
        step_s = (time.perf_counter() - t) / args.decode_iters
        kv = batch * sizes.context * kv_bytes_per_token(model, dtype)
        bound_s = (read_weights + kv) / (args.bandwidth_tbs * 1e12)
        target = 1.3 if batch == 1 else 1.5
        rows.append(
            {"batch": batch, "graphs": graphs, "step_ms": step_s * 1e3, "bound_ms": bound_s * 1e3, "ratio": step_s / bound_s,
             "target": target, "weights_gb": read_weights / 1e9, "kv_gb": kv / 1e9}
        )  # fmt: skip
    return rows


def throughput_ours(
    loaded: LoadedModel, prompts, sizes: Sizes, args, device: torch.device, async_scheduling: bool = False
) -> dict:
    llm = LLM(
        loaded,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=sizes.prompt_len + sizes.output_len,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=async_scheduling,
        **engine_memory(args, device),
    )
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=sizes.output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    free(device)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed}


def throughput_transformers(hf, prompts, sizes: Sizes, device: torch.device) -> dict:
    """``generate_batch``; flash attention only where the package is installed (its hub kernels need a network)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        max_new_tokens=sizes.output_len, min_new_tokens=sizes.output_len, do_sample=False, eos_token_id=None
    )
    cb = ContinuousBatchingConfig(auto_switch_to_flash=importlib.util.find_spec("flash_attn") is not None)
    with torch.inference_mode():
        hf.generate_batch(inputs=[prompts[0][:32]], generation_config=gen, continuous_batching_config=cb)  # warm-up
        sync(device)
        t = time.perf_counter()
        res = hf.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb)
        sync(device)
    elapsed = time.perf_counter() - t
    n_out = sum(len(r.generated_tokens) for r in res.values())
    attn = hf.config._attn_implementation
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed, "attention": attn}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_speed(args, sizes: Sizes, device: torch.device) -> dict:
    hf = random_llama(sizes.speed, torch.bfloat16, device)
    backend = args.speed_backend
    loaded = ours(hf, torch.bfloat16, device, backend)
    print(f"  speed model on {loaded.model.attention_backend.name}", flush=True)
    decode = time_decode(loaded, sizes, args, device)
    for r in decode:
        print(
            f"  decode batch {r['batch']:>3} @ {sizes.context}{' graphs' if r['graphs'] else ''}: "
            f"{r['step_ms']:8.3f} ms/step, bound {r['bound_ms']:.3f} ms"
            f" ({r['weights_gb']:.1f} GB weights + {r['kv_gb']:.2f} GB KV) = {r['ratio']:.2f}x (target {r['target']}x)",
            flush=True,
        )
    g = torch.Generator().manual_seed(2)
    vocab = sizes.speed["vocab_size"]
    prompts = [torch.randint(3, vocab, (sizes.prompt_len,), generator=g).tolist() for _ in range(sizes.num_prompts)]
    rows = {"atom_anyio": throughput_ours(loaded, prompts, sizes, args, device)}
    # the same with the next step scheduled while this one runs (docs/engine.md, "Async scheduling")
    rows["atom async"] = throughput_ours(loaded, prompts, sizes, args, device, async_scheduling=True)
    del loaded
    free(device)
    if not args.skip_transformers:
        try:
            rows["transformers"] = throughput_transformers(hf, prompts, sizes, device)
        except Exception as exc:  # keep our numbers
            print(f"  transformers generate_batch failed: {type(exc).__name__}: {exc}", flush=True)
    return {"decode": decode, "throughput": rows, "backend": backend}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=os.environ.get("ATOM_DEVICE", "cuda:0"))
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU dry run)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="device memory bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="per engine; transformers runs after")
    ap.add_argument("--speed-backend", default="auto", choices=BACKENDS)
    ap.add_argument("--decode-iters", type=int, default=20)
    ap.add_argument("--cuda-graphs", action="store_true", help="the throughput run on CUDA graphs too")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    sizes = TINY if args.tiny else FULL
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    result: dict = {"bench": "gpu_bench", "device": name, "tiny": args.tiny, "bandwidth_tbs": args.bandwidth_tbs}
    result["machine"] = machine()  # the host CPU
    if not args.skip_exactness:
        print("\n1. exactness, float32 greedy against transformers", flush=True)
        result["exactness"] = section(check_exactness, args, sizes, device)
    if not args.skip_speed:
        print("\n2-3. speed, bfloat16", flush=True)
        speed = section(check_speed, args, sizes, device)
        result["speed"] = speed
        if "error" not in speed:
            print_speed(speed, sizes)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(rounded(result)))
    sys.stdout.flush()


def section(run, *args) -> dict:
    """``run(*args)``, or its error: a failed part must not cost the other's numbers."""
    try:
        return run(*args)
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def rounded(x):
    """``x`` with its floats to 4 significant digits, for the JSON line."""
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return float(f"{x:.4g}") if isinstance(x, float) else x


def print_speed(speed: dict, sizes: Sizes) -> None:
    print(f"\n{'decode batch':<14}{'graphs':>8}{'ms/step':>10}{'bound ms':>10}{'ratio':>10}{'target':>8}")
    for r in speed["decode"]:
        print(
            f"{r['batch']:<14}{'yes' if r['graphs'] else 'no':>8}{r['step_ms']:>10.3f}{r['bound_ms']:>10.3f}"
            f"{r['ratio']:>10.2f}{r['target']:>8.1f}"
        )
    rows = speed["throughput"]
    atom = rows["atom_anyio"]["output_tok_s"]
    print(f"\n{sizes.num_prompts} prompts x {sizes.prompt_len} tokens, {sizes.output_len} output tokens")
    print(f"{'system':<14}{'elapsed s':>12}{'out tok':>10}{'out tok/s':>12}{'atom ratio':>12}")
    for name, r in rows.items():
        print(
            f"{name:<14}{r['elapsed_s']:>12.1f}{r['output_tokens']:>10}{r['output_tok_s']:>12.1f}"
            f"{atom / r['output_tok_s']:>12.2f}"
        )


if __name__ == "__main__":
    main()
