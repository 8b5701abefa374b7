"""The tiny models of the suite: the seeded random Llama the engine and API tests serve, the one
table of tiny model families the model tests select from (``TINY_FAMILIES``) with their sizes, the
CPU combinations and how greedy outputs compare under them, and greedy decoding on both sides for
the architectures beyond the dense Llama family: transformers' ``generate`` and ``LLM``,
``max_tokens`` each, past any EOS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from atom_anyio import LLM, SamplingParams

# the tiny model's own byte-level BPE (8,192 tokens) with SmolLM2's special tokens, ids and chat
# template; tiny_tokenizer/build.py regenerates it
TINY_TOKENIZER = Path(__file__).parent / "tiny_tokenizer"
TINY_VOCAB_SIZE = len(transformers.AutoTokenizer.from_pretrained(TINY_TOKENIZER))  # the tiny Llama's too

# words of the random prompts the engine tests mix (lengths and content vary with the seed)
WORDS = [
    "the",
    "a",
    "river",
    "stone",
    "cloud",
    "seven",
    "blue",
    "quickly",
    "runs",
    "over",
    "under",
    "bright",
    "engine",
    "token",
    "paged",
]


def write_tiny_llama(path, seed: int = 0, tokenizer: Any = None, **config: object):
    """A 2-layer random Llama (seeded) in HF format with ``tokenizer`` (a transformers tokenizer,
    its chat template included; default ``TINY_TOKENIZER``); ``config`` overrides."""
    tokenizer = tokenizer or transformers.AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    defaults = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.2,
    }
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**defaults, **config})).save_pretrained(
        path, safe_serialization=True
    )
    tokenizer.save_pretrained(path)
    return path


# tiny model families: the one table test_models, test_models_arch and test_gguf_moe select from

# the dense families of test_models (each family sets its own KV heads)
TINY_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
# the architectures of test_models_arch: three layers, so windowed and full or dense and sparse layers mix
TINY_ARCH_SIZES = {
    **TINY_SIZES,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}
BYTE_LEVEL_VOCAB = dict(vocab_size=262)  # support_gguf.byte_level_tokenizer_metadata's vocabulary
# the MoE GGUFs of test_gguf_moe: the byte-level GGUF tokenizer's vocabulary, two layers
TINY_GGUF_MOE_SIZES = {**TINY_ARCH_SIZES, **BYTE_LEVEL_VOCAB, "num_hidden_layers": 2}
TINY_WINDOW = 7
TINY_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)
TINY_FAMILIES: dict[str, tuple[type, dict]] = {
    # test_models, on TINY_SIZES
    # grouped-query attention (2 KV heads of 4), an untied head, plain RoPE
    "llama": (transformers.LlamaConfig, dict(num_key_value_heads=2)),
    # Llama 3 rope scaling
    "llama3-rope": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,  # wavelengths fall in all three llama3 bands
            ),
        ),
    ),
    # q/k/v biases, the head tied to the embedding
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k norms, a head_dim (32) other than hidden_size / heads (16)
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=32)),
    # one KV head for all four query heads, another RoPE base
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=1, rope_parameters=dict(rope_theta=1e6))),
    # test_models_arch, on TINY_ARCH_SIZES
    # a sliding window on every layer
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=TINY_WINDOW)),
    # layer 0 full, layers 1 and 2 windowed
    "qwen2-window": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1),
    ),
    # YaRN with q/k norms and a wider head_dim
    "qwen3-yarn": (transformers.Qwen3Config, dict(head_dim=32, rope_parameters=TINY_YARN)),
    # YaRN with mscale and mscale_all_dim (the attention factor) and another beta_fast
    "llama-yarn-mscale": (
        transformers.LlamaConfig,
        dict(rope_parameters={**TINY_YARN, "factor": 8.0, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16}),
    ),
    # layer 1 dense (mlp_only_layers), a window on every layer (Qwen3-MoE's rule)
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=TINY_WINDOW,
        ),
    ),
    # every second layer sparse, top-k renormalised, YaRN
    "qwen3-moe-norm-yarn": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            rope_parameters=TINY_YARN,
        ),
    ),
    # top 2 of 4 experts on every layer, a window on every layer
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW),
    ),
    # sinks, windowed and full layers alternating, YaRN without truncation, biased experts and clamped SwiGLU
    "gpt-oss": (
        transformers.GptOssConfig,
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_WINDOW,
            swiglu_limit=1.0,  # the clamps bind at this scale
            rope_parameters={**TINY_YARN, "rope_theta": 150000.0, "truncate": False, "beta_fast": 8.0},
        ),
    ),
    # test_gguf_moe, on TINY_GGUF_MOE_SIZES, as llama.cpp runs them: every layer routed;
    # Qwen3-MoE and Mixtral renormalise the top k and have no window
    # top 3 of 8 experts renormalised, q/k norms
    "qwen3moe-gguf": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # top 2 of 4 experts, written as GGUF ``llama`` with experts (q/k rows permuted)
    "mixtral-gguf": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    # windowed and full layers alternating, sinks, biases; YaRN as a GGUF carries it (llama.cpp truncates)
    "gpt-oss-gguf": (
        transformers.GptOssConfig,
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_WINDOW,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=True,
            ),
        ),
    ),
}


def tiny_families(*names: str) -> dict[str, tuple[type, dict]]:
    """The named families of ``TINY_FAMILIES``, in that order (a module's parametrized ids)."""
    return {name: TINY_FAMILIES[name] for name in names}


# what `auto` picks on some CPU, each forced: (dtype, gguf_weights). The suite runs every one on
# whatever CPU it is on (bfloat16 is slow on an AVX2-only CPU, not wrong).
CPU_COMBINATIONS = {
    "float32+both": ("float32", "both"),  # auto on AVX2 CPUs: blocks (the fused decoder's GEMV) and a dense copy
    "float32+packed": ("float32", "packed"),  # auto there when the dense copy does not fit
    "bfloat16+both": ("bfloat16", "both"),  # auto on AVX512-BF16 / AMX CPUs: blocks and a dense copy
    "bfloat16+packed": ("bfloat16", "packed"),  # auto there when the dense copy does not fit
    "float32+dequantize": ("float32", "dequantize"),
    "bfloat16+dequantize": ("bfloat16", "dequantize"),
}


def assert_greedy_close(outputs: list[list[Any]], reference: list[list[Any]]) -> None:
    """Greedy token lists compared the standard way for low precision: equal, or where they first
    diverge, each side's token is among the other's top logprobs there (then the rest is not
    compared). Each item is a ``CompletionOutput`` sampled with ``logprobs`` > 0."""
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        for j, (a, b) in enumerate(zip(out.logprobs, ref.logprobs, strict=False)):
            if a.token_id == b.token_id:
                continue
            assert a.token_id in dict(b.top), f"sequence {i} token {j}: {a.token_id} not in the reference's top {b.top}"
            assert b.token_id in dict(a.top), f"sequence {i} token {j}: {b.token_id} not in this run's top {a.top}"
            break
        else:
            assert len(out.token_ids) == len(ref.token_ids), f"sequence {i}: lengths differ"


# greedy decoding of the architectures of test_models_arch, on both sides

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def random_hf_model(family: str) -> transformers.PreTrainedModel:
    """``TINY_FAMILIES[family]`` on ``TINY_ARCH_SIZES``, seeded; norm weights and biases random
    too, so a dropped one changes the logits."""
    config_class, extra = TINY_FAMILIES[family]
    config = config_class(**{**TINY_ARCH_SIZES, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 2.0 if name.endswith("sinks") else 0.2)
    return model


def prompt_tokens(n: int, seed: int) -> list[int]:
    """``n`` seeded random ids of ``TINY_ARCH_SIZES``' vocabulary."""
    return torch.randint(0, TINY_ARCH_SIZES["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """``generate`` past any EOS without suppressing it (``min_new_tokens`` would), like ``ignore_eos``."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, use_tqdm=False)]
