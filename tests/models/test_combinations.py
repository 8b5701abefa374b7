"""Every combination of activation dtype and GGUF weight layout that ``auto`` picks on some CPU,
forced and run on this one: a prompt longer than one prefill chunk (whose first chunks sample
nothing) answers in each, with or without the fused decoder, and at the defaults on the real
server it never fails the step (it once gave a 500, and three of them stopped the engine)."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from support_gguf import tiny_wide_ggufs
from support_models import CPU_COMBINATIONS, assert_greedy_close, write_tiny_llama
from support_servers import serving_app

from atom_anyio import LLM, SamplingParams, kernels
from atom_anyio.models.loader import load_model
from atom_anyio.models.ops import CpuOps, can_pack_bf16, pack_bf16_linears

Q = gguf.GGMLQuantizationType
LONG_PROMPT = [258 + (i * 7) % 4 for i in range(40)] + [(i * 37) % 250 + 5 for i in range(260)]  # 300 tokens


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    return tiny_wide_ggufs(tmp_path_factory.mktemp("combinations"), [Q.Q4_1])[Q.Q4_1]


def generate(path, combination: str, budget: int, max_tokens: int, fused: bool = True, attention: str = "cpu"):
    dtype, gguf_weights = CPU_COMBINATIONS[combination]
    loaded = load_model(str(path), dtype, attention_backend=attention, gguf_weights=gguf_weights)
    loaded.model.use_fused = fused
    llm = LLM(loaded, max_num_batched_tokens=budget, num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([LONG_PROMPT, LONG_PROMPT[:37]], params, use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == 64
    return [o.outputs[0] for o in outs], loaded.model


@pytest.mark.parametrize("max_tokens", [1, 4])
@pytest.mark.parametrize("combination", list(CPU_COMBINATIONS))
def test_prompt_longer_than_a_prefill_chunk_answers_in_every_combination(tiny_q4_1, combination, max_tokens):
    chunked, model = generate(tiny_q4_1, combination, budget=64, max_tokens=max_tokens)
    assert [o.finish_reason for o in chunked] == ["length", "length"], [o.error for o in chunked]
    assert [len(o.token_ids) for o in chunked] == [max_tokens, max_tokens]
    dtype, gguf_weights = CPU_COMBINATIONS[combination]
    assert model.dtype_name.startswith(dtype) and ("Q4_1" in model.dtype_name) == (gguf_weights != "dequantize")
    whole, _ = generate(tiny_q4_1, combination, budget=2048, max_tokens=max_tokens)
    assert_greedy_close(chunked, whole)


@pytest.mark.parametrize("combination", [c for c in CPU_COMBINATIONS if c.startswith("bfloat16")])
def test_the_kernels_prefill_answers_a_long_prompt_as_sdpa_does(tiny_q4_1, combination):
    """``auto`` runs bfloat16 prefill chunks through the paged kernel on AVX512-BF16 CPUs without
    AMX (``cpu_paged``): chunked there, it agrees with one whole prefill and with SDPA's prefill."""
    chunked, model = generate(tiny_q4_1, combination, budget=64, max_tokens=4, attention="cpu_paged")
    assert model.attention_backend.paged_prefill
    assert [o.finish_reason for o in chunked] == ["length", "length"], [o.error for o in chunked]
    whole, _ = generate(tiny_q4_1, combination, budget=2048, max_tokens=4, attention="cpu_paged")
    assert_greedy_close(chunked, whole)
    sdpa, _ = generate(tiny_q4_1, combination, budget=64, max_tokens=4)
    assert_greedy_close(chunked, sdpa)


def test_the_fused_decoder_and_the_op_by_op_path_agree_on_a_long_prompt(tiny_q4_1):
    fused, model = generate(tiny_q4_1, "float32+packed", budget=64, max_tokens=4, fused=True)
    assert model.fused_decoder() is not None
    op_by_op, _ = generate(tiny_q4_1, "float32+packed", budget=64, max_tokens=4, fused=False)
    assert [o.finish_reason for o in fused + op_by_op] == ["length"] * 4
    assert_greedy_close(fused, op_by_op)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.slow
@pytest.mark.anyio
async def test_default_server_answers_long_prompts_and_stays_healthy(smollm2_path):
    """The report, at this machine's defaults: three uncached messages of 580 words (about 2,230
    tokens, past the 2,048 of one prefill chunk) with max_tokens 1, then a short one; each answers
    200 (each was a 500, then 503 engine_dead for everyone)."""
    messages = [(" ".join(f"{word}{i}" for i in range(580)), 1) for word in ("item", "entry", "part")]
    async with serving_app(load_model(None, "auto")) as atom:  # what the server loads at its defaults
        client = atom.quart.test_client()
        for content, max_tokens in [*messages, ("Hi", 2)]:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, await r.get_data(as_text=True)
            usage = (await r.get_json())["usage"]
            assert usage["completion_tokens"] == max_tokens
            assert max_tokens > 1 or usage["prompt_tokens"] > 2048  # more than one chunk
        assert (await client.get("/health")).status_code == 200


AMX_LINEAR, VEC_LINEAR = "linear_amx_bf16", "linear_avx512_bf16"


