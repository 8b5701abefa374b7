"""GGUF files: a model's config, its tensors under Hugging Face names (kept as
``QuantizedWeight`` blocks or dequantized with the ``gguf`` package, llama's q/k
un-permuted, experts stacked) and its tokenizer, converted once and cached on disk."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from atom_anyio.models import quant
from atom_anyio.models.decoder import FULL, SLIDING, ModelConfig, with_hf_overrides
from atom_anyio.models.moe import MoeConfig

StateDict = dict[str, torch.Tensor]
# a `llama` GGUF with experts is Mixtral (llama.cpp's converter writes it so)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router
    "post_attention_norm": "post_attention_layernorm",  # GPT-OSS's name for ffn_norm
}
GGUF_LAYER_PARAMETERS = {"attn_sinks": "self_attn.sinks"}  # a parameter, not a module's weight
# llama.cpp's experts, stacked per layer: gate and up [E, I, H], down [E, H, I] (numpy order); biases [E, I], [E, H]
GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
GGUF_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")  # older files: one tensor per expert
# parsed only when the tokenizer is converted (reading them as Python values takes seconds)
GGUF_TOKENIZER_ARRAYS = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
}
GGUF_ROPE_FREQS = "rope_freqs.weight"  # read into the config, not a weight
# kept quantized: the embedding, the LM head and the linear layers
GGUF_QUANTIZED_LAYERS = re.compile(
    r"(token_embd|output|blk\.\d+\.(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down))\.weight"
)
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` reading each header value from a plain ndarray view of its memory map.
    The reader slices the map once or twice per array element, and a slice of a ``np.memmap`` is
    a memmap whose set-up costs several times a plain view's: SmolLM2's 147k tokenizer entries took
    2.4 s of its 4.5 s load, 0.8 s this way. The fields and tensors are the same arrays' values
    (tests/models/test_quant.py compares them), viewing the same mapping."""

    _itemsizes: dict[Any, int] = {}

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        itemsize = self._itemsizes.get(dtype) or self._itemsizes.setdefault(dtype, np.dtype(dtype).itemsize)
        count = int(count)
        arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def load_gguf_weights(path: str) -> tuple[ModelConfig, StateDict]:
    """Config and dequantized float32 weights (HF names, q/k un-permuted) of a GGUF file."""
    cfg, state, _ = read_gguf(path)
    return cfg, state


def read_gguf(
    path: str,
    keep_quantized: bool = False,
    dtype: torch.dtype = torch.float32,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, StateDict, dict[str, Any]]:
    """Config, weights and metadata; ``keep_quantized``: the linear layers' and the
    embedding's tensors of the types in ``quant.BLOCKS`` as ``QuantizedWeight``s.
    Stacked experts are always dequantized, to ``dtype``. ``overrides``: metadata keys
    (``llama.context_length``) replace the file's, then Hugging Face config keys apply
    (``with_hf_overrides``)."""
    reader = GGUFReader(path)
    metadata = {k: field.contents() for k, field in reader.fields.items() if k not in GGUF_TOKENIZER_ARRAYS}
    metadata |= {k: v for k, v in (overrides or {}).items() if "." in k}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensors = {t.name: t for t in reader.tensors}
    cfg = gguf_config(metadata, tensors, num_tokens=len(tokens.data) if tokens else None)
    cfg = with_hf_overrides(cfg, {k: v for k, v in (overrides or {}).items() if "." not in k})
    experts = {name: t for name, t in tensors.items() if GGUF_EXPERTS.fullmatch(name)}
    state = {
        hf_name(name): gguf_tensor(t, keep_quantized)
        for name, t in tensors.items()
        if name != GGUF_ROPE_FREQS and name not in experts
    }
    state |= gguf_experts(experts, dtype, is_gpt_oss=cfg.moe is not None and cfg.moe.is_gpt_oss)
    if metadata["general.architecture"] == "llama":
        state = unpermute_llama_qk(state, cfg)
    return cfg, state, metadata


