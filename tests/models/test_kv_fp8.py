"""The fp8 KV cache (``kv_cache_dtype``, issue 41): values stored in one byte, as torch converts
them and saturated as vLLM's caches are; the paged kernel reading them, exactly where it widens
them (the portable code, a float32 model's, a bfloat16 model's prefill chunks) and within a
rounding where a bfloat16 decode reads them in registers; the pool holding twice the tokens; and
SmolLM2's greedy text within bfloat16 KV's top-5 over 256 tokens."""

from __future__ import annotations

import pytest
import torch
from support_models import assert_greedy_close

from atom_anyio import LLM, SamplingParams, kernels
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.models.attention import AttentionMetadata, CpuPagedAttention, TorchPagedAttention
from atom_anyio.models.attention.metadata import FP8_KV_DTYPES, as_cached, to_kv_cache, write_slots
from atom_anyio.models.loader import load_model

FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]
NATIVE_ATTENTION = "paged_attention_avx512_bf16"
# decodes beside a fresh prompt and a chunk over a prefix; a long decode over many chunks
LAYOUTS = {"mixed": ([1, 1, 9, 40], [300, 33, 9, 140]), "decodes": ([1, 1, 1], [700, 17, 2])}


@pytest.fixture(scope="module", autouse=True)
def built():
    if (error := kernels.load_cpu_kernels()) is not None:
        pytest.skip(f"the CPU kernels could not be built here: {error}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_rounds_into_fp8_as_torch_converts_and_saturates(cache_dtype, dtype):
    """The kernel's store (the qkv rows' views) writes the bytes ``to_kv_cache`` gives, which the
    portable path's ``index_copy_`` writes: torch's rounding, values past the format's largest
    saturated to it (torch alone gives NaN or infinity), subnormals kept, NaN kept."""
    torch.manual_seed(0)
    slots, kv_heads, head_dim, tokens = 64, 3, 32, 20
    qkv = torch.randn(tokens, (6 + 2 * kv_heads) * head_dim) * 4
    qkv[0, 6 * head_dim : 6 * head_dim + 8] = torch.tensor([1e6, -1e6, 500.0, 6e4, 1e-3, -3e-5, 1e-7, float("nan")])
    qkv = qkv.to(dtype)
    _, k, v = qkv.split([6 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    mapping = torch.randperm(slots)[:tokens]
    caches = [torch.zeros(slots, kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    torch.ops.atom.store_kv(caches[0], caches[1], k, v, mapping)
    expected = [torch.zeros_like(c) for c in caches]
    write_slots(expected[0], mapping, k)
    write_slots(expected[1], mapping, v)
    assert torch.equal(bits(expected[0][mapping]), bits(to_kv_cache(k, cache_dtype)))
    assert all(torch.equal(bits(c), bits(e)) for c, e in zip(caches, expected, strict=True))
    stored = caches[0][mapping[0], 0, :8].float()
    top = torch.finfo(cache_dtype).max
    assert stored[0] == top and stored[1] == -top and stored[7].isnan()
    assert stored[4] != 0 and stored[:7].isfinite().all()


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_converts_every_value_as_torch_does(cache_dtype, dtype):
    """The store's vector conversion (eight lanes at a time where AVX2 is built) against torch's,
    byte for byte: every bfloat16 bit pattern, and float32 patterns a prime stride apart across all
    2^32 (normals, subnormals, the edges of each format's range, infinities, NaNs)."""
    if dtype == torch.bfloat16:
        x = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        x = torch.arange(0, 2**32, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x[: x.numel() // 192 * 192].reshape(-1, 3, 64)
    caches = [torch.zeros(x.shape, dtype=cache_dtype) for _ in range(2)]
    torch.ops.atom.store_kv(caches[0], caches[1], x, x, torch.arange(x.shape[0]))
    expected = to_kv_cache(x, cache_dtype)
    nan = expected.float().isnan()
    assert torch.equal(caches[0].float().isnan(), nan)
    assert torch.equal(bits(caches[0])[~nan], bits(expected)[~nan])


def step(layout: str, dtype: torch.dtype, cache_dtype: torch.dtype, seed: int = 0):
    """A step over scattered blocks whose caches hold fp8 values: the same step with caches of
    ``cache_dtype`` and with those values widened to ``dtype``."""
    query_lens, context_lens = LAYOUTS[layout]
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(order[:n])
        order = order[n:]
    shape = (num_blocks * block_size, kv_heads, head_dim)
    # keys of a few units, values under one: e4m3's subnormals (below 2^-6) occur
    k_cache = to_kv_cache(torch.randn(shape, generator=g) * 3, cache_dtype)
    v_cache = to_kv_cache(torch.randn(shape, generator=g) * 0.3, cache_dtype)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype) * 3
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype) * 0.3
    meta = AttentionMetadata.build(tables, context_lens, query_lens, block_size, torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta


def attend(backend, q, k, v, k_cache, v_cache, meta):
    return backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_an_fp8_cache_is_attention_over_its_values(layout, cache_dtype, dtype):
    """Every backend and path reads an fp8 cache as its values widened: the portable kernel, the
    torch backend and SDPA's prefill bit for bit against the same step over a cache of q's dtype
    holding the same values (the step's own keys rounded as the cache stores them); a float32
    model's kernel too (it widens in its float code)."""
    q, k, v, k_cache, v_cache, meta = step(layout, dtype, cache_dtype)
    wide = (k_cache.to(dtype), v_cache.to(dtype))
    k8, v8 = as_cached(k, cache_dtype), as_cached(v, cache_dtype)
    backends = [CpuPagedAttention(paged_prefill=True, native=False), CpuPagedAttention(native=False)]
    backends += [TorchPagedAttention()]
    if dtype == torch.float32:  # no native float32 variant: the widened float code runs
        backends += [CpuPagedAttention(paged_prefill=True), CpuPagedAttention()]
    for backend in backends:
        out = attend(backend, q, k, v, k_cache, v_cache, meta)
        ref = attend(backend, q, k8, v8, *wide, meta)
        assert torch.equal(out, ref), backend


@pytest.mark.skipif(NATIVE_ATTENTION not in kernels.native_kernels(), reason=f"{NATIVE_ATTENTION}: no AVX512-BF16")
@pytest.mark.parametrize("partition", [0, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cache_dtype", FP8)
def test_native_bf16_attention_over_fp8_equals_its_portable_twin(layout, cache_dtype, partition):
    """The AVX512-BF16 variant over fp8: a decode's rows read the bytes in registers (bfloat16 pair
    products of the values scaled by powers of two), prefill rows widen each chunk exactly; against
    the portable twin, within a rounding of the bfloat16 output (e4m3's subnormals, which the
    registers read as zero, included). Batch-invariant calls (``partition``) read every row's keys and
    values in registers, prefill's too (test_invariance: a row's bits alone, in a batch, in a chunk)."""
    q, k, v, k_cache, v_cache, meta = step(layout, torch.bfloat16, cache_dtype, seed=3)
    native = CpuPagedAttention(paged_prefill=True)
    portable = CpuPagedAttention(paged_prefill=True, native=False)
    if partition:
        native.partition = portable.partition = lambda meta: partition
    out = attend(native, q, k, v, k_cache, v_cache, meta)
    ref = attend(portable, q, k, v, k_cache, v_cache, meta)
    assert not torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(NATIVE_ATTENTION not in kernels.native_kernels(), reason=f"{NATIVE_ATTENTION}: no AVX512-BF16")
@pytest.mark.parametrize("affine", [False, True], ids=["shift", "gfni"])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_the_registers_widen_every_fp8_byte_to_its_value_scaled_by_a_power_of_two(cache_dtype, affine):
    """The registers' path reads each byte as bfloat16 bits: the byte's sign, exponent and mantissa
    moved into bfloat16's fields, which is the value times 2^-112 (e5m2) or 2^-120 (e4m3); subnormals
    become bfloat16 denormals. Both forms of the widening, the shift and the and, and GFNI's affine
    bit maps (where the build has GFNI: every Zen 4 and 5), give exactly those bits for all 256 bytes."""
    if affine and "fp8_kv_gfni" not in kernels.native_kernels():
        pytest.skip("this build has no GFNI")
    data = torch.arange(256, dtype=torch.uint8).repeat(2)[
        torch.randperm(512, generator=torch.Generator().manual_seed(0))
    ]
    words = torch.empty(512, dtype=torch.int16)
    torch.ops.atom.fp8_bf16_words(words, data, cache_dtype == torch.float8_e5m2, affine)
    mantissa = 2 if cache_dtype == torch.float8_e5m2 else 3
    b = data.to(torch.int32)
    expected = ((b & 0x80) << 8) | ((b & 0x7F) << (7 - mantissa))  # the mantissa at bfloat16's top bits
    assert torch.equal(words.to(torch.int32) & 0xFFFF, expected)
    finite = data.view(cache_dtype).float().isfinite()
    normal = finite & ((b & 0x7F) >= (1 << mantissa))  # the exponent field not zero
    bias = 112 if cache_dtype == torch.float8_e5m2 else 120
    as_bf16 = words[normal].view(torch.bfloat16).float()
    assert torch.equal(as_bf16, data[normal].view(cache_dtype).float() * 2.0**-bias)


@pytest.mark.skipif(NATIVE_ATTENTION not in kernels.native_kernels(), reason=f"{NATIVE_ATTENTION}: no AVX512-BF16")
@pytest.mark.parametrize("cache_dtype", FP8)
def test_native_fp8_decodes_never_read_past_their_keys(cache_dtype):
    """Slots past each decode's keys (a freed block's) hold NaN bytes: the registers' path reads
    whole 64-byte rows, two keys at a time, and must neither score nor weigh them."""
    q, k, v, k_cache, v_cache, meta = step("decodes", torch.bfloat16, cache_dtype, seed=5)
    ref = attend(CpuPagedAttention(), q, k, v, k_cache, v_cache, meta)
    valid = torch.zeros(k_cache.shape[0], dtype=torch.bool)
    for table, context in zip(meta.block_tables.tolist(), meta.seq_lens.tolist(), strict=True):
        for key in range(context):
            valid[table[key // 16] * 16 + key % 16] = True
    k_cache.view(torch.uint8)[~valid] = 0x7F  # NaN in both formats
    v_cache.view(torch.uint8)[~valid] = 0x7F
    assert k_cache[~valid].float().isnan().all()
    out = attend(CpuPagedAttention(), q, k, v, k_cache, v_cache, meta)
    assert torch.equal(out, ref)


def test_the_pool_holds_twice_the_tokens_and_bad_settings_are_named(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), "bfloat16")
    blocks = {
        kv: LLM(loaded, kv_cache_dtype=kv, kv_cache_gib=0.01).engine.block_manager.num_free_blocks
        for kv in ("auto", "fp8", "fp8_e5m2")
    }
    assert blocks["fp8"] == blocks["fp8_e5m2"] == 2 * blocks["auto"], blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, not 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    loaded.model.attention_backend.name = "triton"  # what an engine on a GPU's Triton kernel would refuse
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 runs on the cpu and cpu_paged and torch"):
        LLM(loaded, kv_cache_dtype="fp8", kv_cache_gib=0.01)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
PROMPTS = [[(7 * i) % 997 + 3 for i in range(90)], [(11 * i) % 991 + 5 for i in range(37)]]


@pytest.mark.parametrize("attention", ["cpu", "cpu_paged"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_cache_answers_alike_on_every_path_and_from_its_prefix_cache(tiny_model_dir, dtype, attention):
    """A tiny model over an fp8 cache, prompts longer than a prefill chunk: the kernels' greedy
    tokens close to the torch backend's over the same cache (the same values read, in another
    order), the same with the fused decoder and op by op, and a prompt sent again (its prefix read
    back from the cache) answers with the same tokens as the first time."""

    def run(attention: str, fused: bool = True):
        loaded = load_model(str(tiny_model_dir), dtype, attention_backend=attention)
        loaded.model.use_fused = fused
        llm = LLM(loaded, kv_cache_dtype="fp8", num_kv_blocks=64, max_num_batched_tokens=32)
        assert llm.engine.worker.kv_pool.dtype == torch.float8_e4m3fn
        first = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        sent_again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.num_cached_tokens for o in sent_again] == [80, 32]  # every full block of each prompt
        assert [o.outputs[0].token_ids for o in sent_again] == [o.token_ids for o in first]
        return first

    fused = run(attention)
    assert_greedy_close(fused, run("torch"))
    assert [o.token_ids for o in run(attention, fused=False)] == [o.token_ids for o in fused]


SMOLLM2_PROMPTS = [
    "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain how a compiler works, step by step.<|im_end|>\n<|im_start|>assistant\n",
]
SMOLLM2_GREEDY = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def smollm2_bf16_kv(smollm2_path):
    """SmolLM2 at the server's defaults and its 256 greedy tokens of each prompt over its own KV dtype."""
    loaded = load_model(None, "auto")
    return loaded, LLM(loaded, kv_cache_gib=0.25).generate(SMOLLM2_PROMPTS, SMOLLM2_GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_smollm2_greedy_over_fp8_kv_stays_within_bfloat16_kvs_top5(smollm2_bf16_kv, kv):
    """SmolLM2 at the server's defaults, 256 greedy tokens of two prompts over each KV dtype: the
    free-running texts agree the standard way (equal, or each side's token in the other's top-5
    where they first part), and fed the bfloat16-KV text, the fp8 cache ranks every one of its 256
    tokens within its top 5."""
    loaded, ref = smollm2_bf16_kv
    llm = LLM(loaded, kv_cache_gib=0.25, kv_cache_dtype=kv, enable_prefix_caching=False)
    assert llm.engine.worker.kv_pool.dtype == FP8_KV_DTYPES[kv]
    fp8 = llm.generate(SMOLLM2_PROMPTS, SMOLLM2_GREEDY, use_tqdm=False)
    assert_greedy_close([o.outputs[0] for o in fp8], [o.outputs[0] for o in ref])
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    for r in ref:
        text = list(r.prompt_token_ids) + list(r.outputs[0].token_ids)
        (scored,) = llm.generate([{"prompt_token_ids": text}], score, use_tqdm=False)
        ranks = [p.rank for p in scored.prompt_logprobs[len(r.prompt_token_ids) :]]
        assert len(ranks) == 256 and max(ranks) <= 5, ranks
