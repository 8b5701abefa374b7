"""The architectures beyond the dense Llama family, end to end against
transformers: sliding windows (Mistral, Qwen2), YaRN, mixture of experts
(Qwen3-MoE, Mixtral) and GPT-OSS. Each tiny seeded model is written with
``save_pretrained`` and served through ``LLM``; its greedy tokens must equal
transformers' in float32 on prompts longer than its window and its original
RoPE length: alone, batched, with chunked prefill and after a prefix hit, on
both attention backends."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import transformers
from support_models import greedy, hf_greedy, prompt_tokens, random_hf_model, tiny_families

from atom_anyio import LLM
from atom_anyio.models.attention import AttentionMetadata, TorchPagedAttention
from atom_anyio.models.decoder import ARCHITECTURES
from atom_anyio.models.loader import load_model
from atom_anyio.models.moe import Experts, MoeConfig, Router, SparseMoeBlock
from atom_anyio.models.ops import TorchOps

FAMILIES = tiny_families(
    "mistral-window",
    "qwen2-window",
    "qwen3-yarn",
    "llama-yarn-mscale",
    "qwen3-moe",
    "qwen3-moe-norm-yarn",
    "mixtral",
    "gpt-oss",
)
BACKENDS = ["torch", "cpu"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tiny_model_dir):
    hf = random_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, path)
    return request.param, hf, path


# prompts longer than the window (7) and the original RoPE length (16); two share a 33-token prefix
SHARED = prompt_tokens(33, seed=10)
PROMPTS = [prompt_tokens(41, seed=11), SHARED + prompt_tokens(6, seed=12), SHARED + prompt_tokens(19, seed=13)]


@pytest.fixture(scope="module")
def reference(family):
    _, hf, _ = family
    return [hf_greedy(hf, p) for p in PROMPTS]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equals_transformers_alone_batched_chunked_and_after_a_prefix_hit(family, reference, backend):
    _, _, path = family
    loaded = load_model(str(path), dtype="float32", attention_backend=backend)
    engine = dict(max_model_len=128, block_size=4)
    alone = LLM(loaded, enable_prefix_caching=False, **engine)
    assert [greedy(alone, [p])[0] for p in PROMPTS] == reference
    assert greedy(LLM(loaded, enable_prefix_caching=False, **engine), PROMPTS) == reference
    chunked = LLM(loaded, max_num_batched_tokens=9, enable_prefix_caching=False, **engine)
    assert greedy(chunked, PROMPTS) == reference
    cached = LLM(loaded, **engine)
    assert greedy(cached, PROMPTS[1:2]) == reference[1:2]
    assert greedy(cached, PROMPTS[2:]) == reference[2:]
    assert cached.engine.block_manager.num_hit_tokens >= 32  # the shared prefix's full blocks


def test_the_reference_depends_on_the_feature_under_test(family, reference):
    """Guards the exactness test: without its window or its RoPE scaling the
    model would produce other tokens on these prompts."""
    name, hf, _ = family
    settings = {**hf.config.to_dict(), "sliding_window": 10_000, "use_sliding_window": False}
    if "layer_types" in settings:
        settings["layer_types"] = ["full_attention"] * hf.config.num_hidden_layers
    plain = type(hf.config)(**settings)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": hf.config.rope_parameters["rope_theta"]}
    plain_hf = type(hf)(plain).eval()
    plain_hf.load_state_dict(hf.state_dict())
    assert hf_greedy(plain_hf, PROMPTS[0]) != reference[0], name
    assert len({t for r in reference for t in r}) > 5  # varied output, not one repeated token


# mixture of experts: tied router scores


def tie_router_pairs(hf: transformers.PreTrainedModel) -> None:
    """Experts 2i and 2i + 1 get the same router row: their scores tie on every token."""
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight[1::2] = layer.mlp.gate.weight[0::2]


def test_tied_router_scores_pick_the_experts_transformers_picks_alone_and_batched():
    hf = random_hf_model("qwen3-moe")
    tie_router_pairs(hf)
    theirs = hf.model.layers[0].mlp.gate
    moe = MoeConfig(theirs.num_experts, theirs.top_k, 32, norm_topk_prob=theirs.norm_topk_prob)
    ours = Router(moe, theirs.hidden_dim)
    ours.weight = theirs.weight
    x = torch.randn(37, theirs.hidden_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        probs, their_weights, their_experts = theirs(x)
        assert torch.equal(probs[:, 0::2], probs[:, 1::2])  # the ties are exact
        weights, experts = ours(x)
        alone = torch.cat([ours(x[i : i + 1])[1] for i in range(len(x))])
    assert torch.equal(experts, their_experts) and torch.equal(alone, experts)
    torch.testing.assert_close(weights, their_weights, atol=0, rtol=0)


def test_a_model_with_tied_router_scores_decodes_like_transformers(tmp_path, tiny_model_dir):
    hf = random_hf_model("qwen3-moe")
    tie_router_pairs(hf)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path)
    reference = [hf_greedy(hf, p) for p in PROMPTS]
    llm = LLM(str(tmp_path), dtype="float32", enable_prefix_caching=False, max_model_len=128, block_size=4)
    assert [greedy(llm, [p])[0] for p in PROMPTS] == reference
    assert greedy(llm, PROMPTS) == reference


@pytest.mark.parametrize("is_gpt_oss", [False, True], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("num_tokens", [3, 37])  # 3 tokens leave experts without rows
def test_grouped_experts_equal_the_loop_over_experts(is_gpt_oss, num_tokens):
    """The GPU path (one ``torch._grouped_mm`` per projection, the groups found on the device)
    against the loop over the active experts, run here on the CPU: the same bits."""
    torch.manual_seed(0)
    moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=32, is_gpt_oss=is_gpt_oss)
    block = SparseMoeBlock(moe, 64, TorchOps)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(num_tokens, 64)
    with torch.inference_mode():
        block.experts.grouped = False
        loop = block(x)
        block.experts.grouped = True
        grouped = block(x)
    assert torch.equal(grouped, loop)


def test_a_moe_model_on_grouped_experts_decodes_like_transformers(tmp_path, tiny_model_dir, monkeypatch):
    hf = random_hf_model("qwen3-moe")
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path)
    reference = [hf_greedy(hf, p) for p in PROMPTS]
    monkeypatch.setattr(Experts, "grouped", True)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=9)
    assert greedy(llm, PROMPTS) == reference


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])  # two checkpoint layouts: gate/up/down_proj, w1/w3/w2
def test_experts_weights_are_stacked_per_layer_at_load(tmp_path, tiny_model_dir, name):
    hf = random_hf_model(name)
    hf.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / file, tmp_path)
    model = load_model(str(tmp_path), dtype="float32").model
    state = hf.state_dict()
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            assert f"model.layers.{i}.mlp.gate_up_proj.weight" in model.state_dict()  # a dense layer
            continue
        torch.testing.assert_close(experts.gate_up_proj, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        torch.testing.assert_close(experts.down_proj, state[f"model.layers.{i}.mlp.experts.down_proj"])
    assert any(getattr(layer.mlp, "experts", None) is not None for layer in model.model.layers)


# attention semantics, against a dense per-token reference


def dense_attention(q, k_cache, v_cache, tables, context_lens, query_lens, block_size, window, sinks):
    """Each query token alone: keys i - window < j <= i of its sequence, read
    slot by slot, and the sink logit added to the softmax denominator."""
    out, row = [], 0
    for table, ctx, n in zip(tables, context_lens, query_lens, strict=True):
        slots = torch.tensor([table[j // block_size] * block_size + j % block_size for j in range(ctx)])
        keys, values = k_cache[slots], v_cache[slots]  # [ctx, KVH, D]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        for i in range(ctx - n, ctx):
            lo = 0 if window is None else max(0, i - window + 1)
            s = torch.einsum("hd,jhd->hj", q[row], keys[lo : i + 1]) / math.sqrt(q.shape[-1])
            m = s.max(-1, keepdim=True).values
            if sinks is not None:
                m = torch.maximum(m, sinks[:, None])
            p = (s - m).exp()
            denom = p.sum(-1, keepdim=True) + (0 if sinks is None else (sinks[:, None] - m).exp())
            out.append(torch.einsum("hj,jhd->hd", p / denom, values[lo : i + 1]))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 1, 6, 13])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_portable_attention_windows_and_sinks_follow_the_agreed_semantics(window, with_sinks):
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 4, 2, 16
    tables = [[5, 1, 7, 3, 9], [2, 8, 0], [4, 6]]
    context_lens, query_lens = [19, 10, 7], [1, 6, 7]  # a decode, a chunk over a cached prefix, a fresh prompt
    k_cache, v_cache = (torch.randn(10 * block_size, kv_heads, dim, generator=g) for _ in range(2))
    t = sum(query_lens)
    q = torch.randn(t, heads, dim, generator=g)
    k, v = (torch.randn(t, kv_heads, dim, generator=g) for _ in range(2))
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    meta = AttentionMetadata.build(tables, context_lens, query_lens, block_size, torch.device("cpu"))
    out = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, sliding_window=window, sinks=sinks)
    ref = dense_attention(q, k_cache, v_cache, tables, context_lens, query_lens, block_size, window, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # a fresh prompt alone takes the plain causal path without a window
    fresh = AttentionMetadata.build([[4, 6]], [7], [7], block_size, torch.device("cpu"))
    out = TorchPagedAttention().forward(
        q[-7:], k[-7:], v[-7:], k_cache, v_cache, fresh, sliding_window=window, sinks=sinks
    )
    ref = dense_attention(q[-7:], k_cache, v_cache, [[4, 6]], [7], [7], block_size, window, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# refusals


def test_an_unknown_architecture_is_refused_with_the_supported_list(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError) as refused:
        load_model(str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and "'FalconForCausalLM'" in message
    assert all(arch in message for arch in ARCHITECTURES)


@pytest.mark.parametrize(
    "change,refusal",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, r"quantized Hugging Face checkpoints \(mxfp4\)"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(tmp_path, tiny_model_dir, change, refusal):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=refusal) as refused:
        load_model(str(tmp_path))
    assert "\n" not in str(refused.value)
