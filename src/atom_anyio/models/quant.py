"""GGUF block-quantized weights kept as the file stores them, on CPU.

A ``QuantizedWeight`` is a linear layer's (or the embedding's) rows of ggml
blocks, untouched: 32 weights per block with the block's float16 scale (and
minimum for Q4_1), or for the K-quants super-blocks of 256 weights with a
float16 scale and 8 or 16 small integer scales. ``QuantLinear`` and
``QuantEmbedding`` hold one in place of ``nn.Linear``/``nn.Embedding``;
``install`` swaps them into a model built on
the meta device. The ops (models/ops.py) run them: ``TorchOps`` dequantizes
on the fly with ``QuantizedWeight.dequantize`` (the portable reference),
``CpuOps`` with the kernels of ``kernels/csrc/quant.cpp`` (a GEMV that
dequantizes in registers for 1-4 rows; dequantized slices and a GEMM beyond).
The K-quants' portable path is gguf's own numpy dequantizer.

Packed q/k/v and gate/up (``pack_weights``) concatenate whole rows, so they
stay quantized when their parts share a type; parts of different types are
dequantized and packed as floats.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import gguf
import torch
import torch.nn.functional as F
from torch import nn

Q = gguf.GGMLQuantizationType
BLOCK_SIZE = 32
# the types kept quantized: (weights, bytes) of one block (a K-quant's super-block of 256)
BLOCKS = {t: gguf.GGML_QUANT_SIZES[t] for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)}
BLOCK_BYTES = {t: size for t, (weights, size) in BLOCKS.items() if weights == BLOCK_SIZE}  # blocks of 32
K_QUANTS = {t for t, (weights, _) in BLOCKS.items() if weights != BLOCK_SIZE}


@dataclass(frozen=True)
class QuantizedWeight:
    """``shape`` ``[N, K]`` weights as ``data``: uint8 ``[N, K / block weights * block bytes]``, the file's blocks
    row by row.
    ``dtype`` is the activations' (what ``dequantize`` gives by default), as a float weight's would be."""

    data: torch.Tensor
    qtype: gguf.GGMLQuantizationType
    shape: torch.Size
    dtype: torch.dtype = torch.float32
    # ``dequantize()`` kept beside the blocks (``with_dense``): batched GEMMs at the float GEMM's speed,
    # while 1-4 rows still stream the smaller blocks
    dense: torch.Tensor | None = None

    def __post_init__(self):
        (n, k), (weights, size) = self.shape, BLOCKS[self.qtype]
        assert self.data.dtype == torch.uint8 and self.data.shape == (n, k // weights * size)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device=None, dtype=None) -> QuantizedWeight:
        """Same blocks, ``dtype`` as the activations' dtype; the kernels are CPU-only."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"quantized weights run on CPU only, not on {device}")
        assert self.dense is None, "a dense copy is made after the weights are placed"
        return replace(self, dtype=dtype or self.dtype)

    def with_dense(self) -> QuantizedWeight:
        """The same blocks with their dequantized copy in ``dtype`` kept beside them."""
        return replace(self, dense=self.dequantize())

    def index_select(self, dim: int, index: torch.Tensor) -> QuantizedWeight:
        """Rows ``index`` (``dim`` 0: blocks never straddle rows)."""
        assert dim == 0
        data = self.data.index_select(0, index)
        dense = None if self.dense is None else self.dense.index_select(0, index)
        return replace(self, data=data, shape=torch.Size((data.shape[0], self.shape[1])), dense=dense)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weights, as ``gguf.quants.dequantize`` computes them (float32, then ``dtype``)."""
        if self.dense is not None and self.dense.dtype == (dtype or self.dtype):
            return self.dense
        n, k = self.shape
        if self.qtype in K_QUANTS:
            w = torch.from_numpy(gguf.quants.dequantize(self.data.numpy(), self.qtype))
            return w.reshape(n, k).to(dtype or self.dtype)
        blocks = self.data.view(n, k // BLOCK_SIZE, BLOCK_BYTES[self.qtype])
        d = blocks[..., :2].contiguous().view(torch.float16).float()
        if self.qtype == Q.Q8_0:
            w = d * blocks[..., 2:].contiguous().view(torch.int8).float()
        else:
            nibbles = blocks[..., 4:] if self.qtype == Q.Q4_1 else blocks[..., 2:]
            q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()  # byte j: weights j and j + 16
            if self.qtype == Q.Q4_1:
                w = d * q + blocks[..., 2:4].contiguous().view(torch.float16).float()
            else:
                w = d * (q - 8)
        return w.reshape(n, k).to(dtype or self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.cat`` along rows (how ``pack_weights`` packs q/k/v and gate/up)."""
        kwargs = kwargs or {}
        if func is not torch.cat or kwargs.get("dim", args[1] if len(args) > 1 else 0) != 0:
            return NotImplemented
        parts = args[0]
        assert all(p.dense is None for p in parts if isinstance(p, QuantizedWeight)), "packed before dense copies"
        if all(isinstance(p, QuantizedWeight) for p in parts) and len({p.qtype for p in parts}) == 1:
            data = torch.cat([p.data for p in parts])
            return replace(parts[0], data=data, shape=torch.Size((data.shape[0], parts[0].shape[1])))
        return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.dense is None else self.dense.nbytes)


class QuantLinear(nn.Module):
    """``nn.Linear`` with a ``QuantizedWeight``; the model's ops run it (``ops.linear(x, layer)``)."""

    def __init__(self, weight: QuantizedWeight, has_bias: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # a plain attribute: not a parameter, never in the state dict
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta")) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.weight.qtype.name}"


class QuantEmbedding(nn.Module):
    """Rows of a ``QuantizedWeight``, dequantized as they are looked up."""

    def __init__(self, weight: QuantizedWeight, ops):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = weight
        self.ops = ops

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, input_ids.reshape(-1))
        return self.ops.dequantize(rows).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.weight.qtype.name}"


