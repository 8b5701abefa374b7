"""Load a Llama-family model from a Hugging Face directory or a GGUF file.

Both paths end in the same place: a ``ModelConfig`` and a state dict with
Hugging Face parameter names, assigned into a model built on the meta device
(no random init). GGUF tensors are dequantized with the ``gguf`` package; the
tokenizer a GGUF describes is converted once and cached on disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from atom_anyio import kernels
from atom_anyio.generation_defaults import BUNDLED_MODEL_DEFAULTS, from_generation_config, from_gguf_metadata
from atom_anyio.models import quant
from atom_anyio.models.attention import CpuPagedAttention, prefill_path, select_backend
from atom_anyio.models.decoder import LlamaForCausalLM, ModelConfig, hf_eos_ids, merge_hf_overrides, pack_weights
from atom_anyio.models.gguf_file import load_gguf_tokenizer, read_gguf
from atom_anyio.models.moe import stack_experts
from atom_anyio.models.ops import (
    CpuOps,
    can_pack_bf16,
    f32_tile_candidates,
    f32_tiles_cover,
    on_tiles,
    pack_bf16_linears,
    pack_f32_tile_linears,
)
from atom_anyio.models.plan import ModelPlan, default_model_path, plan_model
from atom_anyio.models.tensor_parallel import TensorParallel

log = structlog.get_logger("atom_anyio.models")

StateDict = dict[str, torch.Tensor]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, on device, in dtype, requires_grad False
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    chat_template: str | None
    name: str  # the served-model name: the directory name or the GGUF file stem
    # the model's own sampling defaults, SamplingParams names (generation_defaults.py); requests override them
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    plan: ModelPlan | None = None  # what it was loaded as (models/plan.py); None: built in memory


def is_default_model(path: str) -> bool:
    """Whether ``path`` is the default model's file."""
    try:
        return os.path.samefile(path, default_model_path())
    except FileNotFoundError:
        return False


DENSE_COPY_SHARE = 0.25  # auto keeps dense copies while they take at most this share of the available memory


def dense_copy_fits(num_bytes: int) -> bool:
    """Whether ``num_bytes`` of dense copies fit in ``DENSE_COPY_SHARE`` of the available memory."""
    return num_bytes <= DENSE_COPY_SHARE * available_memory()


def available_memory() -> int:
    """The kernel's MemAvailable (free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_model(
    path: str | os.PathLike | None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attention_backend: str | None = None,
    tensor_parallel_size: int = 1,
    rank: int = 0,
    gguf_weights: str = "auto",
    batch_invariant: bool | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    native_kernels: bool = True,
    amx: bool = True,
) -> LoadedModel:
    """Load a Hugging Face model directory or a ``.gguf`` file (``None``: the default model) as
    ``plan_model`` plans it for these settings (models/plan.py says what each means). With
    ``tensor_parallel_size`` > 1, only ``rank``'s shard of the weights (models/tensor_parallel.py)."""
    plan = plan_model(
        path,
        dtype,
        device,
        attention_backend,
        tensor_parallel_size,
        gguf_weights,
        batch_invariant,
        hf_overrides,
        native_kernels,
        amx,
    )
    return load_planned(plan, rank)


