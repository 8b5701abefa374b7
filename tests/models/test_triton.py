"""The Triton paged-attention kernel, run by Triton's interpreter on this CPU,
against the portable torch path; the engine on it against transformers; the
backend choice and its fallbacks."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined (first import of models/attention/triton.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from structlog.testing import capture_logs  # noqa: E402

from atom_anyio import LLM, SamplingParams  # noqa: E402
from atom_anyio.config import Config  # noqa: E402
from atom_anyio.models.attention import (  # noqa: E402
    AttentionMetadata,
    TorchPagedAttention,
    auto_candidates,
    select_backend,
)

pytest.importorskip("triton")
from atom_anyio.models.attention.triton import TritonPagedAttention  # noqa: E402


def paged_step(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype=torch.float32, shared=0, seed=0):
    """A random step over a paged cache with shuffled blocks; every sequence's
    first ``shared`` blocks are the same physical blocks (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    prefix, order = order[:shared], order[shared:]
    tables = []
    for n in need:
        tables.append(prefix + order[: n - shared])
        order = order[n - shared :]
    cache_shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=g).to(dtype) for _ in range(2))
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(t, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    meta = AttentionMetadata.build(tables, context_lens, query_lens, block_size, torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta


def against_the_portable_path(step, backend: TritonPagedAttention, **keywords) -> None:
    q, k, v, k_cache, v_cache, meta = step
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta, **keywords)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, **keywords)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the step's K/V written alike
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


