"""``batch_invariant``: a sequence's logits are the same bits alone or batched, in one prefill or in
chunks, computed or taken from the prefix cache, with async scheduling on or off; on every weight
layout a CPU's ``auto`` picks (``CPU_COMBINATIONS``), whatever CPU the suite runs on."""

from __future__ import annotations

import math
import shutil

import gguf
import pytest
import torch
import torch.nn.functional as F
from support_gguf import random_quantized, tiny_wide_ggufs
from support_models import CPU_COMBINATIONS, random_hf_model

from atom_anyio import LLM, SamplingParams, kernels
from atom_anyio.cli import build_parser
from atom_anyio.config import Config
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.models import quant
from atom_anyio.models.attention import AttentionMetadata
from atom_anyio.models.attention.cpu import INVARIANT_PARTITION
from atom_anyio.models.attention.metadata import to_kv_cache
from atom_anyio.models.loader import load_model
from atom_anyio.models.ops import BatchInvariantCpuOps, pack_bf16_linears
from atom_anyio.models.quant import QuantLinear

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    assert kernels.load_cpu_kernels() is None


# the linears


def linears(dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """One linear layer of each kind ``BatchInvariantCpuOps.linear`` runs: float weights, oneDNN's packed
    bfloat16 copy, quantized blocks with and without their dense copy."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 80, bias=True).to(dtype)
    blocks, _ = random_quantized(80, 96, Q.Q4_1)
    blocks = blocks.to(dtype=dtype)
    layers = {"float": dense, "quantized": QuantLinear(blocks, has_bias=False)}
    layers["quantized+dense"] = QuantLinear(blocks.with_dense(), has_bias=False)
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = torch.nn.Sequential(torch.nn.Linear(96, 80, bias=True).to(dtype))
        pack_bf16_linears(packed, amx=False)  # what a CPU with AVX512-BF16 and no AMX runs
        layers["packed"] = packed[0]
    if dtype == torch.bfloat16 and kernels.has_amx_linears():
        tiles = torch.nn.Sequential(torch.nn.Linear(96, 80, bias=True).to(dtype))
        pack_bf16_linears(tiles, amx=True)
        assert tiles[0].tile_weight is not None
        layers["amx"] = tiles[0]
    return layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_linear_output_is_the_same_bits_in_any_batch_and_place(dtype):
    x = torch.randn(70, 96).to(dtype)
    for kind, layer in linears(dtype).items():
        every = BatchInvariantCpuOps.linear(x, layer)
        assert every.is_contiguous(), kind  # the decoder views q, k and v in place
        reference = F.linear(
            x.float(), quant_or_dense(layer).float(), None if layer.bias is None else layer.bias.float()
        )
        assert torch.allclose(every.float(), reference, rtol=0.05, atol=0.05), kind
        for begin, end in [(0, 1), (5, 6), (3, 7), (13, 30), (16, 32), (40, 70)]:
            part = BatchInvariantCpuOps.linear(x[begin:end], layer)
            assert torch.equal(part, every[begin:end]), f"{kind}: rows {begin}:{end} differ from the same rows in 70"
        assert BatchInvariantCpuOps.linear(x[:0], layer).shape == (0, 80)


def quant_or_dense(layer) -> torch.Tensor:
    w = layer.weight
    return w.dequantize(torch.float32) if isinstance(w, quant.QuantizedWeight) else w


# the attention kernel


# the kernel's invariance for any fixed partition, at a size the test's 1,100 keys split three ways
# (the engine's is INVARIANT_PARTITION)
PARTITION = 512
assert INVARIANT_PARTITION % PARTITION == 0


def attention(
    q,
    k_cache,
    v_cache,
    contexts: list[int],
    queries: list[int],
    tables: list[list[int]],
    block_size: int,
    window: int,
    variant: str,
):
    """The kernel's batch-invariant output for one step: sequence ``i`` has ``contexts[i]`` keys in
    the cache, the last ``queries[i]`` of them queried now (``q``'s rows, sequence after sequence),
    on ``variant`` (``KERNEL_VARIANTS``)."""
    meta = AttentionMetadata.build(tables, contexts, queries, block_size, torch.device("cpu"))
    out = torch.empty_like(q)
    partition = math.lcm(PARTITION, block_size)
    scale = 1.0 / math.sqrt(q.shape[-1])
    tables_, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
    torch.ops.atom.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        tables_,
        lens,
        starts,
        block_size,
        scale,
        window,
        None,
        partition,
        variant != "portable",
        variant == "amx",
    )
    return out


AMX_ATTENTION = "paged_attention_amx_bf16"
# the kernel's variants for each model dtype and cache dtype (None: the model's): the portable twin,
# the native one (AVX512-BF16 for bfloat16, what a CPU without AMX runs), the AMX tiles (bfloat16
# only; skipped by name where the CPU has none); over an fp8 cache (kv_cache_dtype) the portable
# twin and the native variant, which reads every row's keys and values in registers in a
# batch-invariant call (prefill's rows as a decode's)
KERNEL_VARIANTS = (
    [
        pytest.param(dtype, variant, None, id=f"{str(dtype).removeprefix('torch.')}-{variant}")
        for dtype in (torch.float32, torch.bfloat16)
        for variant in ("portable", "native")
    ]
    + [
        pytest.param(
            torch.bfloat16,
            "amx",
            None,
            id="bfloat16-amx",
            marks=pytest.mark.skipif(
                AMX_ATTENTION not in kernels.native_kernels(), reason=f"{AMX_ATTENTION}: no AMX tiles on this CPU or OS"
            ),
        )
    ]
    + [
        pytest.param(torch.bfloat16, variant, cache, id=f"bfloat16-{variant}-{str(cache).removeprefix('torch.')}")
        for cache in (torch.float8_e4m3fn, torch.float8_e5m2)
        for variant in ("portable", "native")
    ]
)


@pytest.mark.parametrize("window", [0, 300], ids=["causal", "window"])
@pytest.mark.parametrize(("dtype", "variant", "cache"), KERNEL_VARIANTS)
def test_the_kernel_gives_a_query_the_same_bits_alone_in_a_batch_or_in_a_chunk(dtype, variant, cache, window):
    """A sequence of 1100 keys (three partitions) beside a short one: a query position's output as
    a decode of that position (the short sequence decoding beside it), and inside prefill chunks of
    several sizes that put it at different places in the kernel's tiles (as a batch's budget cuts a
    prompt anywhere). ``cache``: the KV cache's dtype where not the model's (fp8)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    tables = [list(range(69)), list(range(69, 72))]
    k_cache = to_kv_cache(torch.randn(72 * bs, kv_heads, dim), cache or dtype)
    v_cache = to_kv_cache(torch.randn(72 * bs, kv_heads, dim), cache or dtype)
    q_long, q_short = torch.randn(1100, heads, dim).to(dtype), torch.randn(1, heads, dim).to(dtype)
    positions = [0, 15, 511, 512, 700, 1099]
    alone = {}
    for p in positions:  # decodes lead a step
        step = torch.cat((q_long[p : p + 1], q_short))
        alone[p] = attention(step, k_cache, v_cache, [p + 1, 37], [1, 1], tables, bs, window, variant)[0]
    for chunk in (1100, 300, 64, 37, 7):  # odd sizes: boundaries off the blocks' and tiles' edges
        for begin in range(0, 1100, chunk):
            end = min(1100, begin + chunk)
            q = torch.cat((q_short, q_long[begin:end]))
            out = attention(q, k_cache, v_cache, [37, end], [1, end - begin], tables[::-1], bs, window, variant)[1:]
            for p in positions:
                if begin <= p < end:
                    assert torch.equal(out[p - begin], alone[p]), f"position {p} in the chunk [{begin}, {end})"


# the engine, end to end


@pytest.fixture(scope="module")
def tiny_gguf(tiny_chat_gguf):
    """A seeded tiny Llama as a Q4_1 GGUF (kept quantized, or dequantized, by the combination)."""
    return tiny_chat_gguf[Q.Q4_1]


# (the tiny models' context, 2,048, holds one INVARIANT_PARTITION: the kernel-level test above splits keys
# into partitions and merges them)
TARGET = [258 + (i * 7919) % 4 if i % 50 == 0 else 3 + (i * 131) % 250 for i in range(620)]
OTHERS = [[3 + (i * j * 17) % 250 for i in range(5 + 23 * j)] for j in range(1, 16)]  # 15, some prefilling


def outputs(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and [(x.token_id, x.logprob, x.top) for x in a.logprobs] == [
        (x.token_id, x.logprob, x.top) for x in b.logprobs
    ]


@pytest.fixture(scope="module")
def wide_ggufs(tmp_path_factory):
    """The same kind of model with heads 64 wide, which the AMX attention takes (as SmolLM2's)."""
    return tiny_wide_ggufs(tmp_path_factory.mktemp("invariance"), [Q.Q4_1, Q.Q4_K])


@pytest.fixture(scope="module")
def wide_gguf(wide_ggufs):
    return wide_ggufs[Q.Q4_1]


@pytest.fixture(scope="module")
def wide_q4_k(wide_ggufs):
    return wide_ggufs[Q.Q4_K]


AMX = "paged_attention_amx_bf16", "linear_amx_bf16"
needs_amx = pytest.mark.skipif(
    not set(AMX) <= set(kernels.native_kernels()), reason=f"{' and '.join(AMX)}: no AMX tiles on this CPU or OS"
)
needs_chain = pytest.mark.skipif(
    not kernels.has_tile_linears() or kernels.has_amx_linears(), reason="the blocks' chain: AVX512-BF16 without AMX"
)
needs_f32_tiles = pytest.mark.skipif(
    kernels.f32_tile_linears_reason() is None,
    reason="the float32 tiles: an AVX2-only CPU's (ATOM_KERNEL_ISA=avx2) or an AMD CPU's with AVX512",
)
# every layout a CPU's auto picks, on the head_dim-16 model; the bfloat16 ones again with heads 64
# wide, where a CPU with AMX runs the attention and the linears on its tiles, and there at the
# default (auto), which turns invariance on where every linear has its AMX copy
END_TO_END = (
    [pytest.param(c, "tiny_gguf", True, id=c) for c in CPU_COMBINATIONS]
    + [pytest.param(c, "wide_gguf", True, id=f"{c}-head_dim_64") for c in CPU_COMBINATIONS if c.startswith("bfloat16")]
    + [
        pytest.param(c, "wide_gguf", None, id=f"{c}-head_dim_64-auto", marks=needs_amx)
        for c in ("bfloat16+both", "bfloat16+packed", "bfloat16+dequantize")
    ]
    # K-quants at the default where the float32 tiles take them (an AVX2-only CPU), and where the blocks'
    # chain does (AVX512-BF16 without AMX)
    + [pytest.param("float32+both", "wide_q4_k", None, id="float32+both-q4_k-auto", marks=needs_f32_tiles)]
    # float32 matrices at the default where the float32 tiles take them (as panels that replace them)
    + [pytest.param("float32+dequantize", "wide_gguf", None, id="float32+dequantize-auto", marks=needs_f32_tiles)]
    + [pytest.param("bfloat16+packed", "wide_q4_k", None, id="bfloat16+packed-q4_k-auto", marks=needs_chain)]
)


@pytest.mark.parametrize(("combination", "model", "setting"), END_TO_END)
def test_a_sequences_logits_do_not_depend_on_batch_chunks_cache_or_async(request, combination, model, setting):
    dtype, gguf_weights = CPU_COMBINATIONS[combination]
    path = request.getfixturevalue(model)

    def llm(**engine):
        return LLM(str(path), dtype=dtype, gguf_weights=gguf_weights, batch_invariant=setting, **engine)

    whole = llm(max_num_batched_tokens=2048)
    backend, plan = whole.engine.worker.model.attention_backend, whole.loaded.plan
    assert backend.batch_invariant and plan.batch_invariant
    assert (plan.batch_invariant_why == "requested") == (setting is not None)
    if dtype == "float32":  # every linear on the GEMV's arithmetic at any row count: fused too, no dense copy
        assert plan.fused_decoder and not plan.dense_copies
    if plan.tile_linears and dtype == "float32":  # a float32 matrix on panels is gone (meta: no memory)
        model = whole.engine.worker.model
        on_panels = [m for m in model.modules() if getattr(m, "tile_weight", None) is not None]
        assert all(m.weight.device.type == "meta" for m in on_panels)
        assert bool(on_panels) == (gguf_weights == "dequantize")
    if model == "wide_gguf" and kernels.has_amx_linears():  # the tiles run it here
        assert backend.on_amx_tiles
        assert all(m.tile_weight is not None for m in whole.engine.worker.model.modules() if hasattr(m, "tile_weight"))
    alone = outputs(whole, [TARGET])[0]
    for n in (1, 3, 15):
        assert same(outputs(whole, [TARGET, *OTHERS[:n]])[0], alone), f"batched with {n} others"
    assert same(outputs(whole, [TARGET])[0], alone), "a prefix-cache hit"
    for budget, async_scheduling in [(48, False), (100, True), (2048, True)]:
        chunked = llm(max_num_batched_tokens=budget, async_scheduling=async_scheduling)
        assert same(outputs(chunked, [TARGET])[0], alone), f"chunks of {budget}, async {async_scheduling}"
        assert same(outputs(chunked, [*OTHERS[:4], TARGET])[-1], alone), f"chunks of {budget} behind others"


# auto's invariance over the vector variant of the tile GEMM (AVX512-BF16 without AMX, or cpu_amx off)
VECTOR_TILES = "vector tiles"
FLOAT32_TILES = "float32 tiles"  # over the float32 tile GEMM (kernels.f32_tile_linears_reason)


@pytest.mark.parametrize(
    ("combination", "model", "engine", "on"),
    [
        pytest.param("bfloat16+both", "wide_gguf", {}, True, marks=needs_amx, id="amx"),
        pytest.param("bfloat16+both", "wide_gguf", {"cpu_amx": False}, True, marks=needs_amx, id="cpu_amx-off"),
        pytest.param(
            "bfloat16+both", "wide_gguf", {"cpu_native_kernels": False}, False, marks=needs_amx, id="native-off"
        ),
        # GGUF blocks with a dense copy or without: on the tiles where the CPU has a tile GEMM (Q4_1's
        # quantized tiles, or the blocks' chain without AMX, K-quants too), else through the GEMV (Q4_K
        # without a dense copy on AMX, whose tiles take the 32-blocks only)
        pytest.param("bfloat16+both", "wide_gguf", {}, VECTOR_TILES, id="blocks-and-dense-copies"),
        pytest.param("bfloat16+packed", "wide_gguf", {}, VECTOR_TILES, id="blocks-on-the-tiles"),
        pytest.param("bfloat16+packed", "wide_q4_k", {}, "vector tiles without AMX", id="k-quant-blocks"),
        # heads 16 wide: the AMX attention does not take them; the vector variant's does
        pytest.param("bfloat16+both", "tiny_gguf", {}, "vector tiles without AMX", id="heads-16-wide"),
        # float32: on where the float32 tiles take every linear (an AVX2-only CPU, an AMD CPU with AVX512;
        # GGUF blocks, K-quants too, or float32 matrices as panels), else off
        pytest.param("float32+both", "wide_gguf", {}, FLOAT32_TILES, id="float32"),
        pytest.param("float32+both", "wide_q4_k", {}, FLOAT32_TILES, id="float32-k-quants"),
        pytest.param("float32+dequantize", "wide_gguf", {}, FLOAT32_TILES, id="float32-matrices"),
    ],
)
def test_auto_turns_batch_invariance_on_only_where_it_costs_nothing(request, caplog, combination, model, engine, on):
    """At the default, invariance is on where every linear runs on the tile GEMM and the attention's
    invariant form costs nothing: bfloat16 on a CPU with AMX (the AMX GEMM, the attention on the
    tiles, heads it takes), or with AVX512-BF16 and no AMX (or cpu_amx off: the vector variant, GGUF
    blocks in the blocks' chain), and float32 on an AVX2-only CPU or an AMD CPU with AVX512 (every
    linear on the float32 tiles); off wherever the GEMMs or the attention would pay for it: native
    kernels off, blocks the tile GEMMs have no tiles for (the GEMV), float32 on Intel's AVX512 CPUs,
    bfloat16 on a CPU without AVX512-BF16. The plan says which, and why, in one line."""
    dtype, gguf_weights = CPU_COMBINATIONS[combination]
    if on == VECTOR_TILES:
        on = kernels.has_tile_linears()
    elif on == "vector tiles without AMX":
        on = kernels.has_tile_linears() and not kernels.has_amx_linears()
    elif on == FLOAT32_TILES:
        on = kernels.f32_tile_linears_reason() is not None
    path = request.getfixturevalue(model)
    llm = LLM(str(path), dtype=dtype, gguf_weights=gguf_weights, num_kv_blocks=64, **engine)
    backend, plan = llm.engine.worker.model.attention_backend, llm.loaded.plan
    assert backend.batch_invariant == plan.batch_invariant == on
    why = ("bfloat16 on AMX" if backend.on_amx_tiles else "bfloat16 on AVX512-BF16") if on else "auto: off"
    why = (kernels.f32_tile_linears_reason() or "").partition(":")[0] if on and dtype == "float32" else why
    assert plan.batch_invariant_why.startswith(why)
    assert backend.paged_prefill == (on or backend.name == "cpu_paged")
    assert llm.generate([TARGET[:40]], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
    said = [r.getMessage() for r in caplog.records if "model.plan" in r.getMessage()]
    assert len(said) == 1 and f"'batch_invariant': {on}" in said[0]


def test_an_engine_on_a_model_loaded_with_other_kernel_switches_is_refused_in_one_line(tiny_gguf):
    """cpu_amx and cpu_native_kernels are what the model is loaded with (its plan): an engine asking
    for others is refused, naming the setting, and leaves the model as it was; LLM on a loaded model
    takes them from its plan."""
    loaded = load_model(str(tiny_gguf), dtype="bfloat16", gguf_weights="both", amx=False)
    backend = loaded.model.attention_backend
    before = (backend.name, backend.batch_invariant, backend.native, backend.amx, loaded.plan)
    with pytest.raises(ValueError, match=r"^cpu_amx=True: the model was loaded with cpu_amx=False"):
        Engine(loaded, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match=r"^cpu_native_kernels=False: the model was loaded with cpu_native_kernels"):
        LLM(loaded, num_kv_blocks=64, cpu_native_kernels=False)
    assert (backend.name, backend.batch_invariant, backend.native, backend.amx, loaded.plan) == before
    llm = LLM(loaded, num_kv_blocks=64)
    assert (llm.engine.cfg.cpu_amx, llm.engine.cfg.cpu_native_kernels) == (False, True)


def test_the_setting_defaults_to_auto_and_takes_a_value_or_a_bare_flag():
    assert Config.of().batch_invariant is None  # auto
    assert Config.from_env({"ATOM_BATCH_INVARIANT": "0"}).batch_invariant is False
    assert Config.from_env({"ATOM_BATCH_INVARIANT": "true"}).batch_invariant is True
    assert build_parser().parse_args(["serve", "--batch-invariant"]).batch_invariant is True
    assert build_parser().parse_args(["serve", "--batch-invariant", "false"]).batch_invariant is False
    assert build_parser().parse_args(["serve"]).batch_invariant is None


def test_batch_invariance_on_another_backend_is_a_one_line_error(tiny_gguf):
    with pytest.raises(ValueError, match="batch_invariant runs on the cpu attention backend, not 'torch'"):
        LLM(str(tiny_gguf), attention_backend="torch", batch_invariant=True)


def test_batch_invariance_of_a_mixture_of_experts_is_a_one_line_error(tmp_path, tiny_model_dir):
    random_hf_model("mixtral").save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path)
    with pytest.raises(ValueError, match="batch_invariant does not cover mixture-of-experts models"):
        LLM(str(tmp_path), dtype="float32", batch_invariant=True)


@pytest.mark.parametrize("combination", ["bfloat16+both", "bfloat16+packed", "float32+both", "float32+packed"])
def test_speculation_is_exact_with_batch_invariance(tiny_gguf, combination):
    """A verifying step scores the draft as a small chunk (five rows here); with batch_invariant its
    rows are a plain decode's bits, so tokens and logprobs equal the run without speculation
    (without it, outputs may part at a near tie, as a batch's may: docs/engine.md)."""
    dtype, gguf_weights = CPU_COMBINATIONS[combination]
    prompts = [TARGET[:200], OTHERS[3], OTHERS[9]]

    def llm(**engine):
        return LLM(str(tiny_gguf), dtype=dtype, gguf_weights=gguf_weights, batch_invariant=True, **engine)

    plain = outputs(llm(), prompts)
    speculating = llm(speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    outputs(speculating, prompts)  # the suffix store now holds these outputs: the second run drafts them
    speculating.engine.speculator.num_accepted_tokens = 0
    again = outputs(speculating, prompts)
    assert speculating.engine.speculator.num_accepted_tokens > 0, "no draft was accepted: nothing was verified"
    assert all(same(a, b) for a, b in zip(again, plain, strict=True))


@pytest.mark.parametrize(
    ("dtype", "batch_invariant", "exact"),
    # float32 without invariance: a verifying chunk past four rows takes torch's GEMM, a decode the GEMV
    [("float32", False, False), ("float32", True, True), ("bfloat16", False, False), ("bfloat16", True, True)],
)
def test_speculation_says_at_start_whether_it_is_exact(tiny_gguf, caplog, dtype, batch_invariant, exact):
    LLM(str(tiny_gguf), dtype=dtype, batch_invariant=batch_invariant, speculative_config={"method": "suffix"})
    (line,) = [r.getMessage() for r in caplog.records if "spec_decode.on" in r.getMessage()]
    assert f"'exact': {exact}" in line