def load_planned(plan: ModelPlan, rank: int = 0) -> LoadedModel:
    """Load ``rank``'s shard of the model ``plan`` describes; the plan it returns adds what the
    load decided, logged once (``model.plan``). Nothing changes the model afterwards."""
    dtype, device = plan.torch_dtype, plan.rank_device(rank)
    (cfg, state), (tokenizer, chat_template, name, generation) = read_model(plan)
    tp = TensorParallel(cfg, rank, plan.tensor_parallel_size)
    invariant, switches = bool(plan.batch_invariant_requested), (plan.native_kernels, plan.amx)
    model = build_model(cfg, tp.shard_state(state), dtype, device, plan.attention_requested, tp, invariant, *switches)
    backend = model.attention_backend
    # float32 where the float32 tiles serve (an AVX2-only CPU, an AMD CPU with AVX512), invariant or where auto
    # may turn it on: the linears (GGUF blocks the tiles take, float32 matrices as panels that replace them) on
    # the float32 tile GEMM, invariant by construction and level with or faster than MKL's at prefill sizes
    f32_tiles = (
        isinstance(backend.ops, CpuOps)
        and dtype == torch.float32
        and plan.native_kernels
        and kernels.f32_tile_linears_reason() is not None
        and (
            invariant
            or (plan.batch_invariant_requested is None and may_be_auto_invariant(model) and f32_tiles_cover(model))
        )
    )
    # float32 and invariant: every linear runs its blocks' GEMV (or tiles) at any row count, and a copy
    # would go unread
    dense_copies = (
        plan.weight_layout == "both"
        and not ((invariant or f32_tiles) and dtype == torch.float32)
        and (plan.gguf_weights == "both" or dense_copy_fits(quant.dense_bytes(model)))
    )
    if dense_copies:
        quant.add_dense_copies(model)
    packed_bytes, tile_linears = 0, False
    if isinstance(backend.ops, CpuOps) and dtype == torch.bfloat16 and can_pack_bf16():
        # auto may turn invariance on over the vector tiles (batch_invariant_auto_reason): they serve it
        auto_may_turn_on = plan.batch_invariant_requested is None and may_be_auto_invariant(model)
        tile_linears = (
            plan.native_kernels
            and kernels.has_tile_linears()
            and ((plan.amx and kernels.has_amx_linears()) or invariant or auto_may_turn_on)
        )
        packed_bytes = pack_bf16_linears(model, tile_linears, plan.amx)
    elif f32_tiles:
        packed_bytes = pack_f32_tile_linears(model)
        tile_linears = packed_bytes > 0
    if plan.batch_invariant_requested is not None:
        invariant_why = "requested"
    elif invariant_why := batch_invariant_auto_reason(model):
        backend.use_auto_batch_invariant()
    else:
        invariant_why = "auto: off, where the GEMMs or the attention would pay for it (docs/engine.md)"
    fused_why = model.build_fused()
    plan = dataclasses.replace(
        plan,
        attention_backend=backend.name,
        attention_prefill=prefill_path(backend) if isinstance(backend, CpuPagedAttention) else None,
        tile_linears=tile_linears,
        batch_invariant=bool(getattr(backend, "batch_invariant", False)),
        batch_invariant_why=invariant_why,
        dense_copies=dense_copies,
        fused_decoder=fused_why is None,
        fused_decoder_why=fused_why,
    )
    log.info(
        "model.plan",
        **plan.log_fields(),
        rank=rank,
        weights=model.dtype_name,
        packed_mb=round(packed_bytes / 2**20, 1),
        cpu=kernels.cpu_model() if device.type == "cpu" else None,
        native_bf16=kernels.has_native_bf16() if device.type == "cpu" else None,
    )
    if device.type == "cpu":  # another thread runs the steps: the pool this load made goes
        kernels.release_openmp_threads()
    return LoadedModel(model, tokenizer, cfg, chat_template, name, generation_defaults=generation, plan=plan)


def read_model(plan: ModelPlan) -> tuple[tuple[ModelConfig, StateDict], tuple[Any, str | None, str, dict[str, Any]]]:
    """``(config, state dict)`` and ``(tokenizer, chat template, served name, generation defaults)``
    of the plan's GGUF file or Hugging Face directory."""
    path = plan.path
    if path.endswith(".gguf"):
        keep_quantized = plan.weight_layout != "dequantize"
        cfg, state, metadata = read_gguf(path, keep_quantized, plan.torch_dtype, plan.hf_overrides)
        if "tokenizer.ggml.model" not in metadata:
            raise ValueError(f"{path} has no tokenizer metadata; serve it from a directory with tokenizer files")
        tokenizer = load_gguf_tokenizer(path, metadata["general.architecture"])
        generation = from_gguf_metadata(metadata) or (dict(BUNDLED_MODEL_DEFAULTS) if is_default_model(path) else {})
        return (cfg, state), (tokenizer, metadata.get("tokenizer.chat_template"), Path(path).stem, generation)
    if os.path.isdir(path):
        weights = load_hf_weights(path, plan.hf_overrides)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return weights, (tokenizer, tokenizer.chat_template, Path(path).resolve().name, from_generation_config(path))
    raise FileNotFoundError(f"model path {path!r} is neither a Hugging Face model directory nor a .gguf file")


def may_be_auto_invariant(model: LlamaForCausalLM) -> bool:
    """What auto's batch invariance needs beyond the linears: the ``cpu`` backend, one rank, a dense model."""
    backend = model.attention_backend
    return isinstance(backend, CpuPagedAttention) and model.tp.size == 1 and model.config.moe is None


