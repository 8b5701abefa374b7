"""The decoder's elementwise ops, twice: ``TorchOps`` (the reference, plain
torch on any device) and ``CpuOps`` (the fused C++ kernels of
``kernels/csrc/ops.cpp``: one pass and one dispatch each, where the reference
spends six to twelve small ops per call). The model holds one of them, chosen
with its attention backend at construction (with the kernel variants it runs,
from the model's plan)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import gguf
import torch
import torch.nn.functional as F

from atom_anyio import kernels
from atom_anyio.models import quant
from atom_anyio.models.quant import QuantizedWeight


class TorchOps:
    name = "torch"

    @staticmethod
    def linear(x: torch.Tensor, layer: torch.nn.Linear | quant.QuantLinear) -> torch.Tensor:
        w = layer.weight
        return F.linear(x, w.dequantize(x.dtype) if isinstance(w, QuantizedWeight) else w, layer.bias)

    lm_head = linear

    @staticmethod
    def dequantize(w: QuantizedWeight) -> torch.Tensor:
        return w.dequantize()

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` normalised, and ``residual + x`` itself (the next residual)."""
        residual = residual + x
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate-half RoPE of ``q [T, H, D]`` and ``k [T, KVH, D]``; ``cos``, ``sin``: ``[T, D/2]`` float32."""
        cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(q.dtype)
        sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class CpuOps:
    """Same results as ``TorchOps`` to float rounding; needs ``kernels.load_cpu_kernels()``.
    ``native``: the elementwise kernels' native variants where built, else their portable twins
    (the plan's ``native_kernels``; the two are equal bit for bit)."""

    native: bool = True
    name: ClassVar[str] = "cpu"
    MAX_GEMV_ROWS: ClassVar[int] = 4  # up to here the weights stream once through the kernel; MKL's GEMM beyond

    @staticmethod
    def linear(x: torch.Tensor, layer: torch.nn.Linear | quant.QuantLinear) -> torch.Tensor:
        w = layer.weight
        if getattr(layer, "tile_qweight", None) is not None:  # any row count (docs/engine.md)
            return tile_qlinear(x, layer)
        tiles = getattr(layer, "tile_weight", None)
        # any row count: on AMX at one row as fast as the GEMV over Q4_1 blocks (29 against 30 ms a token)
        if tiles is not None:
            return tile_linear(x, tiles, w.shape[0], layer.bias, layer.tile_amx)
        packed = getattr(layer, "packed_weight", None)
        if packed is not None and (x.shape[0] > CpuOps.MAX_GEMV_ROWS or not isinstance(w, QuantizedWeight)):
            return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
        if isinstance(w, QuantizedWeight):
            return quant.cpu_linear(x, w, layer.bias)
        if not 0 < x.shape[0] <= CpuOps.MAX_GEMV_ROWS or w.dtype != torch.float32 or w.shape[1] % 8:
            return F.linear(x, w, layer.bias)
        out = x.new_empty(x.shape[0], w.shape[0])
        torch.ops.atom.gemv(out, x.contiguous(), w, layer.bias)
        return out

    LOGITS_SLICE: ClassVar[int] = 2048  # vocabulary rows per GEMM of the LM head

    @staticmethod
    def lm_head(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        """Past a few rows, the head runs in slices of the vocabulary (weight-major,
        so each slice streams once while it is in cache): measured 1.2-1.6x faster
        than one GEMM for 16-64 rows, same bits."""
        w = layer.weight
        packed = getattr(layer, "packed_weight", None) is not None or on_tiles(layer)
        if x.shape[0] <= CpuOps.MAX_GEMV_ROWS or layer.bias is not None or isinstance(w, QuantizedWeight) or packed:
            return CpuOps.linear(x, layer)
        out = x.new_empty(w.shape[0], x.shape[0])
        xt = x.t()
        for start in range(0, w.shape[0], CpuOps.LOGITS_SLICE):
            torch.mm(w[start : start + CpuOps.LOGITS_SLICE], xt, out=out[start : start + CpuOps.LOGITS_SLICE])
        return out.t().contiguous()

    dequantize = staticmethod(quant.cpu_dequantize)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops.atom.rms_norm(out, x, weight, eps, self.native)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        x, residual = x.contiguous(), residual.contiguous()
        torch.ops.atom.add_rms_norm(x, residual, weight, eps, self.native)  # in place: both are this step's own
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        torch.ops.atom.silu_and_mul(out, x.contiguous(), self.native)
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        torch.ops.atom.rotary_embedding(q, k, cos, sin, self.native)  # in place, through the qkv buffer's views
        return q, k


class BatchInvariantCpuOps(CpuOps):
    """``CpuOps`` whose linears give a row the same bits whatever else the step holds (the
    ``batch_invariant`` setting). Torch's GEMMs choose kernel and blocking by the row count
    (measured on an AMX Xeon: oneDNN's packed bfloat16 GEMM rounds rows differently at 48+ rows
    than at 16 or 32; float32 1-3 rows differently from 4+), so every linear runs on tiles of
    ``TILE_ROWS`` rows, the last one padded with zeros: bfloat16 tiles each through oneDNN's GEMM
    of that one shape (one shape runs one way, and a row's sums do not depend on its place in the
    tile); float32 rows (over a plain weight or a quantized layer's dense copy) and quantized blocks
    without a dense copy through the project's GEMVs, four rows at a time, whose sums per row have
    one order whatever the other rows (torch's float32 GEMM, MKL, gave a row different bits
    depending on the batch, and on an AMX Xeon about one end-to-end run in ten even for 16-row
    tiles of one shape). docs/engine.md, "Batch invariance", says what it costs."""

    name: ClassVar[str] = "cpu_invariant"
    TILE_ROWS: ClassVar[int] = 16

    @staticmethod
    def linear(x: torch.Tensor, layer: torch.nn.Linear | quant.QuantLinear) -> torch.Tensor:
        w = layer.weight
        if x.shape[0] == 0:
            return x.new_empty(0, w.shape[0])
        if on_tiles(layer):  # CpuOps' tile GEMM: one chain of products per element at any row count
            return CpuOps.linear(x, layer)
        if getattr(layer, "packed_weight", None) is None:
            if isinstance(w, QuantizedWeight):  # the blocks' GEMV at any row count, a dense copy or not
                return quant.gemv_linear(x, w, layer.bias)
            if _float32_gemv_runs(x, w):  # the float32 GEMV at any row count (MKL gave a row other bits)
                out = x.new_empty(x.shape[0], w.shape[0])
                torch.ops.atom.gemv(out, x.contiguous(), w, layer.bias)
                return out
        x, rows = _padded(x, BatchInvariantCpuOps.TILE_ROWS)
        tiles = [_tile_linear(t, layer) for t in x.split(BatchInvariantCpuOps.TILE_ROWS)]
        return (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:rows]

    lm_head = linear


def _padded(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """``x`` with zero rows added up to a multiple of ``multiple`` rows, and its own row count."""
    rows = x.shape[0]
    if rows % multiple:
        x = torch.cat((x, x.new_zeros(multiple - rows % multiple, x.shape[1])))
    return x.contiguous(), rows


def _float32_gemv_runs(x: torch.Tensor, w: torch.Tensor | QuantizedWeight) -> bool:
    return (
        not isinstance(w, QuantizedWeight)
        and x.dtype == w.dtype == torch.float32
        and w.shape[1] % 8 == 0
        and w.is_contiguous()
    )


def _tile_linear(x: torch.Tensor, layer: torch.nn.Linear | quant.QuantLinear) -> torch.Tensor:
    """One tile's GEMM: oneDNN's packed bfloat16 weight where there is one, else the float weight."""
    packed = getattr(layer, "packed_weight", None)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    w = layer.weight
    return F.linear(x, w.dense if isinstance(w, QuantizedWeight) else w, layer.bias)


Ops = TorchOps | CpuOps


def tile_linear(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None, amx: bool) -> torch.Tensor:
    """``x W^T (+ bias)`` on the tile GEMM (kernels/csrc/gemm.cpp) over ``pack_tile_weight(W)``: on the
    AMX tiles with ``amx`` where the build has them and the OS lends them, else on AVX512-BF16's pair
    dot products (the two variants' bits differ; each is batch-invariant)."""
    out = x.new_empty(x.shape[0], n)
    if weight.dtype == torch.float32:  # float32 panels (pack_f32_tile_weight): qtile_f32.cpp
        torch.ops.atom.tile_linear_f32(out, x.contiguous(), weight, bias, True)
        return out
    torch.ops.atom.tile_linear(out, x.contiguous(), weight, bias, amx)
    return out


def pack_f32_tile_weight(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` (float32) as the float32 tile GEMM's panels, ``[ceil(N/16), K, 16]``: block nb's 16
    columns side by side for each dim (qtile_f32.cpp), the last block's missing columns zero."""
    n, k = w.shape
    w = torch.cat((w, w.new_zeros(-n % 16, k))) if n % 16 else w
    return w.reshape(-1, 16, k).transpose(1, 2).contiguous()


def pack_tile_weight(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` (bfloat16, K a multiple of 32) as the tile GEMM's B tiles, ``[ceil(N/16), K/32,
    16, 32]``: tile (nb, kb), row r holds the dim pairs k = kb*32 + 2r, 2r+1 of columns nb*16 ..
    nb*16+15 (the last block's missing columns zero)."""
    n, k = w.shape
    w = torch.cat((w, w.new_zeros(-n % 16, k))) if n % 16 else w
    return w.reshape(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1, k // 32, 16, 32).contiguous()


TILE_QTYPES = (quant.Q.Q4_0, quant.Q.Q4_1, quant.Q.Q8_0)  # GGUF blocks the tile GEMM dequantizes itself
# and those the float32 tile GEMM and the bfloat16 one's vector variant (the blocks' chain) do: K-quants too,
# a sub-block of 32 a tile with float32 scales (kernels.h)
F32_TILE_QTYPES = (*TILE_QTYPES, quant.Q.Q4_K, quant.Q.Q6_K)


def tile_qlinear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``x W^T (+ bias)`` on the tile GEMM over the layer's quantized tiles (``pack_tile_qweight``)."""
    w = layer.weight
    out = x.new_empty(x.shape[0], w.shape[0])
    if x.dtype == torch.float32:  # qtile_f32.cpp: one FMA chain per element
        torch.ops.atom.tile_qlinear_f32(out, x.contiguous(), layer.tile_qweight, w.qtype.value, layer.bias, True)
        return out
    torch.ops.atom.tile_qlinear(out, x.contiguous(), layer.tile_qweight, w.qtype.value, layer.bias, layer.tile_amx)
    return out


def pack_tile_qweight(w: QuantizedWeight) -> torch.Tensor:
    """``w``'s GGUF blocks (Q4_0, Q4_1, Q8_0) as the tile GEMM's quantized tiles, ``[ceil(N/16), K/32,
    bytes]``: one block is one column of a tile; row r (dims 2r, 2r+1 of each of the 16 columns) as 16
    bytes of nibbles (byte c: column c's two weights, the first in the low nibble) or 32 int8 for
    Q8_0, then the columns' 16 d and (Q4_1) 16 m as float16 (gemm.cpp). The missing columns of a
    last block are zero weights. K-quants (Q4_K, Q6_K; the float32 tile GEMM's only): ``k_quant_tiles``."""
    if w.qtype in quant.K_QUANTS:
        return k_quant_tiles(w)
    n, k = w.shape
    nb, kb = -(-n // 16), k // quant.BLOCK_SIZE
    blocks = w.data.view(n, kb, quant.BLOCK_BYTES[w.qtype])
    if n % 16:
        blocks = torch.cat((blocks, blocks.new_zeros(nb * 16 - n, kb, blocks.shape[-1])))
    blocks = blocks.view(nb, 16, kb, -1).transpose(1, 2)  # [NB, KB, column, block]
    if w.qtype == quant.Q.Q8_0:
        pairs = blocks[..., 2:].reshape(nb, kb, 16, 16, 2).transpose(2, 3)  # [.., row, column, 2]
        scales = blocks[..., :2]
    else:
        nibbles = blocks[..., 4:] if w.qtype == quant.Q.Q4_1 else blocks[..., 2:]
        q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)  # the 32 weights in order
        q = q.reshape(nb, kb, 16, 16, 2).transpose(2, 3)  # [.., row, column, 2]
        pairs = q[..., 0] | (q[..., 1] << 4)
        d = blocks[..., :2]
        scales = blocks[..., :4] if w.qtype == quant.Q.Q4_1 else torch.cat((d, torch.zeros_like(d)), -1)
    d_m = scales.reshape(nb, kb, 16, -1, 2).transpose(2, 3)  # [.., d then m, column, 2 bytes]
    return torch.cat((pairs.reshape(nb, kb, -1), d_m.reshape(nb, kb, -1)), dim=-1).contiguous()


def k_quant_tiles(w: QuantizedWeight) -> torch.Tensor:
    """``w``'s Q4_K or Q6_K super-blocks as the float32 tile GEMM's tiles, ``[ceil(N/16), K/32, bytes]``,
    one sub-block of 32 a column of a tile (kernels.h): Q4_K's nibbles as Q4_1's (row r: byte c holds
    column c's dims 2r, 2r+1), then the columns' 16 s = d sc and 16 m = -(dmin mn) as float32 (w = s q +
    m); Q6_K's q - 32 as Q8_0's int8, then 16 s = d sc of dims 0-15 and 16 of dims 16-31 (w = s q). The
    scales are exact products (an 11-bit d by a 6- or 8-bit scale), so the kernels' s q + m and s q round
    as ``gguf.quants.dequantize`` does (ggml's dequantize_row_q4_K / q6_K); Q4_K's packed 6-bit scales
    and mins are unpacked by gguf's own ``Q4_K.get_scale_min``."""
    n, k = w.shape
    nb = -(-n // 16)
    blocks = w.data.view(n * (k // 256), -1)  # a super-block a row

    def halves(at: int) -> torch.Tensor:  # the float16 at byte `at` of each super-block, as float32 [rows, 1]
        return blocks[:, at : at + 2].contiguous().view(torch.float16).float()

    if w.qtype == quant.Q.Q4_K:
        sc, mn = (
            torch.from_numpy(a.astype("float32")) for a in gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].numpy())
        )
        scales = torch.stack((halves(0) * sc, -(halves(2) * mn)), -1)  # [rows, 8 sub-blocks, s then m]
        qs = blocks[:, 16:144].to(torch.int32).view(-1, 4, 32)  # bytes 32p..32p+31: sub-block 2p low, 2p + 1 high
        q = torch.stack((qs & 0x0F, qs >> 4), 2)
    else:
        sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # per 16
        scales = (halves(208) * sc).view(-1, 8, 2)  # [rows, 8 sub-blocks, dims 0-15's s then 16-31's]
        ql, qh = (
            blocks[:, 0:128].to(torch.int32).view(-1, 2, 2, 32),
            blocks[:, 128:192].to(torch.int32).view(-1, 2, 1, 32),
        )
        # sub-block j = 4h + t: ql byte 64h + 32 (t & 1) + i, nibble t >> 1; qh byte 32h + i, bits 2t
        lo = torch.stack((ql & 0x0F, ql >> 4), 2).view(-1, 2, 4, 32)  # [.., h, 2 (t >> 1) + (t & 1), i]
        hi = torch.stack([(qh >> (2 * t)) & 3 for t in range(4)], 2).view(-1, 2, 4, 32)
        q = (lo | (hi << 4)) - 32
    q = q.reshape(n, -1, 32)
    kb = k // 32
    scales = scales.reshape(n, kb, 2)
    if n % 16:
        q = torch.cat((q, q.new_zeros(nb * 16 - n, kb, 32)))
        scales = torch.cat((scales, scales.new_zeros(nb * 16 - n, kb, 2)))
    q = q.view(nb, 16, kb, 16, 2).permute(0, 2, 3, 1, 4)  # [NB, KB, row, column, 2]
    if w.qtype == quant.Q.Q4_K:
        rows = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8)
    else:
        rows = q.to(torch.int8).view(torch.uint8)
    tail = scales.view(nb, 16, kb, 2).permute(0, 2, 3, 1).contiguous()  # [NB, KB, s then m, column]
    return torch.cat((rows.reshape(nb, kb, -1), tail.view(torch.uint8).reshape(nb, kb, -1)), dim=-1).contiguous()


def f32_tileable(w) -> bool:
    """Whether the float32 tile GEMM (qtile_f32.cpp) takes this weight: GGUF blocks it has tiles for
    (K a multiple of 32) with float32 activations, or a float32 matrix; on the CPU."""
    if isinstance(w, QuantizedWeight):
        return (
            w.dtype == torch.float32 and w.qtype in F32_TILE_QTYPES and w.shape[1] % 32 == 0 and w.device.type == "cpu"
        )
    return isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.device.type == "cpu"


def f32_tiles_cover(model: torch.nn.Module) -> bool:
    """Whether every linear of the model is a weight the float32 tile GEMM takes (``f32_tileable``:
    GGUF blocks, or float32 matrices) but a float32 head that the embedding shares, which stays a
    matrix on the float32 GEMV (invariant as it is): where auto turns invariance on over them."""
    candidates = f32_tile_candidates(model)
    return bool(candidates) and all(f32_tileable(m.weight) for m in candidates)


def embedding_weights(model: torch.nn.Module) -> set[int]:
    """``id``s of the weights an embedding looks rows up in (a tied head's too)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, quant.QuantEmbedding | torch.nn.Embedding)}


def f32_tile_candidates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears the float32 tile GEMM would take: all but a float32 matrix an embedding shares."""
    looked_up = embedding_weights(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | quant.QuantLinear)]
    return [m for m in linears if isinstance(m.weight, QuantizedWeight) or id(m.weight) not in looked_up]


def pack_f32_tile_linears(model: torch.nn.Module) -> int:
    """Keep each float32 linear in the layout the float32 tile GEMM reads (qtile_f32.cpp: one FMA chain
    per output element at any row count, so batch-invariant by construction): GGUF blocks (Q4_0, Q4_1,
    Q8_0, and Q4_K, Q6_K as sub-blocks with float32 scales; K a multiple of 32) as quantized tiles
    (``tile_qweight``; the layer's dense copy, then unread, is dropped unless an embedding looks its
    rows up), a float32 matrix as panels (``tile_weight``, ``pack_f32_tile_weight``) that replace it:
    the matrix becomes a meta tensor (its shape and dtype, no memory; reading it fails loudly), so
    the panels cost no memory beside it. A float32 head that the embedding shares stays a matrix
    (the embedding reads its rows; the float32 GEMV runs it, invariant too). Returns the bytes the
    packed copies take."""
    looked_up = embedding_weights(model)
    num_bytes = 0
    for m in f32_tile_candidates(model):
        w = m.weight
        if not f32_tileable(w):
            continue
        m.tile_amx = False
        if not isinstance(w, QuantizedWeight):
            m.tile_weight = pack_f32_tile_weight(w.detach())
            num_bytes += m.tile_weight.nbytes
            m.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
            continue
        m.tile_qweight = pack_tile_qweight(w)
        num_bytes += m.tile_qweight.nbytes
        if w.dense is not None and id(w) not in looked_up:
            m.weight = replace(w, dense=None)
    return num_bytes


def unpack_tile_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_tile_weight``'s input back, ``[N, K]``."""
    nb, kb = packed.shape[:2]
    return packed.reshape(nb, kb, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)[:n].contiguous()


def can_pack_bf16() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs natively here (AVX512-BF16 or AMX; not past ATOM_KERNEL_ISA)."""
    mkldnn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return mkldnn and kernels.has_native_bf16()


def pack_bf16_linears(model: torch.nn.Module, tiles: bool | None = None, amx: bool = True) -> int:
    """Keep each bfloat16 linear weight beside it in the layout its GEMM reads, which
    ``CpuOps.linear`` runs. With ``tiles`` (by default where the kernels have the AMX linears): a
    dense weight (of a quantized layer, its dense copy) as the tile GEMM's bfloat16 tiles
    (``tile_weight``), and GGUF blocks without a dense copy that the tile GEMM dequantizes itself
    (Q4_0, Q4_1, Q8_0) as its quantized tiles (``tile_qweight``, where the GEMV and float32 slices
    served them before); batch-invariant at any row count (gemm.cpp), and on AMX faster than
    oneDNN at decode sizes. ``amx``: the tiles run on the AMX tiles where built and lent
    (``tile_amx`` on each layer, the plan's ``cpu_amx``), else on AVX512-BF16's pair products.
    With a dense copy the bfloat16 tiles serve: on a 2-core Xeon SmolLM2's weights stay in its
    cache, and dequantizing costs more than the bytes it saves. Without ``tiles``: oneDNN's blocked
    layout (``packed_weight``: a bfloat16 GEMM on a plain weight reorders the weight on every call,
    several times the GEMM itself at decode batch sizes; docs/performance.md; same bits as
    ``F.linear``). A weight whose K is not a multiple of 32 takes oneDNN's. A quantized layer's
    dense copy is then dropped (the packed one serves its GEMMs) unless an embedding looks its rows
    up too. The loader packs once, by the plan (``ModelPlan.tile_linears``); packing again in the
    other layout converts the layers (the tests compare the two). Returns the bytes the packed
    copies take."""
    if tiles is None:
        tiles = kernels.has_amx_linears()
    chain = tiles and blocks_chain(amx)
    looked_up = embedding_weights(model)
    num_bytes = 0
    for m in model.modules():
        w = m.weight if isinstance(m, torch.nn.Linear | quant.QuantLinear) else None
        if w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu":
            continue
        quantized = isinstance(w, QuantizedWeight)
        if chain and quantized and w.qtype in F32_TILE_QTYPES:  # the blocks' chain reads the blocks, not a dense copy
            m.dense_dropped = getattr(m, "dense_dropped", False) or w.dense is not None
            m.tile_qweight, m.tile_amx, m.tile_weight, m.packed_weight = pack_tile_qweight(w), amx, None, None
            num_bytes += m.tile_qweight.nbytes
            if w.dense is not None and id(w) not in looked_up:
                m.weight = replace(w, dense=None)
            continue
        dense = w.dense if quantized else w
        if dense is None and getattr(m, "dense_dropped", False):  # the blocks' chain had replaced it
            dense = w.dequantize(torch.bfloat16)
        m.dense_dropped = False
        if dense is None and getattr(m, "tile_weight", None) is not None:
            dense = unpack_tile_weight(m.tile_weight, w.shape[0])
        elif dense is None and getattr(m, "packed_weight", None) is not None:
            dense = _unpack_onednn(m.packed_weight, w.shape)
        m.tile_qweight, m.tile_amx = None, amx
        if dense is None:  # blocks without a dense copy: the quantized tiles, else the GEMV and dequantized slices
            if tiles and takes_quantized_tiles(w):
                m.tile_qweight = pack_tile_qweight(w)
                num_bytes += m.tile_qweight.nbytes
            continue
        m.tile_weight = m.packed_weight = None
        if tiles and dense.shape[1] % 32 == 0:
            m.tile_weight = pack_tile_weight(dense.detach())
        else:
            m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(dense.detach(), None)
        num_bytes += dense.nbytes
        if quantized and w.dense is not None and id(w) not in looked_up:
            m.weight = replace(w, dense=None)
    if hasattr(model, "_fused"):  # a fused decoder built over the other layout: built again at the next step
        model._fused = None
    return num_bytes


def blocks_chain(amx: bool) -> bool:
    """Whether the tile GEMM runs its vector variant here (AVX512-BF16's pair products: no AMX built, or
    ``amx`` off), whose quantized tiles are the blocks' chain (gemm.cpp): on a Zen 4 0.5-0.9x the dense
    copy's tiles' time up to 8 rows (a decode reads 0.6 bytes a weight, not 2) and 1.15-1.2x past 16,
    so GGUF blocks take them even where a dense copy exists."""
    return not (amx and kernels.has_amx_linears())


def takes_quantized_tiles(w: torch.Tensor | QuantizedWeight) -> bool:
    """Whether the tile GEMM runs this weight's own blocks (bfloat16 activations, no dense copy)."""
    return isinstance(w, QuantizedWeight) and w.dense is None and w.qtype in TILE_QTYPES and w.dtype == torch.bfloat16


def on_tiles(layer: torch.nn.Module) -> bool:
    """Whether the layer's GEMMs run on the tile GEMM (its bfloat16 or quantized tiles)."""
    return getattr(layer, "tile_weight", None) is not None or getattr(layer, "tile_qweight", None) is not None


def _unpack_onednn(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The plain ``[N, K]`` weight of oneDNN's packed copy: its GEMM on the identity."""
    eye = torch.eye(shape[1], dtype=torch.bfloat16)
    return torch.ops.mkldnn._linear_pointwise(eye, packed, None, "none", [], "").t().contiguous()
