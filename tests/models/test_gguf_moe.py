"""Mixture-of-experts GGUF files (Qwen3-MoE as ``qwen3moe``, Mixtral as
``llama`` with experts, GPT-OSS as ``gpt-oss`` with MXFP4 experts) written
the way llama.cpp's converter writes them, served through ``LLM``: greedy
tokens equal transformers' in float32 alone, batched and with chunked
prefill, on both attention backends. The experts are dequantized at load; the
other linear layers stay quantized with ``dtype="auto"``."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize
from support_gguf import byte_level_tokenizer_metadata, gguf_name, llama_cpp_permute, write_shape_metadata
from support_models import TINY_FAMILIES, TINY_GGUF_MOE_SIZES, greedy, hf_greedy, prompt_tokens

from atom_anyio import LLM, kernels
from atom_anyio.models.decoder import FULL, SLIDING
from atom_anyio.models.gguf_file import GGUF_ARCHITECTURES
from atom_anyio.models.loader import load_model
from atom_anyio.models.moe import MoeConfig
from atom_anyio.models.quant import QuantEmbedding, QuantLinear

Q = gguf.GGMLQuantizationType
SIZES = TINY_GGUF_MOE_SIZES
ARCH = {"qwen3moe": "qwen3moe", "mixtral": "llama", "gpt-oss": "gpt-oss"}  # what llama.cpp's converter writes
FAMILIES = {name: TINY_FAMILIES[f"{name}-gguf"] for name in ARCH}
PROMPTS = [prompt_tokens(23, seed=21), prompt_tokens(9, seed=22), prompt_tokens(31, seed=23)]
ENGINE = dict(max_model_len=128, block_size=4, enable_prefix_caching=False)


def random_hf_model(family: str) -> transformers.PreTrainedModel:
    """Seeded; norm weights random too, so a dropped q/k norm changes the logits."""
    config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**SIZES, **extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.2)
    return model


def write_moe_gguf(
    path, family: str, hf, qtype: str = "F32", expert_qtype: str | None = None, stacked: bool = True
) -> transformers.PreTrainedModel:
    """``hf`` as llama.cpp's converter writes it: the experts stacked per layer as
    ``ffn_{gate,up,down}_exps`` in ``expert_qtype`` (or, ``stacked=False``, one
    ``ffn_gate.E`` per expert as older files have them), routers, biases, sinks and
    norms in F32, every other 2-D tensor in ``qtype``, llama's q/k rows permuted.
    Returns a copy of ``hf`` with the weights a correct reader gets back
    (quantization applied)."""
    cfg, arch = hf.config, ARCH[family]
    kind, expert_kind = Q[qtype], Q[expert_qtype or qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, family, cfg)

    def add(name: str, w: np.ndarray, kind: gguf.GGMLQuantizationType = Q.F32) -> torch.Tensor:
        blocks = quantize(np.ascontiguousarray(w), kind)
        writer.add_tensor(name, blocks, raw_dtype=kind)
        return torch.from_numpy(dequantize(blocks, kind).copy())

    expected = {}
    for name, value in hf.state_dict().items():
        w, layer = value.numpy(), name.split(".")[2] if name.startswith("model.layers.") else None
        if ".mlp.experts." in name:
            expected[name] = add_experts(add, layer, name, w, expert_kind, stacked, family == "gpt-oss")
        elif m := re.search(r"\.mlp\.(gate|router)\.(weight|bias)$", name):
            expected[name] = add(f"blk.{layer}.ffn_gate_inp.{m[2]}", w)
        elif name.endswith("self_attn.sinks"):
            expected[name] = add(f"blk.{layer}.attn_sinks.weight", w)
        elif family == "gpt-oss" and "post_attention_layernorm" in name:
            expected[name] = add(f"blk.{layer}.post_attention_norm.weight", w)
        elif w.ndim == 1:
            expected[name] = add(gguf_name(name), w)
        else:  # blocks never straddle rows, so permuting rows commutes with quantizing
            expected[name] = torch.from_numpy(dequantize(quantize(w, kind), kind).copy())
            if arch == "llama" and ".q_proj." in name:
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif arch == "llama" and ".k_proj." in name:
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            add(gguf_name(name), w, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict(expected)
    return reference


def write_metadata(writer: gguf.GGUFWriter, family: str, cfg: transformers.PretrainedConfig) -> None:
    write_shape_metadata(writer, cfg)
    writer.add_expert_count(cfg.num_experts if family == "qwen3moe" else cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "gpt-oss":  # as the converter's GptOssModel writes them
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    byte_level_tokenizer_metadata(writer)


def add_experts(add, layer: str, name: str, w: np.ndarray, kind, stacked: bool, is_gpt_oss: bool) -> torch.Tensor:
    """One of the layer's expert tensors as the converter splits it; returns it as read back.
    Qwen3-MoE's and Mixtral's ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows),
    ``down_proj [E, H, I]``; GPT-OSS's ``[E, H, 2I]`` (``x @ W``, gate and up interleaved),
    ``[E, I, H]`` and biases."""
    part = name.rsplit(".", 1)[1]
    is_bias, suffix = part.endswith("_bias"), "bias" if part.endswith("_bias") else "weight"
    if is_gpt_oss and not is_bias:
        w = w.swapaxes(1, 2)
    if part.startswith("gate_up"):
        gate, up = (w[:, 0::2], w[:, 1::2]) if is_gpt_oss else np.split(w, 2, axis=1)
        gate, up = (
            experts(add, layer, p, x, suffix, Q.F32 if is_bias else kind, stacked)
            for p, x in [("gate", gate), ("up", up)]
        )
        out = torch.stack([gate, up], dim=2).flatten(1, 2) if is_gpt_oss else torch.cat([gate, up], dim=1)
    else:
        out = experts(add, layer, "down", w, suffix, Q.F32 if is_bias else kind, stacked)
    return out.mT.contiguous() if is_gpt_oss and not is_bias else out


def experts(add, layer: str, part: str, w: np.ndarray, suffix: str, kind, stacked: bool) -> torch.Tensor:
    if stacked:
        return add(f"blk.{layer}.ffn_{part}_exps.{suffix}", w, kind)
    return torch.stack([add(f"blk.{layer}.ffn_{part}.{e}.{suffix}", w[e], kind) for e in range(len(w))])


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_gguf(request, tmp_path_factory):
    """qwen3moe in F32, Mixtral's 2-D tensors in F16 (the converter's ``--outtype f16``),
    GPT-OSS's experts in MXFP4 (as its GGUFs ship them), the rest in F32."""
    family = request.param
    path = tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf"
    qtype, expert_qtype = {"qwen3moe": ("F32", None), "mixtral": ("F16", None), "gpt-oss": ("F32", "MXFP4")}[family]
    reference = write_moe_gguf(path, family, random_hf_model(family), qtype, expert_qtype)
    return family, path, reference, [hf_greedy(reference, p) for p in PROMPTS]


