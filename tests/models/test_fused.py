"""The fused CPU decoder (models/fused.py, kernels/csrc/decoder.cpp) against
the op-by-op path it replaces, for steps of one token to a prefill chunk: the same
hidden states and the same KV-cache writes, bit for bit, for each weight
type and each attention variant the decoder takes; the models it does not
take say why and run op by op; and served end to end, the greedy tokens are
the op-by-op path's."""

from __future__ import annotations

import gguf
import pytest
import torch
from support_gguf import tiny_wide_ggufs

from atom_anyio import LLM, SamplingParams, kernels
from atom_anyio.models import fused
from atom_anyio.models.attention import AttentionMetadata, CpuPagedAttention, TorchPagedAttention
from atom_anyio.models.decoder import FULL, SLIDING, LlamaForCausalLM, ModelConfig
from atom_anyio.models.loader import load_model
from atom_anyio.models.moe import MoeConfig
from atom_anyio.models.ops import can_pack_bf16, pack_bf16_linears, pack_f32_tile_linears
from atom_anyio.models.quant import QuantizedWeight, QuantLinear

Q = gguf.GGMLQuantizationType
BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def built():
    reason = kernels.load_cpu_kernels()
    if reason is not None:
        pytest.skip(f"CPU kernels unavailable: {reason}")


