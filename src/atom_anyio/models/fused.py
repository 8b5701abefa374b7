"""The fused CPU decoder (``kernels/csrc/decoder.cpp``): a step runs the whole
model in one C++ call. It calls the kernels the op-by-op path calls (and past
the GEMVs' rows the same GEMMs), in the same order, so its hidden states are that
path's bit for bit; what it saves is Python and the dispatcher between them
(about a third of a single-sequence decode step of SmolLM2-135M Q4_1 on two
cores).

``build(model)`` returns the decoder when every part of the model runs on
those kernels (the ``cpu`` attention backend; a dense MLP; one rank; float32
activations with every linear float32 or GGUF blocks, or bfloat16 with every
linear packed, as ``pack_bf16_linears`` leaves it: on the tile GEMM at any row
count (AMX, or AVX512-BF16's vector variant, GGUF blocks there in the blocks'
chain), or oneDNN's packed weight, a GGUF layer's own blocks serving 1-4 rows),
else None with the reason. The vector tiles are what a CPU with AVX512-BF16 and
no AMX (Zen 4, Zen 5) runs at the defaults (batch invariance on), and ``cpu_amx=false``
forces them on one with AMX; the oneDNN form, with batch invariance off there.
With ``batch_invariant`` in float32 it runs too, every linear through the
GEMVs at any row count as ``BatchInvariantCpuOps`` runs them.
The decoder holds the model's own weight tensors, not copies, and runs the
kernel variants its attention backend runs (``native``, ``amx``: the plan's).
The loader builds it once and records in the plan whether it runs and why.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_anyio import kernels
from atom_anyio.models.ops import BatchInvariantCpuOps, CpuOps, on_tiles
from atom_anyio.models.quant import BLOCKS, QuantizedWeight, slice_rows

FLOAT = -1  # decoder.cpp's type of a float32 weight


def build(model: nn.Module) -> tuple[torch.ScriptObject | None, str | None]:
    """``(decoder, None)``, or ``(None, why not)``."""
    cfg = model.config
    backend = model.attention_backend
    invariant = type(backend.ops) is BatchInvariantCpuOps
    if type(backend.ops) is not CpuOps and not invariant:
        return None, f"attention backend {backend.name!r} (the fused decoder runs the cpu kernels)"
    if model.tp.size > 1:
        return None, "tensor parallelism"
    if cfg.moe is not None:
        return None, "mixture-of-experts layers"
    if any(p.device.type not in ("cpu", "meta") for p in model.parameters()):  # meta: a matrix packed into panels
        return None, "weights off the CPU"
    bfloat16 = any(p.dtype != torch.float32 for p in model.parameters())
    if invariant and bfloat16 and not all(on_tiles(m) for m in _linears(model)):
        return None, "batch invariance in bfloat16 off the tile GEMM (BatchInvariantCpuOps' 16-row tiles run op by op)"
    if bfloat16 and (why := _not_packed(model)):
        return None, f"weights other than float32 on the CPU, and bfloat16 {why}"
    if kernels.load_cpu_kernels() is not None:
        return None, "the CPU kernels are not built"
    shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    if why := torch.ops.atom.decoder_unsupported_shape(*shape):
        return None, why
    decoder = torch.classes.atom.Decoder(*shape, cfg.rms_norm_eps, backend.native, backend.amx)
    if bfloat16:
        decoder.use_bfloat16()
    if invariant and not bfloat16:  # float32: the GEMVs at any row count; bfloat16 tiles are invariant as they are
        decoder.use_batch_invariant()
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else (None, None)
        sinks = None if attn.sinks is None else attn.sinks.detach().float().contiguous()
        decoder.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            q_norm,
            k_norm,
            sinks,
            cfg.window(i) or 0,
        )
        for slot, linear in enumerate((attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            if getattr(linear, "tile_weight", None) is not None:  # bfloat16 tiles, or float32 panels
                decoder.set_tile_linear(slot, linear.tile_weight, linear.bias)
                continue
            if getattr(linear, "tile_qweight", None) is not None:  # bfloat16, or float32's tiles (qtile_f32.cpp)
                decoder.set_tile_qlinear(slot, linear.tile_qweight, linear.weight.qtype.value, linear.bias)
                continue
            if bfloat16:
                w = linear.weight
                blocks, qtype = (w.data, w.qtype.value) if isinstance(w, QuantizedWeight) else (None, FLOAT)
                decoder.set_onednn_linear(slot, linear.packed_weight, linear.bias, blocks, qtype)
                continue
            weight, qtype = _weight(linear.weight)
            if weight is None:
                return None, f"layer {i}: a {qtype} weight"
            decoder.set_linear(slot, weight, qtype, linear.bias, slice_rows(linear.weight.shape[1]))
            if isinstance(linear.weight, QuantizedWeight) and linear.weight.dense is not None and not invariant:
                decoder.set_dense(slot, linear.weight.dense)  # past the GEMV's rows its GEMM, as quant.cpu_linear
    weight, qtype = (
        _embedding(model.model.embed_tokens.weight) if bfloat16 else _weight(model.model.embed_tokens.weight)
    )
    if weight is None:
        return None, f"a {qtype} embedding"
    decoder.set_embedding(weight, qtype)
    decoder.set_norm(model.model.norm.weight)
    return decoder, None


def _weight(w: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor | None, int | str]:
    """The tensor decoder.cpp reads and its type, or None and what it is."""
    if isinstance(w, QuantizedWeight):
        if w.qtype not in BLOCKS or w.dtype != torch.float32:
            return None, f"{w.qtype.name} with {w.dtype} activations"
        return w.data, w.qtype.value
    if w.dtype != torch.float32 or not w.is_contiguous() or w.shape[-1] % 8:
        return None, f"{w.dtype} (or non-contiguous, or width not a multiple of 8)"
    return w.detach(), FLOAT


def _not_packed(model: nn.Module) -> str | None:
    """Why a bfloat16 model's decoder layers are not all packed for a GEMM the decoder runs, or None."""
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        return "mixed with other dtypes"
    for n, linear in enumerate(_linears(model)):
        if on_tiles(linear):
            continue
        if getattr(linear, "packed_weight", None) is None:
            return f"not packed for oneDNN or the tile GEMM (layer {n // 4})"
    return None


def _linears(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' four linears each, in order."""
    return [
        linear
        for layer in model.model.layers
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def _embedding(w: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor | None, int | str]:
    """A bfloat16 embedding's rows as decoder.cpp copies them: the table, or a GGUF table's dense copy."""
    if isinstance(w, QuantizedWeight):
        w = w.dense
        if w is None:
            return None, "quantized embedding without a dense copy (bfloat16)"
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        return None, f"{w.dtype} (or non-contiguous) embedding beside bfloat16 layers"
    return w.detach(), FLOAT
