"""The model's plan (models/plan.py): one function makes it from the settings, and the server,
``LLM`` and every tensor-parallel rank load the model as it says."""

from __future__ import annotations

import pytest
import torch

from atom_anyio.api.runtime import _load
from atom_anyio.config import Config
from atom_anyio.engine.tp_workers import RankSpec, load_rank
from atom_anyio.llm import LLM
from atom_anyio.models.plan import plan_model

# not the defaults, where a setting reaches the plan by one path and not the other
SETTINGS = {"gguf_weights": "dequantize", "attention_backend": "cpu_paged", "batch_invariant": True}
ENGINE = {"cpu_native_kernels": False, "cpu_amx": False}


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch):
    for name in ("ATOM_ATTENTION_BACKEND", "ATOM_GGUF_WEIGHTS", "ATOM_BATCH_INVARIANT", "ATOM_HF_OVERRIDES"):
        monkeypatch.delenv(name, raising=False)


def rank_spec(plan, rank: int) -> RankSpec:
    return RankSpec(plan, rank, num_blocks=8, block_size=16, num_threads=torch.get_num_threads(), store_port=0)


def test_the_server_llm_and_a_rank_load_one_plan_for_one_set_of_settings(tiny_model_dir):
    served = _load(Config.of(model=str(tiny_model_dir), **SETTINGS, **ENGINE)).plan
    offline = LLM(str(tiny_model_dir), num_kv_blocks=8, **SETTINGS, **ENGINE).loaded.plan
    rank = load_rank(rank_spec(served, 0)).plan
    assert served == offline == rank
    assert (served.native_kernels, served.amx, served.tile_linears) == (False, False, False)
    assert (served.attention_backend, served.batch_invariant, served.batch_invariant_why) == (
        "cpu_paged",
        True,
        "requested",
    )
    # float32: the invariant linears' GEMVs run in the fused decoder too; bfloat16's 16-row tiles op by op
    assert served.fused_decoder == (served.dtype == "float32") and bool(served.fused_decoder_why) != (
        served.dtype == "float32"
    )


def test_a_second_rank_loads_its_shard_as_rank_0s_plan_says(tiny_model_dir):
    """What ``main`` runs in a rank's process (``load_rank``), here without the process: the same
    plan as rank 0's, through the same load."""
    rank_0 = _load(Config.of(model=str(tiny_model_dir), tensor_parallel_size=2, **ENGINE))
    rank_1 = load_rank(rank_spec(rank_0.plan, 1))
    assert rank_1.plan == rank_0.plan
    assert rank_1.model.tp.rank == 1 and rank_0.plan.fused_decoder_why == "tensor parallelism"
    attention = rank_1.model.attention_backend
    assert (attention.native, attention.amx) == (False, False)


def test_settings_are_resolved_once_into_the_plan(tiny_model_dir):
    plan = plan_model(str(tiny_model_dir), "float32", gguf_weights="auto", hf_overrides=None)
    assert (plan.dtype, plan.dtype_requested, plan.weight_layout) == ("float32", "float32", "dequantize")
    assert (plan.attention_requested, plan.batch_invariant_requested, plan.hf_overrides) == ("auto", None, {})
    assert plan.attention_backend is None  # the load decides it
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        plan_model(str(tiny_model_dir), gguf_weights="some")