def random_model(seed: int = 0, backend=None, **overrides) -> LlamaForCausalLM:
    """A float32 model with every parameter random (norm weights and sinks too), seeded."""
    sizes = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    cfg = ModelConfig(**{**sizes, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg, backend or CpuPagedAttention(paged_prefill=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


# (query_lens, context_lens), decodes first: up to four tokens run the GEMV kernels, more the GEMMs
STEPS = {
    "one decode": ([1], [37]),
    "four decodes across block ends": ([1, 1, 1, 1], [4, 5, 9, 70]),
    "a fresh prompt of three": ([3], [3]),
    "decodes and a chunk": ([1, 1, 2], [12, 40, 7]),
    "six decodes": ([1] * 6, [2, 4, 5, 17, 33, 90]),
    "a fresh prompt of 37": ([37], [37]),
    "decodes and a chunk over a cached prefix": ([1, 1, 30], [12, 40, 75]),
}


def run_both(model: LlamaForCausalLM, query_lens: list[int], context_lens: list[int], seed: int = 0):
    """The step's hidden states and KV caches, fused and op by op, from the same random cache."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // BLOCK) for c in context_lens]
    order = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(order[start : start + n])
        start += n
    shape = (len(order) * BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    dtype = model.model.norm.weight.dtype
    caches = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    ids = torch.randint(0, cfg.vocab_size, (sum(query_lens),), generator=g)
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens, strict=True)])
    results = []
    for use_fused in (True, False):
        model.use_fused = use_fused
        kv = [(k.clone(), v.clone()) for k, v in caches]
        meta = AttentionMetadata.build(tables, context_lens, query_lens, BLOCK, torch.device("cpu"))
        with torch.inference_mode():
            results.append((model(ids, positions, meta, kv), kv))
    model.use_fused = True
    return results


def assert_same(model: LlamaForCausalLM, step: str) -> None:
    (fused_out, fused_kv), (ops_out, ops_kv) = run_both(model, *STEPS[step])
    assert model._fused[0] is not None, model._fused[1]
    assert torch.equal(fused_out, ops_out)
    for (fk, fv), (ok, ov) in zip(fused_kv, ops_kv, strict=True):
        assert torch.equal(fk, ok) and torch.equal(fv, ov)


VARIANTS = {
    "llama": {},
    "qwen2 qkv bias": {"attention_bias": True},
    "qwen3 q/k norm": {"qk_norm": True},
    "windows and sinks": {
        "sliding_window": 5,
        "layer_types": (SLIDING, FULL, SLIDING),
        "attention_sinks": True,
        "o_proj_bias": True,
    },
    "one kv head": {"num_key_value_heads": 1},
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_step_equals_the_op_by_op_path_in_float32(variant, step):
    assert_same(random_model(**VARIANTS[variant]), step)


@pytest.mark.skipif(
    kernels.f32_tile_linears_reason() is None, reason="the float32 tiles: an AVX2-only or AMD AVX512 CPU's"
)
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_step_equals_the_op_by_op_path_on_the_float32_panels(variant, step):
    """What `batch_invariant` picks on an AVX2-only CPU for a float32 model: every linear on the float32
    tile GEMM's panels at any row count."""
    model = random_model(**VARIANTS[variant])
    assert pack_f32_tile_linears(model) > 0 and model.model.layers[0].mlp.down_proj.tile_weight is not None
    model.attention_backend.use_auto_batch_invariant()
    assert_same(model, step)


AMX_LINEAR = "linear_amx_bf16"
needs_amx_linears = pytest.mark.skipif(
    AMX_LINEAR not in kernels.native_kernels(), reason=f"{AMX_LINEAR}: no AMX tiles on this CPU or OS"
)


@needs_amx_linears
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("invariant", [False, True], ids=["own-split", "batch-invariant"])
def test_fused_step_equals_the_op_by_op_path_in_bfloat16_on_the_amx_tiles(variant, step, invariant):
    """What auto picks on a CPU with AMX: bfloat16, every linear on the AMX GEMM (at any row count,
    so the fused decoder runs it past four rows too), the attention's partition as the backend
    passes it (batch invariance on or off)."""
    model = random_model(**VARIANTS[variant]).to(torch.bfloat16)
    pack_bf16_linears(model, amx=True)
    if invariant:
        model.attention_backend.use_auto_batch_invariant()
    assert_same(model, step)


needs_onednn_bf16 = pytest.mark.skipif(
    not can_pack_bf16(), reason="oneDNN's bfloat16 GEMM: no AVX512-BF16 or AMX on this CPU"
)


@needs_onednn_bf16
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_step_equals_the_op_by_op_path_in_bfloat16_on_onednn(variant, step):
    """What auto picks on a CPU with AVX512-BF16 and no AMX (Zen 4, Zen 5), and cpu_amx=false on
    one with AMX: bfloat16, every linear on oneDNN's packed weight at any row count."""
    model = random_model(**VARIANTS[variant]).to(torch.bfloat16)
    pack_bf16_linears(model, amx=False)
    assert model.model.layers[0].mlp.down_proj.packed_weight is not None
    assert_same(model, step)


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    """One seeded tiny Llama as GGUFs of each type with a kernel."""
    return tiny_wide_ggufs(tmp_path_factory.mktemp("fused"), [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "step", ["one decode", "four decodes across block ends", "six decodes", "decodes and a chunk over a cached prefix"]
)
@pytest.mark.parametrize("gguf_weights", ["both", "packed"])
def test_fused_step_equals_the_op_by_op_path_with_quantized_weights(tiny_ggufs, qtype, step, gguf_weights):
    """Float32 with invariance off (with the dense copy, or without where it does not fit), as auto
    picks on a CPU with AVX512; past sixteen rows the fused decoder runs the copy's GEMM, as the
    op-by-op path."""
    model = load_model(
        tiny_ggufs[qtype],
        dtype="float32",
        attention_backend="cpu_paged",
        gguf_weights=gguf_weights,
        batch_invariant=False,
    )
    model = model.model
    assert model.dtype_name == f"float32+{qtype.name}"  # kept quantized: the embedding and the head too
    dense = model.model.layers[0].mlp.gate_up_proj.weight.dense
    assert (dense is not None) == (gguf_weights == "both")
    assert_same(model, step)


@pytest.mark.skipif(
    kernels.f32_tile_linears_reason() is None, reason="the float32 tiles: an AVX2-only or AMD AVX512 CPU's"
)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("step", ["one decode", "six decodes", "decodes and a chunk over a cached prefix"])
def test_fused_step_equals_the_op_by_op_path_on_the_float32_tiles(tiny_ggufs, qtype, step):
    """What auto picks on an AVX2-only CPU: every linear on the float32 tile GEMM (no dense copy;
    K-quants as sub-blocks with float32 scales), the fused decoder's steps the op-by-op path's bits."""
    model = load_model(tiny_ggufs[qtype], dtype="float32", attention_backend="cpu_paged", gguf_weights="both").model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.tile_qweight is not None and m.weight.dense is None for m in linears)
    assert_same(model, step)


def test_models_the_fused_decoder_does_not_take_say_why_and_run_op_by_op():
    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=32)
    cases = {
        "attention backend 'torch'": random_model(backend=TorchPagedAttention()),
        "mixture-of-experts": random_model(moe=moe, architecture="Qwen3MoeForCausalLM"),
        "not packed for oneDNN or the tile GEMM": random_model().to(torch.bfloat16),  # torch's F.linear
    }
    for reason, model in cases.items():
        decoder, why = fused.build(model)
        assert decoder is None and reason in why
        (out, _), (ref, _) = run_both(model, *STEPS["one decode"])
        assert model._fused == (None, why) and torch.equal(out, ref)


def test_an_out_of_vocabulary_token_is_an_error_not_a_crash():
    model = random_model()
    meta = AttentionMetadata.build([[0]], [1], [1], BLOCK, torch.device("cpu"))
    kv = [(torch.zeros(BLOCK, 2, 16), torch.zeros(BLOCK, 2, 16)) for _ in range(3)]
    with torch.inference_mode(), pytest.raises(RuntimeError, match="out of the vocabulary"):
        model(torch.tensor([300]), torch.tensor([0]), meta, kv)


def test_served_greedy_tokens_equal_the_op_by_op_engines(tiny_ggufs):
    prompts = [[258, 72, 101, 108], [259, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106], [260, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for use_fused in (True, False):
        path = str(tiny_ggufs[Q.Q4_1])
        llm = LLM(path, dtype="float32", gguf_weights="packed", attention_backend="cpu", num_kv_blocks=64)
        llm.loaded.model.use_fused = use_fused
        outputs[use_fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert (llm.loaded.model.fused_decoder() is not None) == use_fused
    assert outputs[True] == outputs[False]


@needs_onednn_bf16
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("step", ["one decode", "four decodes across block ends", "six decodes"])
def test_fused_step_equals_the_op_by_op_path_for_a_gguf_on_onednn(tiny_ggufs, qtype, step):
    """The default model's layout with bfloat16 without AMX and batch invariance off (Zen 4, Zen 5;
    cpu_amx=false forces it on AMX): 1-4 rows through the GEMV over the GGUF blocks, rounded back to
    bfloat16, more through oneDNN's packed dense copy."""
    model = load_model(
        tiny_ggufs[qtype],
        dtype="bfloat16",
        attention_backend="cpu",
        gguf_weights="both",
        amx=False,
        batch_invariant=False,
    )
    model = model.model
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down.weight, QuantizedWeight) and down.packed_weight is not None
    assert_same(model, step)


needs_vector_tiles = pytest.mark.skipif(
    not kernels.has_tile_linears(), reason="linear_avx512_bf16: no AVX512-BF16 on this CPU"
)


@needs_vector_tiles
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "step", ["one decode", "four decodes across block ends", "six decodes", "decodes and a chunk over a cached prefix"]
)
def test_fused_step_equals_the_op_by_op_path_for_a_gguf_at_the_defaults_without_amx(tiny_ggufs, qtype, step):
    """The default model's layout where auto picks bfloat16 without AMX (Zen 4, Zen 5; cpu_amx=false
    forces it on AMX): batch invariance on, every linear on the tile GEMM's vector variant at any row
    count, the blocks in the blocks' chain (K-quants as sub-blocks with float32 scales; their dense
    copies dropped, the embedding's kept for its rows); the attention's fixed partition."""
    loaded = load_model(tiny_ggufs[qtype], dtype="bfloat16", attention_backend="cpu", gguf_weights="both", amx=False)
    model = loaded.model
    assert loaded.plan.batch_invariant and loaded.plan.fused_decoder
    down = model.model.layers[0].mlp.down_proj
    assert down.tile_qweight is not None and down.tile_weight is None
    assert down.weight.dense is None  # the tiles serve every row count
    assert_same(model, step)


@needs_onednn_bf16
def test_a_gguf_without_dense_copies_in_bfloat16_on_onednn_runs_op_by_op(tiny_ggufs):
    """gguf_weights=packed without the tile GEMM (batch invariance off, no AMX): the layers' batched
    rows take bfloat16 slices dequantized each step, which the fused decoder does not run; it says so."""
    loaded = load_model(
        tiny_ggufs[Q.Q4_1],
        dtype="bfloat16",
        attention_backend="cpu",
        gguf_weights="packed",
        amx=False,
        batch_invariant=False,
    )
    decoder, why = fused.build(loaded.model)
    assert decoder is None and "not packed for oneDNN or the tile GEMM (layer 0)" in why
    assert not loaded.plan.fused_decoder and loaded.plan.fused_decoder_why == why


@needs_amx_linears
@pytest.mark.parametrize("step", ["one decode", "six decodes", "decodes and a chunk over a cached prefix"])
def test_fused_step_equals_the_op_by_op_path_for_a_gguf_at_the_defaults_on_amx(tiny_ggufs, step):
    """The default model's layout where auto picks bfloat16: GGUF blocks with their dense copies on
    the AMX tiles, the embedding's rows from its dense copy, batch invariance on."""
    model = load_model(tiny_ggufs[Q.Q8_0], dtype="bfloat16", attention_backend="cpu", gguf_weights="both").model
    assert model.attention_backend.batch_invariant == (model.config.head_dim % 64 == 0)
    assert_same(model, step)


@needs_amx_linears
def test_served_greedy_tokens_equal_the_op_by_op_engines_in_bfloat16(tiny_ggufs):
    """End to end at what auto picks on an AMX CPU, and with cpu_amx off (a decoder built over
    oneDNN's packed weights, not over the tiles): the greedy tokens are each one's op-by-op path's."""
    prompts = [[258, 72, 101, 108], [259, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106], [260, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for amx in (True, False):  # off: the vector variant, Q4_1 in the blocks' chain
        loaded = load_model(tiny_ggufs[Q.Q4_1], dtype="bfloat16", attention_backend="cpu", gguf_weights="both", amx=amx)
        assert loaded.plan.fused_decoder and loaded.plan.tile_linears
        down = loaded.model.model.layers[0].mlp.down_proj
        assert (down.tile_weight is not None, down.tile_qweight is not None) == (amx, not amx)
        outputs = {}
        for use_fused in (True, False):
            llm = LLM(loaded, num_kv_blocks=64)
            loaded.model.use_fused = use_fused
            outputs[use_fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert (loaded.model.fused_decoder() is not None) == use_fused
            del llm
        assert outputs[True] == outputs[False]