def test_moe_gguf_config_follows_llama_cpp(moe_gguf):
    family, path, _, _ = moe_gguf
    cfg = load_model(str(path), dtype="float32").config
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if family == "qwen3moe":
        assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm and cfg.head_dim == 16
        assert cfg.moe == MoeConfig(num_experts=8, top_k=3, intermediate_size=32, norm_topk_prob=True)
    elif family == "mixtral":
        assert cfg.architecture == "MixtralForCausalLM" and not cfg.qk_norm
        assert cfg.moe == MoeConfig(num_experts=4, top_k=2, intermediate_size=96, norm_topk_prob=True)
    else:
        assert cfg.architecture == "GptOssForCausalLM" and cfg.attention_sinks and cfg.o_proj_bias
        assert cfg.moe.is_gpt_oss and (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 7.0)
        assert (cfg.sliding_window, cfg.layer_types) == (7, (SLIDING, FULL))
        assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["original_max_position_embeddings"] == 16
    if family != "gpt-oss":
        assert cfg.sliding_window is None and cfg.rope_scaling is None


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_moe_gguf_greedy_equals_transformers_alone_batched_and_chunked(moe_gguf, backend):
    _, path, _, expected = moe_gguf
    loaded = load_model(str(path), dtype="float32", attention_backend=backend)
    assert [greedy(LLM(loaded, **ENGINE), [p])[0] for p in PROMPTS] == expected
    assert greedy(LLM(loaded, **ENGINE), PROMPTS) == expected
    assert greedy(LLM(loaded, max_num_batched_tokens=9, **ENGINE), PROMPTS) == expected
    assert len({t for out in expected for t in out}) > 5  # varied output, not one repeated token


def test_the_gpt_oss_reference_depends_on_its_window_and_yarn():
    """Guards the exactness test: GPT-OSS without its window, or without YaRN,
    would produce other tokens on these prompts."""
    hf = random_hf_model("gpt-oss")
    reference = hf_greedy(hf, PROMPTS[2])
    settings = hf.config.to_dict()
    no_window = {**settings, "sliding_window": 10_000, "layer_types": ["full_attention"] * hf.config.num_hidden_layers}
    no_yarn = {**settings, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}
    for changed in (no_window, no_yarn):
        plain = type(hf)(type(hf.config)(**changed)).eval()
        plain.load_state_dict(hf.state_dict())
        assert hf_greedy(plain, PROMPTS[2]) != reference


