"""GGUF files as llama.cpp's converter writes them, and quantized blocks, for the tests of
tests/models: the tensor names and row order, the shape and tokenizer metadata, a quantizer
for the K-quants (gguf has none), random quantized weights and tiny quantized Llamas."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers
from gguf.quants import dequantize, quantize
from support_models import BYTE_LEVEL_VOCAB, TINY_SIZES
from transformers.convert_slow_tokenizer import bytes_to_unicode

from atom_anyio.models.quant import QuantizedWeight

Q = gguf.GGMLQuantizationType
QTYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]  # the block types with a CPU GEMV
K_QUANTS = [Q.Q4_K, Q.Q6_K]  # super-blocks of 256

GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{kind}"
    return f"{GGUF_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_shape_metadata(writer: gguf.GGUFWriter, cfg: transformers.PretrainedConfig) -> None:
    """The shape, RoPE base and norm epsilon of ``cfg`` as llama.cpp's converter writes them."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def byte_level_tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    """A 262-token GPT-2 style vocabulary: the 256 byte symbols, two merges' worth
    of words, and the ChatML control tokens."""
    symbols = list(bytes_to_unicode().values())
    tokens = [*symbols, "he", "ll", "hell", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 259 + [3, 3, 3])
    writer.add_token_merges(["h e", "l l", "he ll"])
    writer.add_bos_token_id(260)
    writer.add_eos_token_id(259)
    writer.add_eot_token_id(261)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")


def quantize_k(w: np.ndarray, qtype: Q) -> np.ndarray:
    """A plain round-to-nearest Q4_K / Q6_K quantizer (ggml-quants.c's layouts, not its search for scales)."""
    rows, k = w.shape
    sb = w.reshape(-1, 256).astype(np.float32)
    if qtype == Q.Q6_K:
        scale = np.abs(sb.reshape(-1, 16, 16)).max(-1) / 31
        d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
        sc = np.round(scale / np.maximum(d.astype(np.float32), 1e-30)).astype(np.int8)
        step = (d.astype(np.float32) * sc).repeat(16, axis=1)
        q = (np.clip(np.round(sb / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
        ql = (q[..., :64] & 0x0F) | (q[..., 64:] & 0x0F) << 4
        qh = sum(((q.reshape(-1, 2, 4, 32)[:, :, t] >> 4) & 3) << (2 * t) for t in range(4))
        parts = [ql.reshape(-1, 128), qh.astype(np.uint8).reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8)]
    else:
        sub = sb.reshape(-1, 8, 32)
        mn = np.maximum(-sub.min(-1), 0)
        scale = (sub.max(-1) + mn) / 15
        d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
        dmin = (mn.max(-1, keepdims=True) / 63).astype(np.float16)
        isc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
        imn = np.clip(np.round(mn / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
        step = (d.astype(np.float32) * isc)[..., None]
        offset = (dmin.astype(np.float32) * imn)[..., None]
        q = np.clip(np.round((sub + offset) / np.where(step == 0, 1, step)), 0, 15).astype(np.uint8)
        scales = np.concatenate(
            [
                isc[:, :4] | (isc[:, 4:] >> 4) << 6,
                imn[:, :4] | (imn[:, 4:] >> 4) << 6,
                (isc[:, 4:] & 0x0F) | (imn[:, 4:] & 0x0F) << 4,
            ],
            axis=1,
        )
        qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)
        parts = [d.view(np.uint8), dmin.view(np.uint8), scales, qs]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def quantize_blocks(w: np.ndarray, kind: Q) -> np.ndarray:
    """gguf's quantizer, or ``quantize_k`` for the K-quants."""
    return quantize_k(w, kind) if kind in K_QUANTS else quantize(w, kind)


def write_gguf(path, arch: str, hf: transformers.PreTrainedModel, qtype: str, metadata=None) -> dict[str, torch.Tensor]:
    """Write ``hf`` as a GGUF with 2-D weights in ``qtype``; returns the weights
    a correct reader gets back (HF names and row order, quantization applied)."""
    cfg, kind = hf.config, gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape_metadata(writer, cfg)
    for write in metadata or []:
        write(writer)
    expected = {}
    for name, value in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.numpy()
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
            expected[name] = value
            continue
        # blocks never straddle rows, so permuting rows commutes with quantizing
        expected[name] = torch.from_numpy(dequantize(quantize_blocks(w, kind), kind).copy())
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name(name), quantize_blocks(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def random_quantized(n: int, k: int, qtype: Q, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random weights quantized by gguf (``quantize_k`` for the K-quants), and gguf's own dequantization
    of them."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    blocks = quantize_blocks(w, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
    return QuantizedWeight(torch.from_numpy(blocks.copy()), qtype, torch.Size((n, k))), reference


def tiny_chat_ggufs(root, qtypes, **sizes: int) -> dict:
    """A seeded tiny Llama with the byte-level ChatML tokenizer, one GGUF per type under ``root``;
    ``sizes`` override ``TINY_SIZES``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_SIZES, **BYTE_LEVEL_VOCAB, "num_key_value_heads": 2, **sizes})
    config.initializer_range = 0.2
    hf = transformers.LlamaForCausalLM(config).eval()
    paths = {}
    for qtype in qtypes:
        paths[qtype] = root / f"tiny.{qtype.name}.gguf"
        write_gguf(paths[qtype], "llama", hf, qtype.name, metadata=[byte_level_tokenizer_metadata])
    return paths


def tiny_wide_ggufs(root, qtypes) -> dict:
    """The tiny chat Llama 256 wide (K-quant rows are multiples of 256), one GGUF per type."""
    return tiny_chat_ggufs(root, qtypes, hidden_size=256, intermediate_size=512)
