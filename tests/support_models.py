"""Tiny seeded transformers models of the architectures beyond the dense Llama family
(``TINY_ARCH_SIZES``), random prompts for them, and greedy decoding on both sides: transformers'
``generate`` and ``LLM``, ``max_tokens`` each, past any EOS."""

from __future__ import annotations

import torch
import transformers
from support import TINY_ARCH_SIZES, TINY_FAMILIES

from atom_anyio import LLM, SamplingParams

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
