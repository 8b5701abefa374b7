"""``hf_overrides`` (vLLM's ``--hf-overrides``): keys merged into a model's config, so that a model can be
served past its trained context with YaRN (issue 40: SmolLM2 at 32k for the agent CLIs' long prompts)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from atom_anyio import LLM, SamplingParams
from atom_anyio.config import Config
from atom_anyio.models.gguf_file import read_gguf
from atom_anyio.models.loader import load_model
from atom_anyio.settings import ConfigError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(40)] for i in range(2)]  # past the original 32 positions


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_model_dir):
    """A tiny Llama trained (so to speak) for 32 positions; its tokenizer borrowed from the suite's tiny model."""
    config = transformers.LlamaConfig(**TINY, num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-32")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tiny_model_dir / name).read_bytes())
    return path


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def transformers_greedy(path, rope: dict | None = None, **overrides) -> list[list[int]]:
    config = transformers.AutoConfig.from_pretrained(path, **overrides)
    if rope is not None:  # transformers 5 keeps the theta inside the RoPE parameters
        config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **rope}
    model = transformers.LlamaForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def test_yarn_from_hf_overrides_serves_the_longer_context_as_transformers_does(tiny_dir):
    overrides = {"rope_scaling": YARN, "max_position_embeddings": 128}
    loaded = load_model(str(tiny_dir), dtype="float32", hf_overrides=overrides)
    assert loaded.config.max_position_embeddings == 128
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    llm = LLM(loaded, num_kv_blocks=64)
    assert llm.engine.max_model_len == 128  # the context follows the overridden config
    expected = transformers_greedy(tiny_dir, rope=YARN, max_position_embeddings=128)
    assert greedy(llm) == expected
    plain = transformers_greedy(tiny_dir)
    assert plain != expected  # the override changed the model, so the comparison above means something


def test_gguf_takes_hugging_face_keys_and_its_own_metadata_keys(smollm2_path):
    cfg, _, _ = read_gguf(smollm2_path, keep_quantized=True)
    assert (cfg.max_position_embeddings, cfg.rope_scaling) == (8192, None)
    stretched, _, _ = read_gguf(
        smollm2_path,
        keep_quantized=True,
        overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 32768},
    )
    assert stretched.max_position_embeddings == 32768
    # as transformers standardises it: the original context defaults to max_position_embeddings (here overridden)
    assert stretched.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert stretched.rope_theta == cfg.rope_theta
    by_metadata, _, _ = read_gguf(smollm2_path, keep_quantized=True, overrides={"llama.context_length": 16384})
    assert by_metadata.max_position_embeddings == 16384
    with pytest.raises(ValueError, match="hf_overrides: hidden_size cannot override a GGUF's config"):
        read_gguf(smollm2_path, keep_quantized=True, overrides={"hidden_size": 1024})


def test_a_bad_hf_overrides_setting_is_one_line_naming_it():
    assert Config.from_env({"ATOM_HF_OVERRIDES": json.dumps({"max_position_embeddings": 32768})}).hf_overrides == {
        "max_position_embeddings": 32768
    }
    with pytest.raises(ConfigError, match="ATOM_HF_OVERRIDES"):
        Config.from_env({"ATOM_HF_OVERRIDES": "{not json"})
