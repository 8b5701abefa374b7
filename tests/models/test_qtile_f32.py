"""The float32 tile linears (kernels/csrc/qtile_f32.cpp), over GGUF blocks packed as quantized tiles and
over float32 matrices packed as panels: one FMA chain per output element, the AVX2 variant equal to the
portable twin bit for bit at every row count."""

from __future__ import annotations

import gguf
import pytest
import torch
from support_gguf import random_quantized

from atom_anyio import kernels
from atom_anyio.models.ops import pack_f32_tile_weight, pack_tile_qweight

pytestmark = pytest.mark.skipif(kernels.load_cpu_kernels() is not None, reason="the CPU kernels do not build here")
needs_avx2 = pytest.mark.skipif(
    not {"avx2", "fma"} <= set(kernels.cpu_flags().split()), reason="no AVX2 and FMA on this CPU"
)


def linear(x: torch.Tensor, packed: torch.Tensor, qtype: gguf.GGMLQuantizationType, n: int, bias, native: bool):
    out = torch.empty(x.shape[0], n)
    torch.ops.atom.tile_qlinear_f32(out, x.contiguous(), packed, qtype.value, bias, native)
    return out


# blocks of 32: any K a multiple of 32; K-quants' super-blocks: multiples of 256
SHAPES = [(80, 96, True), (57, 320, False), (40, 1536, True), (9, 64, False)]
K_SHAPES = [(80, 256, True), (57, 512, False), (40, 1536, True), (9, 768, False)]
CASES = [(q, *shape) for q in ("Q4_0", "Q4_1", "Q8_0") for shape in SHAPES]
CASES += [(q, *shape) for q in ("Q4_K", "Q6_K") for shape in K_SHAPES]


@needs_avx2
@pytest.mark.parametrize("qtype,n,k,bias", CASES)
def test_the_avx2_variant_equals_the_portable_chain_for_any_rows(qtype, n, k, bias):
    """Each row count the AVX2 variant runs its own way (the GEMV with one, two or four column
    blocks at a time at 1-4 rows, the 6 x 16 GEMM past them with a last tile of rows and of columns
    cut short, K in blocks of 8 tiles with a shorter last one) gives the portable twin's bits, and a
    row the same bits whatever rows share its call; within float32 rounding of the exact product
    over the reference's dequantized weights. The weights are the reference's bit for bit (x = I
    gives W^T): K-quants' sub-blocks with their float32 scales (``k_quant_tiles``) too."""
    qt = gguf.GGMLQuantizationType[qtype]
    w, _ = random_quantized(n, k, qt)
    packed = pack_tile_qweight(w)
    reference = w.dequantize(torch.float32)
    for native in (False, True):
        assert torch.equal(linear(torch.eye(k), packed, qt, n, None, native).t(), reference)
        assert torch.equal(linear(torch.eye(k)[:3], packed, qt, n, None, native).t(), reference[:, :3])
    b = torch.randn(n) if bias else None
    x = torch.randn(40, k)
    twin = linear(x, packed, qt, n, b, native=False)
    exact = x.double() @ w.dequantize(torch.float32).double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(twin.double(), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, packed, qt, n, b, native=True), twin)
    for begin, end in [(0, 1), (3, 5), (1, 4), (0, 4), (0, 5), (2, 9), (0, 6), (7, 20), (5, 40)]:
        assert torch.equal(linear(x[begin:end], packed, qt, n, b, native=True), twin[begin:end]), f"{begin}:{end}"
    assert linear(x[:0], packed, qt, n, b, native=True).shape == (0, n)


@needs_avx2
@pytest.mark.parametrize("n,k,bias", [(80, 96, True), (57, 300, False), (40, 1000, True), (9, 7, False)])
def test_float32_panels_run_the_same_chain_for_any_rows(n, k, bias):
    """Float32 matrices packed as panels (``pack_f32_tile_weight``): the GEMV at 1-4 rows and the
    6 x 16 GEMM past them (K in blocks of 256 with a shorter last one, any K, a last tile of rows and
    of columns cut short) give the portable twin's bits, a row the same bits in any batch, within
    float32 rounding of the exact product."""
    torch.manual_seed(0)
    w = torch.randn(n, k)
    packed = pack_f32_tile_weight(w)
    assert packed.shape == ((n + 15) // 16, k, 16) and torch.equal(packed.transpose(1, 2).reshape(-1, k)[:n], w)
    b = torch.randn(n) if bias else None

    def run(x, native):
        out = torch.empty(x.shape[0], n)
        torch.ops.atom.tile_linear_f32(out, x.contiguous(), packed, b, native)
        return out

    x = torch.randn(40, k)
    twin = run(x, native=False)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(twin.double(), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(run(x, native=True), twin)
    for begin, end in [(0, 1), (3, 5), (1, 4), (0, 4), (0, 5), (2, 9), (0, 6), (7, 20), (5, 40)]:
        assert torch.equal(run(x[begin:end], native=True), twin[begin:end]), f"{begin}:{end}"


def test_a_weight_packed_for_another_shape_or_type_is_refused():
    w, _ = random_quantized(32, 64, gguf.GGMLQuantizationType.Q4_1)
    packed = pack_tile_qweight(w)
    with pytest.raises(RuntimeError, match="x must be"):
        linear(torch.randn(2, 96), packed, gguf.GGMLQuantizationType.Q4_1, 32, None, True)
    with pytest.raises(RuntimeError, match="packed as tiles of type"):
        linear(torch.randn(2, 64), packed, gguf.GGMLQuantizationType.Q8_0, 32, None, True)
    with pytest.raises(RuntimeError, match="has no tiles"):
        linear(torch.randn(2, 64), packed, gguf.GGMLQuantizationType.Q2_K, 32, None, True)
    with pytest.raises(RuntimeError, match="packed as tiles of type 12"):  # Q4_1's tiles are not Q4_K's
        linear(torch.randn(2, 64), packed, gguf.GGMLQuantizationType.Q4_K, 32, None, True)
    panels = pack_f32_tile_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.atom.tile_linear_f32(torch.empty(2, 32), torch.randn(2, 96), panels, None, True)
    with pytest.raises(RuntimeError, match="packed as panels"):
        torch.ops.atom.tile_linear_f32(torch.empty(2, 32), torch.randn(2, 64), panels.bfloat16(), None, True)
