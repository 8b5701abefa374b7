"""GGUF weights kept quantized: the blocks against gguf's own dequantizer, the
CPU kernels against the dequantized reference, and models loaded quantized
against the dequantized path."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support_gguf import K_QUANTS, QTYPES, quantize_k, random_quantized, tiny_wide_ggufs
from support_models import CPU_COMBINATIONS, assert_greedy_close

from atom_anyio import LLM, SamplingParams, kernels
from atom_anyio.models import quant
from atom_anyio.models.gguf_file import GGUFReader
from atom_anyio.models.loader import load_model
from atom_anyio.models.ops import BatchInvariantCpuOps, CpuOps, TorchOps
from atom_anyio.models.quant import BLOCK_BYTES, QuantizedWeight, QuantLinear

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def cpu_kernels():
    if reason := kernels.load_cpu_kernels():
        pytest.skip(f"no CPU kernels here: {reason}")


def gemv_tolerance(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The GEMV rounds each block of 32 activations to int16 steps of max|x| / 32767, so an output is off by at
    most sum over blocks of step / 2 * sum |d q| (q the block's integer weights), plus float32 rounding."""
    n, k = w.shape
    d = w.data.view(n, k // 32, BLOCK_BYTES[w.qtype])[..., :2].contiguous().view(torch.float16).float()[..., 0]
    q_max = 128 if w.qtype == Q.Q8_0 else 15
    step = x.abs().view(x.shape[0], k // 32, 32).amax(-1) / 32767  # [M, blocks]
    return (step / 2) @ (32 * q_max * d.abs()).t() + 1e-5 * x.abs() @ w.dequantize().abs().t()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_dequantize_bit_for_bit(qtype, cpu_kernels):
    w, reference = random_quantized(48, 96, qtype)
    assert torch.equal(w.dequantize(), reference)  # the portable path: the zero point / min convention is gguf's
    assert torch.equal(CpuOps.dequantize(w), reference)
    assert torch.equal(CpuOps.dequantize(w.to(dtype=torch.bfloat16)), reference.bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_gemv_of_a_few_rows_is_within_the_int16_activation_bound(qtype, rows, cpu_kernels):
    w, reference = random_quantized(100, 192, qtype, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(100)
    out = CpuOps.linear(x, QuantLinearLike(w, bias))
    expected = F.linear(x, reference, bias)
    error = (out - expected).abs()
    assert (error <= gemv_tolerance(x, w)).all(), error.max()
    assert error.max() < 1e-3 * expected.abs().max()  # and far below the quantization error of the weights


@pytest.mark.parametrize("rows", [5, 8, 9, 16, 37, 130])  # 37, 130: the AVX2 tiles; 130: past a block of rows
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_the_gemv_at_any_row_count_gives_each_row_its_bits_alone(qtype, rows, cpu_kernels):
    """Batch-invariant float32 rows go through the GEMV's arithmetic at any count (as a blocked GEMM
    past four, sixteen lanes where the CPU has AVX512; past 32 a tiled GEMM on AVX2): each row's
    outputs are the bits of that row alone, through the 1-row GEMV, whatever the other rows; a dense
    copy beside the blocks is not read. Batch invariance of every GGUF linear in float32 rests on it."""
    # a tail past the last four weight rows; odd counts: an odd number of W's rows and of blocks a row
    # (the AVX2 tiles' zero partner row and the even blocks' chain taking the last block)
    n, k = (101, 1056) if rows % 2 else (100, 1024)
    w, reference = random_quantized(n, k, qtype, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(n)
    layer = QuantLinearLike(w, bias)
    out = BatchInvariantCpuOps.linear(x, layer)
    assert (((out - F.linear(x, reference, bias)).abs()) <= gemv_tolerance(x, w) + 1e-4).all()
    for i in range(rows):
        assert torch.equal(out[i], CpuOps.linear(x[i : i + 1], layer)[0]), f"row {i} of {rows}"
    assert torch.equal(out[3:7], CpuOps.linear(x[3:7], layer))  # four rows: the GEMV's own four-row form
    with_copy = QuantLinearLike(replace(w, dense=reference), bias)
    assert torch.equal(BatchInvariantCpuOps.linear(x, with_copy), out)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_bfloat16_gemv_is_the_float32_gemv_rounded(qtype, rows, bias, cpu_kernels):
    """bfloat16 rows run the float32 GEMV inside the kernel (widened exactly, rounded back as .to
    rounds): the same bits as converting around it."""
    w, _ = random_quantized(100, 192, qtype, seed=rows)
    x = (torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    b = torch.randn(100).bfloat16() if bias else None
    out = CpuOps.linear(x, QuantLinearLike(w.to(dtype=torch.bfloat16), b))
    expected = CpuOps.linear(x.float(), QuantLinearLike(w, None if b is None else b.float())).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


@pytest.mark.parametrize("rows", [5, 64, 300])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_larger_bfloat16_batches_run_dequantized_slices_through_a_gemm(qtype, rows, cpu_kernels):
    """bfloat16 rows past four, over blocks without a dense copy: slices dequantized in bfloat16, each
    through torch's GEMM (float32 rows take the GEMV's arithmetic at any count instead)."""
    n = quant.slice_rows(64) * 2 + 7  # slices that do not divide the rows
    w, reference = random_quantized(n, 64, qtype)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    layer = QuantLinearLike(w.to(dtype=torch.bfloat16), None)
    out = CpuOps.linear(x, layer)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, reference.bfloat16()), rtol=2**-7, atol=1e-2)
    assert torch.equal(CpuOps.lm_head(x, layer), out)


def test_torch_ops_dequantize_on_the_fly_to_the_same_bits():
    w, reference = random_quantized(40, 64, Q.Q4_1)
    x = torch.randn(3, 64)
    assert torch.equal(TorchOps.linear(x, QuantLinearLike(w, None)), F.linear(x, reference))


def test_packing_concatenates_blocks_and_dequantizes_mixed_types():
    q, q_ref = random_quantized(8, 64, Q.Q4_1, seed=1)
    k, k_ref = random_quantized(4, 64, Q.Q4_1, seed=2)
    v, v_ref = random_quantized(4, 64, Q.Q8_0, seed=3)
    packed = torch.cat([q, k])
    assert isinstance(packed, QuantizedWeight) and packed.shape == (12, 64)
    assert torch.equal(packed.dequantize(), torch.cat([q_ref, k_ref]))
    mixed = torch.cat([q, k, v])
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([q_ref, k_ref, v_ref]))


class QuantLinearLike(QuantLinear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__(weight, has_bias=False)
        self.bias = bias


# K-quants: super-blocks of 256 (gguf has no quantizer for them: random blocks, or support_gguf's quantize_k)


def random_k_quantized(n: int, k: int, qtype: Q, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random super-blocks (every scale, minimum and weight bit random; float16 scales of about 0.01), and gguf's
    own dequantization of them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        blocks[..., :4] = d  # d, dmin
    else:
        blocks[..., 208:] = d[..., :2]  # d
    blocks = blocks.reshape(n, -1)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
    return QuantizedWeight(torch.from_numpy(blocks), qtype, torch.Size((n, k))), reference


def k_gemv_tolerance(x: torch.Tensor, w: QuantizedWeight, reference: torch.Tensor) -> torch.Tensor:
    """As ``gemv_tolerance``: step / 2 per activation times |s q| = |w - m| <= |w| + |m| per weight, where
    Q4_K's minimum is at most 63 dmin and Q6_K has none."""
    n, k = w.shape
    scaled = reference.abs()
    if w.qtype == Q.Q4_K:
        dmin = w.data.view(n, k // 256, 144)[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        scaled = scaled + (63 * dmin.abs()).repeat_interleave(256, dim=1)
    step = x.abs().view(x.shape[0], k // 32, 32).amax(-1).repeat_interleave(32, dim=1) / 32767
    return (step / 2) @ scaled.t() + 1e-5 * x.abs() @ reference.abs().t()


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_dequantize_equals_gguf_dequantize_bit_for_bit(qtype, cpu_kernels):
    w, reference = random_k_quantized(24, 512, qtype)
    assert torch.equal(w.dequantize(), reference)
    assert torch.equal(CpuOps.dequantize(w), reference)
    assert torch.equal(CpuOps.dequantize(w.to(dtype=torch.bfloat16)), reference.bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 40])  # past four, batch-invariant: four rows at a time
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_gemv_is_within_the_int16_activation_bound(qtype, rows, cpu_kernels):
    w, reference = random_k_quantized(50, 768, qtype, seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(50)
    out = BatchInvariantCpuOps.linear(x, QuantLinearLike(w, bias))
    expected = F.linear(x, reference, bias)
    error = (out - expected).abs()
    assert (error <= k_gemv_tolerance(x, w, reference)).all(), error.max()
    assert error.max() < 1e-3 * expected.abs().max()
    for i in range(rows):
        assert torch.equal(out[i], CpuOps.linear(x[i : i + 1], QuantLinearLike(w, bias))[0]), f"row {i} of {rows}"


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_bfloat16_batches_run_dequantized_slices_through_a_gemm(qtype, cpu_kernels):
    n = quant.slice_rows(256) * 2 + 5
    w, reference = random_k_quantized(n, 256, qtype)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = CpuOps.linear(x, QuantLinearLike(w.to(dtype=torch.bfloat16), None))
    torch.testing.assert_close(out, F.linear(x, reference.bfloat16()), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_quantize_k_round_trips_through_gguf_dequantize(qtype):
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_k(w, qtype), qtype)
    assert np.abs(back - w).max() < (0.25 if qtype == Q.Q4_K else 0.08) * np.abs(w).max()


# models


@pytest.fixture(scope="module")
def tiny_k_quant_gguf(tmp_path_factory):
    return tiny_wide_ggufs(tmp_path_factory.mktemp("kquant"), K_QUANTS)


PROMPTS = [[258, 72, 101, 108], [259, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106], [260, 7]]


def greedy_outputs(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    return [out.outputs[0] for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_packed_gguf_stays_quantized_and_float32_dequantizes(tiny_chat_gguf, qtype):
    quantized = load_model(tiny_chat_gguf[qtype], dtype="float32", gguf_weights="packed")
    layer = quantized.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear) and layer.mlp.gate_up_proj.weight.qtype == qtype
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)  # packed q/k/v stay quantized
    assert layer.mlp.gate_up_proj.weight.dense is None
    dequantized = load_model(tiny_chat_gguf[qtype], dtype="float32")  # a named dtype dequantizes
    assert type(dequantized.model.model.layers[0].mlp.gate_up_proj) is torch.nn.Linear
    assert quant.weight_bytes(quantized.model) < quant.weight_bytes(dequantized.model) / 2


def test_auto_keeps_blocks_and_adds_a_dense_copy_for_batched_gemms(tiny_chat_gguf):
    """auto on this CPU: bfloat16 where it has native bfloat16, float32 elsewhere, and in either a
    dense copy beside the blocks (on the cpu backend in bfloat16 packed in its place, for the AMX
    GEMM or oneDNN; without AMX the tile GEMM's blocks' chain reads the blocks, and the copy goes);
    ``both`` forces the copy, with the same bits."""
    auto = load_model(tiny_chat_gguf[Q.Q4_1], dtype="auto").model
    layer = auto.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer.weight, QuantizedWeight)
    assert layer.weight.dtype == (torch.bfloat16 if kernels.has_native_bf16() else torch.float32)
    packed = [getattr(layer, name, None) for name in ("packed_weight", "tile_weight", "tile_qweight")]
    assert layer.weight.dense is not None or any(p is not None for p in packed)
    both = load_model(tiny_chat_gguf[Q.Q4_1], dtype="bfloat16", gguf_weights="both", attention_backend="torch").model
    w = both.model.layers[0].mlp.gate_up_proj.weight
    assert w.dense.dtype == torch.bfloat16
    assert torch.equal(w.dense, replace(w, dense=None).dequantize())
    assert quant.dense_bytes(both) > 0


def tiny_llm(path, combination: str, attention_backend: str) -> LLM:
    dtype, gguf_weights = CPU_COMBINATIONS[combination]
    return LLM(str(path), dtype=dtype, gguf_weights=gguf_weights, attention_backend=attention_backend, num_kv_blocks=32)


def assert_quantized_greedy_matches(path) -> None:
    """float32 over packed blocks on the torch ops: the same bits as the float path; on the kernels
    (whose GEMV rounds activations to int16 per block) and in bfloat16: close, the standard way."""
    reference = greedy_outputs(tiny_llm(path, "float32+dequantize", "torch"))
    packed = greedy_outputs(tiny_llm(path, "float32+packed", "torch"))
    assert [o.token_ids for o in packed] == [o.token_ids for o in reference]  # dequantized on the fly
    if kernels.load_cpu_kernels() is not None:
        return
    assert_greedy_close(greedy_outputs(tiny_llm(path, "float32+packed", "cpu")), reference)
    bf16_reference = greedy_outputs(tiny_llm(path, "bfloat16+dequantize", "torch"))
    for combination in ("bfloat16+packed", "bfloat16+both"):
        assert_greedy_close(greedy_outputs(tiny_llm(path, combination, "cpu")), bf16_reference)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_quantized_greedy_equals_the_dequantized_path(tiny_chat_gguf, qtype):
    assert_quantized_greedy_matches(tiny_chat_gguf[qtype])


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_model_stays_packed_and_greedy_equals_the_dequantized_path(tiny_k_quant_gguf, qtype):
    path = tiny_k_quant_gguf[qtype]
    quantized = load_model(path, dtype="float32", gguf_weights="packed").model
    layers = [m for m in quantized.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4 + 1 and all(m.weight.qtype == qtype for m in layers)  # qkv, o, gate_up, down; head
    assert isinstance(quantized.model.embed_tokens, quant.QuantEmbedding)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert quant.weight_bytes(quantized) <= 1.3 * file_bytes
    assert_quantized_greedy_matches(path)


def test_types_without_a_kernel_load_dequantized(tiny_chat_gguf):
    loaded = load_model(tiny_chat_gguf[Q.Q5_0], dtype="auto")
    assert not any(isinstance(m, QuantLinear) for m in loaded.model.modules())


@pytest.mark.slow
def test_smollm2_q4_1_served_quantized_answers_and_fits_its_file(smollm2_path):
    llm = LLM(smollm2_path, gguf_weights="packed")  # dtype "auto" picks the activations; the blocks alone
    model = llm.loaded.model
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, quant.QuantEmbedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied head reads the Q8_0 embedding
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(smollm2_path).tensors)
    assert quant.weight_bytes(model) <= 1.3 * file_bytes
    activations = "bfloat16" if kernels.has_native_bf16() else "float32"
    assert model.dtype_name == f"{activations}+Q4_1+Q8_0"  # what /version reports
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY_STOP)
    assert "Paris" in out.outputs[0].text


GREEDY_STOP = SamplingParams(temperature=0, max_tokens=16)


def test_the_gguf_reader_reads_what_the_gguf_package_reads(smollm2_path):
    """``gguf_file.GGUFReader`` (plain views of the map) gives ``gguf.GGUFReader``'s fields and tensors."""
    ours, theirs = GGUFReader(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert ours.fields.keys() == theirs.fields.keys() and len(theirs.fields["tokenizer.ggml.tokens"].data) == 49152
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert len(mine.parts) == len(field.parts), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), (
            name
        )
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in theirs.tensors
    ]
    assert all(
        a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
        for a, b in zip(ours.tensors, theirs.tensors, strict=True)
    )