def batch_invariant_auto_reason(model: LlamaForCausalLM) -> str | None:
    """Why ``batch_invariant`` at auto turns on for this model, or None: where every linear runs on
    the tile GEMM (one chain per output element whatever the row count) and the attention's
    batch-invariant form (keys split at fixed multiples, prefill through the kernel) serves near the
    default's speed. On AMX: the AMX GEMM and the attention on the tiles, at no cost
    (docs/performance.md: SmolLM2 at c16 on a Xeon with AMX, 154.2 against 152.4 out tok/s).
    Without AMX (AVX512-BF16: a Zen 4 or 5, or ``cpu_amx=false``): the vector variant, GGUF blocks in
    the blocks' chain, faster than the default at 1-16 rows and 1.2x its time in prefill
    (docs/engine.md: 7% of SmolLM2's served output at one stream, 7-17% at c16). Float32 on an
    AVX2-only CPU (a Zen 3), since 2026-12-07: GGUF Q4_0/Q4_1/Q8_0 linears (or float32 matrices) on the
    float32 tile GEMM (qtile_f32.cpp: one FMA chain an element, level with or faster than MKL), SmolLM2
    served at 0.97x the earlier default's output at c16 and 1.10x at one stream (with auto's
    drafts), no dense copies (RSS 825 against 1,332 MiB); and on an AMD CPU with AVX512 (a Zen 4),
    since 2026-12-08, float32 matrices as panels that replace them (a tied head stays a matrix on the
    float32 GEMV): SmolLM2 in float32 served at 1.02-1.18x the float32 default at c16, 1.47x at one
    stream, the same memory. Elsewhere it stays a setting: the oneDNN and MKL GEMMs pay for it
    (float32 on Intel's AVX512 CPUs, or weights the tiles do not take)."""
    backend, cfg = model.attention_backend, model.config
    if not may_be_auto_invariant(model) or backend.batch_invariant:
        return None
    if model.lm_head.weight.dtype == torch.float32:  # the float32 tiles (kernels.f32_tile_linears_reason)
        # what they take (a float32 head the embedding shares stays a matrix, on the float32 GEMV,
        # invariant as it is), every one of them packed
        candidates = f32_tile_candidates(model)
        if not candidates or not all(map(on_tiles, candidates)):
            return None
        why = kernels.f32_tile_linears_reason() or "float32 on the float32 tile GEMM"
        return f"{why.partition(':')[0]}: every linear on the float32 tile GEMM (one FMA chain an element)"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | quant.QuantLinear)]
    if not linears or not all(on_tiles(m) for m in linears):
        return None
    if not backend.on_amx_tiles:
        return "bfloat16 on AVX512-BF16: every linear on the tile GEMM (GGUF blocks in the blocks' chain)"
    if cfg.head_dim % 64 or cfg.num_attention_heads // cfg.num_key_value_heads > 16:
        return None  # the AMX attention's shapes (amx_fits in kernels/csrc/attention_amx.h)
    return "bfloat16 on AMX: every linear on the AMX GEMM and the attention on the tiles, invariant at no cost"


def build_model(
    cfg: ModelConfig,
    state: StateDict,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str | None = None,
    tp: TensorParallel | None = None,
    batch_invariant: bool = False,
    native: bool = True,
    amx: bool = True,
) -> LlamaForCausalLM:
    """Assign ``state`` (Hugging Face names; with ``tp``, already that rank's shard) into a
    model built without initializing weights; every weight must be given. The attention backend:
    ``attention.select_backend``'s for the other arguments."""
    if batch_invariant and cfg.moe is not None:
        raise ValueError("batch_invariant does not cover mixture-of-experts models yet (torch runs their expert GEMMs)")
    with torch.device("meta"):
        backend = select_backend(device, attention_backend, cfg.head_dim, batch_invariant, dtype, native, amx)
        model = LlamaForCausalLM(cfg, backend, tp)
    state, missing_parts = pack_weights(
        stack_experts({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, cfg.moe)
    )
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = quant.install(model, state)  # the layers whose weights stay quantized
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = missing_parts + missing
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign replaced the shared parameter
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not match the {cfg.architecture} config: missing {missing}, unknown {unexpected}")
    model.inv_freq = model.inv_freq.to(device)  # non-persistent (not in the state dict): built on the CPU
    return model.eval().requires_grad_(False)


# Hugging Face directory


def load_hf_weights(path: str, hf_overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, StateDict]:
    """Config (``hf_overrides`` merged over config.json, generation_config.json eos ids merged) and
    safetensors weights of a HF directory."""
    root = Path(path)
    cfg = ModelConfig.from_hf(merge_hf_overrides(json.loads((root / "config.json").read_text()), hf_overrides or {}))
    generation = root / "generation_config.json"
    if generation.is_file():
        eos = hf_eos_ids(json.loads(generation.read_text()).get("eos_token_id"))
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys([*cfg.eos_token_ids, *eos])))
    return cfg, read_safetensors(root)


def read_safetensors(root: Path) -> StateDict:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{root} has neither model.safetensors nor model.safetensors.index.json")
    state: StateDict = {}
    for file in files:
        with safe_open(root / file, framework="pt") as f:
            names = [k for k in f.keys() if not k.endswith("rotary_emb.inv_freq")]  # noqa: SIM118 (not iterable)
            state.update({k: f.get_tensor(k) for k in names})
    return state