def gguf_config(metadata: dict[str, Any], tensors: dict[str, Any], *, num_tokens: int | None) -> ModelConfig:
    arch = metadata["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})")
    get = lambda key, default=None: metadata.get(f"{arch}.{key}", default)  # noqa: E731
    heads, hidden = get("attention.head_count"), get("embedding_length")
    moe = gguf_moe(arch, get)
    eos = [
        metadata[f"tokenizer.ggml.{k}"]
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if f"tokenizer.ggml.{k}" in metadata
    ]
    return ModelConfig(
        vocab_size=num_tokens or get("vocab_size") or int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(get),
        rope_freq_factors=gguf_rope_freq_factors(tensors.get(GGUF_ROPE_FREQS)),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **gguf_sliding_window(arch, get),
        moe=moe,
        attention_sinks="blk.0.attn_sinks.weight" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        architecture="MixtralForCausalLM" if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
    )


def gguf_moe(arch: str, get: Any) -> MoeConfig | None:
    """llama.cpp's experts: every layer routed. Its Qwen3-MoE and Mixtral
    (``llama`` with ``expert_count``) graphs take a softmax, then the top k,
    always renormalised; GPT-OSS's has biases, a softmax over the top k logits
    and the clamped SwiGLU with llama.cpp's fixed alpha 1.702 and limit 7."""
    num_experts, top_k, ffn = get("expert_count", 0), get("expert_used_count", 0), get("feed_forward_length")
    if not num_experts and arch not in ("qwen3moe", "gpt-oss"):  # dense (llama: Mixtral when it has experts)
        return None
    if not (num_experts and top_k):
        raise ValueError(f"{arch} GGUF needs {arch}.expert_count and {arch}.expert_used_count above 0")
    size = get("expert_feed_forward_length") or (ffn // top_k if arch == "qwen3moe" else ffn)
    return MoeConfig(
        num_experts=num_experts, top_k=top_k, intermediate_size=size, norm_topk_prob=True, is_gpt_oss=arch == "gpt-oss"
    )


def gguf_sliding_window(arch: str, get: Any) -> dict[str, Any]:
    """llama.cpp windows only GPT-OSS among these: every other layer, the first
    windowed (``set_swa_pattern(2)``); it ignores any window a Mistral-family file names."""
    window = get("attention.sliding_window") if arch == "gpt-oss" else None
    if not window:
        return {"sliding_window": None, "layer_types": ()}
    types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(get("block_count")))
    return {"sliding_window": int(window), "layer_types": types}


def gguf_rope_scaling(get: Any) -> dict[str, Any] | None:
    """``rope.scaling``: linear, or YaRN as llama.cpp computes it (its
    correction range truncated to whole dimensions, cos/sin scaled by
    ``0.1 ln(factor) + 1``; transformers reads GGUFs the same way)."""
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        defaults = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}
        for key, default in defaults.items():
            if get(f"rope.scaling.{key}", default) != default:
                raise ValueError(f"GGUF YaRN with rope.scaling.{key} {get(f'rope.scaling.{key}')} is not supported")
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(
                get("rope.scaling.original_context_length") or get("context_length", 2048)
            ),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": True,
        }
    raise ValueError(f"unsupported GGUF rope scaling {kind!r} (supported: none, linear, yarn)")