def install(model: nn.Module, state: dict[str, torch.Tensor | QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Swap each module whose ``weight`` in ``state`` is quantized for its quantized
    twin; return the rest of ``state`` (float tensors, loaded by name as usual).
    A quantized tied embedding is the LM head too."""
    ops = model.attention_backend.ops
    rest = {}
    for name, value in state.items():
        if not isinstance(value, QuantizedWeight):
            rest[name] = value
            continue
        module_name = name.removesuffix(".weight")
        parent_name, _, child = module_name.rpartition(".")
        parent, module = model.get_submodule(parent_name), model.get_submodule(module_name)
        if isinstance(module, nn.Embedding):
            setattr(parent, child, QuantEmbedding(value, ops))
        else:
            assert isinstance(module, nn.Linear), f"{module_name} is not a linear layer"
            setattr(parent, child, QuantLinear(value, module.bias is not None))
    embedding = model.model.embed_tokens
    if model.config.tie_word_embeddings and isinstance(embedding, QuantEmbedding):
        model.lm_head = QuantLinear(embedding.weight, has_bias=False)
    return rest


def quantized_modules(model: nn.Module) -> list[QuantLinear | QuantEmbedding]:
    return [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]


def dense_bytes(model: nn.Module) -> int:
    """Bytes the dequantized copies of the model's quantized weights take (``add_dense_copies``), each once."""
    weights = {id(m.weight): m.weight for m in quantized_modules(model)}
    return sum(w.shape.numel() * w.dtype.itemsize for w in weights.values())


def add_dense_copies(model: nn.Module) -> None:
    """Keep each quantized weight's dequantized copy beside its blocks (one copy for a tied head)."""
    copies: dict[int, QuantizedWeight] = {}
    for m in quantized_modules(model):
        m.weight = copies.setdefault(id(m.weight), m.weight.with_dense())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters, buffers and quantized blocks (and their
    dense copies), and float32 panels where they replace a matrix, each storage once."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"]
    for m in model.modules():  # a float32 matrix packed into panels that replace it (a meta weight): the panels
        weight = getattr(m, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.device.type == "meta"
            and getattr(m, "tile_weight", None) is not None
        ):
            tensors.append(m.tile_weight)
    for m in quantized_modules(model):
        tensors += [m.weight.data] + ([] if m.weight.dense is None else [m.weight.dense])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# CPU kernels


GEMV_DTYPES = (torch.float32, torch.bfloat16)  # bfloat16 rows widen and round back in the kernel
MAX_GEMV_ROWS = 4  # up to here the blocks stream once through the GEMV; dequantized slices and a GEMM beyond
# float32 rows: the GEMV over the blocks up to here (a verifying step's few rows per sequence, a small
# batch), where torch's float32 GEMM over the dense copy takes longer: SmolLM2's linears 28-37 ms at 5-8
# rows against 60-66 ms (AMD EPYC Zen 4, 2 threads; the GEMM is ahead from about 24 rows)
MAX_F32_GEMV_ROWS = 16
SLICE_FLOATS = 1 << 17  # floats of dequantized weights per GEMM (512 KiB: stays in cache while the GEMM reads it)


def cpu_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` with the kernels, the result in ``x``'s dtype. 1-4 rows (float32: up to
    ``MAX_F32_GEMV_ROWS``): the GEMV over the blocks (float32 arithmetic), each row the bits it has
    alone; more: the dense copy where there is one, else slices dequantized in ``x``'s dtype, each
    through torch's GEMM (oneDNN's bfloat16 GEMM, AMX where the CPU has it)."""
    n, k = w.shape
    if x.shape[0] == 0:  # a step that samples nothing (a long prompt's first chunks)
        return x.new_empty(0, n)
    if x.shape[0] <= (MAX_F32_GEMV_ROWS if x.dtype == torch.float32 else MAX_GEMV_ROWS):  # decode: the hot path
        return gemv_linear(x, w, bias)
    if w.dense is not None:
        return F.linear(x, w.dense, bias)
    x = x.contiguous()
    rows = slice_rows(k)
    buffer = x.new_empty(min(rows, n), k)
    out = x.new_empty(n, x.shape[0])
    xt = x.t()
    for start in range(0, n, rows):
        part = buffer[: min(rows, n - start)]
        torch.ops.atom.dequantize(part, w.data[start : start + rows], w.qtype.value)
        torch.mm(part, xt, out=out[start : start + rows])
    out = out.t()
    return (out if bias is None else out + bias).contiguous()


def gemv_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` through the GEMV over the blocks (float32 arithmetic) at any row count, each row
    the bits it has alone (batch invariance rests on it); other dtypes than float32 and bfloat16 widen
    to float32 and round back."""
    if x.dtype not in GEMV_DTYPES:
        return gemv_linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    out = x.new_empty(x.shape[0], w.shape[0])
    torch.ops.atom.qgemv(out, x.contiguous(), w.data, w.qtype.value, bias)
    return out


@functools.cache
def slice_rows(k: int) -> int:
    return max(64, SLICE_FLOATS // k // 64 * 64)


def cpu_dequantize(w: QuantizedWeight) -> torch.Tensor:
    if w.dense is not None:
        return w.dense
    out = torch.empty(w.shape, dtype=w.dtype)
    torch.ops.atom.dequantize(out, w.data, w.qtype.value)
    return out