def test_per_expert_tensors_of_older_mixtral_files_load_like_stacked_ones(tmp_path):
    hf = random_hf_model("mixtral")
    write_moe_gguf(tmp_path / "stacked.gguf", "mixtral", hf)
    write_moe_gguf(tmp_path / "per-expert.gguf", "mixtral", hf, stacked=False)
    assert "blk.1.ffn_down.3.weight" in {t.name for t in gguf.GGUFReader(tmp_path / "per-expert.gguf").tensors}
    stacked = load_model(str(tmp_path / "stacked.gguf"), dtype="float32").model.state_dict()
    per_expert = load_model(str(tmp_path / "per-expert.gguf"), dtype="float32").model.state_dict()
    assert stacked.keys() == per_expert.keys() and "model.layers.1.mlp.experts.gate_up_proj" in stacked
    assert all(torch.equal(stacked[k], per_expert[k]) for k in stacked)
    torch.testing.assert_close(
        stacked["model.layers.1.mlp.experts.gate_up_proj"], hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    )


@pytest.fixture(scope="module")
def q8_0_moe_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "tiny-qwen3moe.Q8_0.gguf"
    reference = write_moe_gguf(path, "qwen3moe", random_hf_model("qwen3moe"), "Q8_0")
    return path, [hf_greedy(reference, p) for p in PROMPTS]


def test_q8_0_moe_gguf_keeps_attention_quantized_and_dequantizes_the_experts(q8_0_moe_gguf):
    path, expected = q8_0_moe_gguf
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    # float32 activations, blocks packed (auto on an AVX2 CPU): greedy equal to transformers' in float32
    loaded = load_model(str(path), dtype="float32", attention_backend="torch", gguf_weights="packed")
    model, dtype = loaded.model, loaded.model.model.norm.weight.dtype
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.self_attn.o_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    experts = layer.mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == layer.mlp.gate.weight.dtype == dtype
    assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)
    assert greedy(LLM(loaded, **ENGINE), PROMPTS) == expected  # the torch ops dequantize to the same bits
    if kernels.load_cpu_kernels() is None:
        cpu = load_model(str(path), dtype="float32", attention_backend="cpu", gguf_weights="packed")
        assert greedy(LLM(cpu, **ENGINE), PROMPTS) == expected
    chunked = LLM(load_model(str(path), dtype="float32"), max_num_batched_tokens=9, **ENGINE)
    assert greedy(chunked, PROMPTS) == expected


# refusals


def write_metadata_only(path, arch: str, tensors=(), **metadata: int | float | str) -> None:
    """A GGUF with ``arch.key`` metadata, the tokenizer, an embedding and ``tensors``
    (``(name, raw bytes, type)``): enough to reach the config and those tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    value_types = {int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    for key, value in metadata.items():
        writer.add_key_value(f"{arch}.{key}", value, value_types[type(value)])
    byte_level_tokenizer_metadata(writer)
    writer.add_tensor("token_embd.weight", np.zeros((262, 128), np.float32))
    for name, data, kind in tensors:
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unknown_gguf_architecture_is_refused_in_one_line_listing_the_supported_ones(tmp_path):
    write_metadata_only(tmp_path / "deepseek2.gguf", "deepseek2", expert_count=4)
    with pytest.raises(ValueError) as refused:
        load_model(str(tmp_path / "deepseek2.gguf"))
    message = str(refused.value)
    assert "\n" not in message and "'deepseek2'" in message
    assert all(arch in message for arch in GGUF_ARCHITECTURES) and "qwen3moe" in message


def test_a_qwen3moe_gguf_without_an_expert_count_is_refused_in_one_line(tmp_path):
    write_metadata_only(tmp_path / "no-experts.gguf", "qwen3moe", expert_used_count=2, feed_forward_length=96)
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_count") as refused:
        load_model(str(tmp_path / "no-experts.gguf"))
    assert "\n" not in str(refused.value)


def test_experts_of_a_type_gguf_cannot_dequantize_are_refused_in_one_line_naming_it(tmp_path):
    weights, size = gguf.GGML_QUANT_SIZES[Q.Q1_0]  # no dequantizer in the gguf package
    blocks = np.zeros((4, 32, 128 // weights * size), np.uint8)  # [E, I, H / block weights * block bytes]
    experts = [(f"blk.0.ffn_{p}_exps.weight", blocks, Q.Q1_0) for p in ("gate", "up", "down")]
    metadata = {"block_count": 1, "embedding_length": 128, "attention.head_count": 4, "feed_forward_length": 32}
    write_metadata_only(tmp_path / "q1.gguf", "qwen3moe", experts, expert_count=4, expert_used_count=2, **metadata)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_exps\.weight is Q1_0") as refused:
        load_model(str(tmp_path / "q1.gguf"))
    assert "\n" not in str(refused.value)


def test_yarn_with_an_attention_factor_is_refused_in_one_line(tmp_path):
    metadata = {"block_count": 1, "embedding_length": 128, "attention.head_count": 4, "feed_forward_length": 32}
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_attn_factor": 0.5}
    write_metadata_only(tmp_path / "yarn.gguf", "qwen3", **metadata, **yarn)
    with pytest.raises(ValueError, match=r"rope\.scaling\.yarn_attn_factor 0\.5 is not supported") as refused:
        load_model(str(tmp_path / "yarn.gguf"))
    assert "\n" not in str(refused.value)