def gguf_rope_freq_factors(tensor: gguf.ReaderTensor | None) -> tuple[float, ...] | None:
    """``rope_freqs``: llama.cpp's converter writes Llama 3.1's rope scaling as one
    factor per frequency (``theta_i / factor_i``)."""
    return None if tensor is None else tuple(float(f) for f in dequantize(tensor).reshape(-1))


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name):
        layer, part, kind = m.groups()
        if part in GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{kind}"
        if part in GGUF_LAYER_PARAMETERS:
            return f"model.layers.{layer}.{GGUF_LAYER_PARAMETERS[part]}"
    elif m := GGUF_EXPERT.fullmatch(gguf_name):  # stacked at build time (moe.stack_experts)
        layer, part, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    elif (m := re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)) and m[1] in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[m[1]]}.{m[2]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def gguf_experts(tensors: dict[str, gguf.ReaderTensor], dtype: torch.dtype, *, is_gpt_oss: bool) -> StateDict:
    """The stacked ``ffn_{gate,up,down}_exps`` in ``dtype``, in the Hugging Face
    layout: ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
    ``experts.down_proj [E, H, I]``; GPT-OSS's ``[E, H, 2I]`` with gate and up
    interleaved, ``[E, I, H]`` and their biases (``moe.stack_experts`` turns those
    into the model's layout). Dequantized one tensor at a time: there are no
    quantized expert GEMMs, so the experts take their float size in memory."""
    parts: dict[str, dict[tuple[str, str], gguf.ReaderTensor]] = defaultdict(dict)
    for name, tensor in tensors.items():
        m = GGUF_EXPERTS.fullmatch(name)
        parts[m[1]][m[2], m[3]] = tensor
    kinds = ("weight", "bias") if is_gpt_oss else ("weight",)
    state = {}
    for layer, by_part in parts.items():
        names = [(p, k) for k in kinds for p in ("gate", "up", "down")]
        if missing := [f"blk.{layer}.ffn_{p}_exps.{k}" for p, k in names if (p, k) not in by_part]:
            raise ValueError(f"GGUF expert tensors missing: {missing}")
        prefix = f"model.layers.{layer}.mlp.experts"
        for kind in kinds:
            gate, up, down = (dequantize(by_part[p, kind]).to(dtype) for p in ("gate", "up", "down"))
            if not is_gpt_oss:
                state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"] = torch.cat([gate, up], dim=1), down
                continue
            gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)  # gate 0, up 0, gate 1, ...
            if kind == "bias":
                state[f"{prefix}.gate_up_proj_bias"], state[f"{prefix}.down_proj_bias"] = gate_up, down
            else:
                state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"] = gate_up.mT, down.mT
    return state


def gguf_tensor(tensor: gguf.ReaderTensor, keep_quantized: bool) -> torch.Tensor | quant.QuantizedWeight:
    is_layer = GGUF_QUANTIZED_LAYERS.fullmatch(tensor.name) and len(tensor.shape) == 2
    if not (keep_quantized and is_layer and tensor.tensor_type in quant.BLOCKS):
        return dequantize(tensor)
    shape = torch.Size(int(d) for d in reversed(tensor.shape))
    return quant.QuantizedWeight(torch.from_numpy(np.array(tensor.data)), tensor.tensor_type, shape)


def dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, a type the gguf package cannot dequantize"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]).reshape(shape))


def unpermute_llama_qk(state: StateDict, cfg: ModelConfig) -> StateDict:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; the model rotates halves."""
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    pattern = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj)\.(weight|bias)")
    return {k: unpermute_rope_rows(w, heads[m[1]]) if (m := pattern.fullmatch(k)) else w for k, w in state.items()}


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute`` of q/k projection rows."""
    order = torch.arange(w.shape[0]).reshape(n_head, w.shape[0] // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
    return w.index_select(0, order)


def load_gguf_tokenizer(path: str, architecture: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF describes, converted once (seconds) and then loaded from the on-disk cache.
    ``AutoTokenizer`` also reads the file's model config, which transformers fails to do for
    GPT-OSS (its ``rope.scaling`` keys); its tokenizer class is the generic one, built directly."""
    stat = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir() / "tokenizers" / key
    if not cached.is_dir():
        tokenizer_class = PreTrainedTokenizerFast if architecture == "gpt-oss" else AutoTokenizer
        tokenizer = tokenizer_class.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=f".{key}.")
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(cached))


def cache_dir() -> Path:
    return Path(os.environ.get("ATOM_CACHE_DIR") or Path.home() / ".cache" / "atom_anyio")