@pytest.mark.skipif(not can_pack_bf16(), reason="packed bfloat16 GEMM: oneDNN has no native bfloat16 on this CPU")
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("onednn", id="onednn"),  # what a CPU with AVX512-BF16 and no AMX runs at the defaults
        pytest.param(
            "amx",
            marks=pytest.mark.skipif(
                AMX_LINEAR not in kernels.native_kernels(), reason=f"{AMX_LINEAR}: no AMX tiles on this CPU or OS"
            ),
        ),
        pytest.param(  # the tiles on AVX512-BF16's pair products: batch invariance without AMX, or cpu_amx=false
            "avx512_bf16",
            marks=pytest.mark.skipif(
                VEC_LINEAR not in kernels.native_kernels(), reason=f"{VEC_LINEAR}: no AVX512-BF16"
            ),
        ),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 100])
def test_packed_bfloat16_linears_give_the_plain_gemms_result(tiny_q4_1, rows, layout):
    """Each layout the packed linears take: oneDNN's gives F.linear's bits; the tile GEMM's (on AMX, or
    on AVX512-BF16, GGUF blocks there in the blocks' chain) is within a bfloat16 rounding of them.
    Loaded in another layout, converting the model to this one keeps the weights (a dense copy the
    blocks' chain had dropped comes back from the blocks)."""
    tiles, amx = layout != "onednn", layout == "amx"
    loaded_as = {"amx": not amx} if kernels.has_amx_linears() else {}
    model = load_model(str(tiny_q4_1), "bfloat16", attention_backend="cpu", gguf_weights="both", **loaded_as).model
    quantized = model.model.layers[0].mlp.gate_up_proj
    weight = quantized.weight.dequantize()
    pack_bf16_linears(model, tiles, amx)
    float_layer = torch.nn.Linear(256, 96, bias=True).bfloat16()
    pack_bf16_linears(float_layer, tiles, amx)
    packed = "tile_weight" if tiles else "packed_weight"
    chain = layout == "avx512_bf16"  # GGUF blocks in the blocks' chain, a float weight on bfloat16 tiles
    for layer in (quantized, model.lm_head, float_layer):
        expected = "tile_qweight" if chain and layer is not float_layer else packed
        for name in ("tile_weight", "tile_qweight", "packed_weight"):
            assert (getattr(layer, name, None) is not None) == (name == expected), (layer, name)
    # the packed copy replaces the dense one, which only an embedding's lookups keep
    assert quantized.weight.dense is None and model.model.embed_tokens.weight.dense is not None
    x = torch.randn(rows, 256).bfloat16()
    with torch.inference_mode():
        plain = F.linear(x, float_layer.weight, float_layer.bias)
        if tiles:
            torch.testing.assert_close(CpuOps.linear(x, float_layer), plain, rtol=2**-7, atol=1e-2)
        else:
            assert torch.equal(CpuOps.linear(x, float_layer), plain)
        if rows > CpuOps.MAX_GEMV_ROWS or tiles:  # without tiles, fewer rows stream the blocks through the GEMV
            got, want = CpuOps.linear(x, quantized), F.linear(x, weight)
            if chain:  # the scales apply to exact sums: near the float32 weights' product, not the bfloat16 copy's
                got, want = got.float(), F.linear(x.float(), quantized.weight.dequantize(torch.float32))
            if tiles:
                torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
            else:
                assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tiny_head_dim_64(tmp_path_factory):
    """A tiny random Llama whose heads are 64 wide (4 heads, 2 KV heads), like SmolLM2's."""
    path = tmp_path_factory.mktemp("tiny-head-dim-64")
    return write_tiny_llama(path, hidden_size=256, intermediate_size=256)


@pytest.mark.parametrize(
    "setting",
    [
        # the portable twins, what an AVX2 CPU runs
        "cpu_native_kernels",
        # decodes on the AVX512-BF16 variant (what a Zen 4/5 runs) on a CPU with AMX
        pytest.param(
            "cpu_amx",
            marks=pytest.mark.skipif(
                "paged_attention_amx_bf16" not in kernels.native_kernels(),
                reason="paged_attention_amx_bf16: no AMX tiles on this CPU or OS",
            ),
        ),
    ],
)
def test_a_variant_auto_picks_elsewhere_can_be_forced_and_answers_alike(tiny_q4_1, tiny_head_dim_64, setting):
    """Turning a setting off runs what another CPU kind gets, on any CPU, and it answers alike.
    The AMX kernel takes head_dim 64 (prefill chunks and decodes, under auto's backend)."""
    dtype, gguf_weights = CPU_COMBINATIONS["bfloat16+packed"]
    model, backend = (tiny_q4_1, "cpu_paged") if setting == "cpu_native_kernels" else (tiny_head_dim_64, "auto")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    outputs = {}
    for on in (True, False):
        llm = LLM(
            str(model), dtype, attention_backend=backend, gguf_weights=gguf_weights, num_kv_blocks=64, **{setting: on}
        )
        attention = llm.engine.worker.model.attention_backend
        assert (attention.native, attention.amx) == (llm.loaded.plan.native_kernels, llm.loaded.plan.amx)
        assert getattr(llm.loaded.plan, {"cpu_native_kernels": "native_kernels", "cpu_amx": "amx"}[setting]) == on
        if setting == "cpu_amx":  # the linears too: the tiles' layout, or oneDNN's as without AMX
            layers = [m for m in llm.engine.worker.model.modules() if hasattr(m, "tile_weight")]
            assert layers and all((m.tile_weight is not None) == on for m in layers)
        outputs[on] = [o.outputs[0] for o in llm.generate([LONG_PROMPT, LONG_PROMPT[:37]], params)]
    assert_greedy_close(outputs[False], outputs[True])