CASES = {
    # (query_lens, context_lens, heads, kv_heads, head_dim, block_size, shared prefix blocks)
    "decodes_across_block_boundaries": ([1, 1, 1, 1], [2, 16, 17, 70], 4, 2, 64, 16, 0),
    "decodes_and_chunks_mixed": ([1, 1, 9, 21], [90, 33, 9, 60], 8, 2, 64, 16, 0),
    "chunk_mid_block_small_pages": ([23], [61], 9, 3, 32, 4, 0),
    "fresh_prompt_tiny_head_dim": ([37], [37], 4, 2, 16, 16, 0),
    "prefix_hits_odd_head_dim": ([1, 1, 12], [70, 90, 50], 4, 1, 80, 16, 2),
    "head_dim_256_narrower_key_tiles": ([1, 9], [40, 30], 4, 2, 256, 16, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernel_equals_the_portable_path(case):
    *shape, shared = CASES[case]
    against_the_portable_path(paged_step(*shape, shared=shared), TritonPagedAttention())


@pytest.mark.parametrize("window", [None, 1, 7, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sliding_window_and_sinks_equal_the_portable_path(window, with_sinks):
    step = paged_step([1, 1, 5, 14], [60, 9, 30, 14], 8, 2, 32, 8, seed=window or 0)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2 if with_sinks else None
    against_the_portable_path(step, TritonPagedAttention(block_n=16), sliding_window=window, sinks=sinks)


@pytest.mark.parametrize("window", [None, 20])
def test_decodes_split_over_the_keys_equal_the_portable_path(window):
    # a long, a short and a one-token context: some of the four splits are empty, and merge to nothing
    step = paged_step([1, 1, 1], [90, 7, 2], 6, 2, 64, 16, seed=5)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(2))
    against_the_portable_path(step, TritonPagedAttention(decode_splits=4, block_n=16), sliding_window=window)
    step = paged_step([1, 1, 1], [90, 7, 2], 6, 2, 64, 16, seed=6)
    against_the_portable_path(step, TritonPagedAttention(decode_splits=4, block_n=16), sinks=sinks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_kernel_in_16_bit_matches_a_float32_reference(dtype):
    q, k, v, k_cache, v_cache, meta = paged_step([1, 1, 12], [50, 70, 30], 8, 2, 64, 16, dtype=dtype)
    out = TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta)
    assert out.dtype == dtype
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_engine_on_triton_equals_transformers_greedy_with_chunks_and_a_prefix_hit(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("ATOM_ATTENTION_BACKEND", "triton")
    llm = LLM(
        str(tiny_model_dir), max_num_batched_tokens=16, num_kv_blocks=16, max_model_len=256
    )  # chunks of at most 16 tokens
    assert llm.loaded.model.attention_backend.name == "triton"
    tok = llm.tokenizer
    prompts = [tok("the river runs over the stone " * n)["input_ids"] for n in (3, 5)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, a, b in zip(prompts, first, again, strict=True):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False, eos_token_id=None
            )
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_padded_static_decode_batches_equal_transformers_greedy(tiny_model_dir):
    # the CUDA-graph path without the capture (a CPU): 3 decodes run padded to 4 in the static buffers
    llm = LLM(
        str(tiny_model_dir), attention_backend="triton", cuda_graphs=True, max_num_seqs=4, num_kv_blocks=16,
        max_model_len=256,
    )  # fmt: skip
    tok = llm.tokenizer
    prompts = [tok("the river runs over the stone " * n)["input_ids"] for n in (1, 2, 3)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert 4 in llm.engine.worker.graphs.metas  # a padded size ran
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False, eos_token_id=None
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_explicit_backends_run_here_or_refuse_in_one_line(monkeypatch):
    monkeypatch.delenv("ATOM_ATTENTION_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert select_backend(cpu, "triton", head_dim=16).name == "triton"  # the interpreter
    assert Config.of(attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match=r"'triton' cannot run: head_dim 512 is outside 1\.\.256"):
        select_backend(cpu, "triton", head_dim=512)
    for name in ("flashinfer", "aiter"):
        with pytest.raises(ValueError, match=f"attention_backend '{name}' needs a GPU, and cpu is not one"):
            select_backend(cpu, name, head_dim=64)
    with pytest.raises(ValueError, match="one of auto, cpu, cpu_paged, torch, triton, flashinfer, aiter"):
        Config.of(attention_backend="flash")


def test_auto_prefers_the_vendor_library_then_triton_then_torch(monkeypatch):
    assert auto_candidates(torch.device("cpu")) == ("cpu", "torch")
    monkeypatch.setattr(torch.version, "hip", None)
    assert auto_candidates(torch.device("cuda:1")) == ("flashinfer", "triton", "torch")
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert auto_candidates(torch.device("cuda")) == ("aiter", "triton", "torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_auto_on_a_gpu_device_without_one_falls_back_to_torch_and_logs_each_step(monkeypatch):
    monkeypatch.delenv("ATOM_ATTENTION_BACKEND", raising=False)
    with capture_logs() as logs:
        backend = select_backend(torch.device("cuda:0"), head_dim=64)
    assert backend.name == "torch"
    fallbacks = [e for e in logs if e["event"] == "attention.fallback"]
    assert [e["backend"] for e in fallbacks] == [auto_candidates(torch.device("cuda"))[0], "triton"]
    assert all("GPU" in e["reason"] for e in fallbacks)
    assert [(e["backend"], e["requested"]) for e in logs if e["event"] == "attention.backend"] == [("torch", "auto")]


def test_triton_on_the_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError) as refused:
        select_backend(torch.device("cpu"), "triton")
    assert (
        str(refused.value) == "attention_backend 'triton' cannot run: on the CPU it runs only under TRITON_INTERPRET=1"
    )


# device settings


def test_gpu_memory_utilization_comes_from_the_environment_or_the_flag_and_is_checked():
    from atom_anyio.cli import build_parser
    from atom_anyio.engine.engine_config import EngineConfig

    assert Config.from_env({"ATOM_GPU_MEMORY_UTILIZATION": "0.5"}).engine.gpu_memory_utilization == 0.5
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.7", "--device", "cuda:1"])
    assert (args.gpu_memory_utilization, args.device) == (0.7, "cuda:1")
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"gpu_memory_utilization must be in \\(0, 1\\], not {bad}"):
            EngineConfig(gpu_memory_utilization=bad)


def test_float16_is_a_gpu_dtype():
    from atom_anyio.models.plan import resolve_dtype

    assert resolve_dtype("float16", torch.device("cuda:0")) is torch.float16
    with pytest.raises(ValueError, match="dtype float16 runs on GPUs"):
        resolve_dtype("float16", torch.device("cpu"))
