"""The C++ CPU kernels against their references (the portable torch attention
and ``TorchOps``), the backend choice, and the fallback without a compiler."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import gguf
import pytest
import torch
import torch.nn.functional as F
from support_gguf import random_quantized
from torch.utils import cpp_extension

from atom_anyio import LLM, SamplingParams, kernels
from atom_anyio.config import Config
from atom_anyio.models.attention import (
    AttentionMetadata,
    CpuPagedAttention,
    TorchPagedAttention,
    select_backend,
)
from atom_anyio.models.ops import (
    BatchInvariantCpuOps,
    CpuOps,
    TorchOps,
    can_pack_bf16,
    pack_tile_qweight,
    pack_tile_weight,
    tile_linear,
    tile_qlinear,
    unpack_tile_weight,
)
from atom_anyio.models.plan import resolve_dtype
from atom_anyio.models.quant import QuantLinear
from atom_anyio.settings import ConfigError


@pytest.fixture(scope="module", autouse=True)
def built():
    if (error := kernels.load_cpu_kernels()) is not None:
        pytest.skip(f"the CPU kernels could not be built here: {error}")


def paged_step(
    query_lens: list[int],
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shared_prefix_blocks: int = 0,
):
    """A random step over a paged cache whose blocks are scattered (shuffled);
    the first ``shared_prefix_blocks`` blocks of every sequence are the same
    physical blocks, as after prefix-cache hits."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=g).tolist()
    shared, order = order[:shared_prefix_blocks], order[shared_prefix_blocks:]
    tables = []
    for n in need:
        own = n - shared_prefix_blocks
        tables.append(shared + order[:own])
        order = order[own:]
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(tables, context_lens, query_lens, block_size, torch.device("cpu"))
    return q, k, v, k_cache, v_cache, meta


def cpu_both_ways(q, k, v, k_cache, v_cache, meta, **kwargs) -> torch.Tensor:
    """The cpu backend's output with prefill chunks through SDPA (``cpu``) and through the
    kernel (``cpu_paged``), stacked: each is checked against the reference."""
    outs = [
        CpuPagedAttention(paged_prefill).forward(q, k, v, k_cache, v_cache, meta, **kwargs)
        for paged_prefill in (False, True)
    ]
    return torch.stack(outs)


def both(step) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, k_cache, v_cache, meta = step
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_k, ref_v, meta)
    out = cpu_both_ways(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the step's K/V written alike
    return out, ref.expand_as(out)


LAYOUTS = {
    # decodes only, contexts across block boundaries
    "decodes": ([1, 1, 1, 1], [2, 16, 17, 95]),
    # decodes and prefill chunks in one step: a fresh prompt and a chunk over a computed prefix
    "mixed": ([1, 1, 9, 40], [300, 33, 9, 140]),
    # one chunk that starts mid-block
    "chunk_mid_block": ([23], [61]),
    # a fresh prompt alone (the portable path's plain causal case)
    "fresh": ([37], [37]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 4), (32, 32)])
def test_cpu_attention_equals_the_portable_path(layout, heads, kv_heads, head_dim, block_size):
    query_lens, context_lens = LAYOUTS[layout]
    out, ref = both(paged_step(query_lens, context_lens, heads, kv_heads, head_dim, block_size))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_cpu_attention_over_shared_prefix_blocks_equals_the_portable_path():
    step = paged_step([1, 1, 30], [200, 260, 230], 8, 2, 64, 16, shared_prefix_blocks=10)
    out, ref = both(step)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("context", [4096, 32768])
def test_long_decodes_split_over_the_keys_equal_the_portable_path(context):
    # two long decodes and a short one: few sequences, so the kernel splits the keys and merges
    step = paged_step([1, 1, 1], [context, context - 5, 7], 4, 2, 64, 16, seed=3)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, ref = both(step)
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    finally:
        torch.set_num_threads(before)


def test_long_prefill_chunk_over_a_long_prefix_equals_the_portable_path():
    out, ref = both(paged_step([1, 300], [3000, 20000], 9, 3, 64, 16, seed=4))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def both_with(step, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, k_cache, v_cache, meta = step
    ref = TorchPagedAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, **kwargs)
    out = cpu_both_ways(q, k, v, k_cache, v_cache, meta, **kwargs)
    return out, ref.expand_as(out)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window", [1, 5, 16, 17, 64, 1000])  # within a chunk, across blocks, past every context
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(8, 2, 64, 16), (9, 3, 32, 4), (4, 4, 64, 32)])
def test_cpu_sliding_window_equals_the_portable_path(layout, window, heads, kv_heads, head_dim, block_size):
    query_lens, context_lens = LAYOUTS[layout]
    step = paged_step(query_lens, context_lens, heads, kv_heads, head_dim, block_size, seed=window)
    out, ref = both_with(step, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("window", [None, 7, 300])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpu_attention_sinks_equal_the_portable_path(layout, window):
    query_lens, context_lens = LAYOUTS[layout]
    step = paged_step(query_lens, context_lens, 8, 2, 64, 16, seed=5)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(6)) * 3
    out, ref = both_with(step, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("window", [100, 600, 5000])
def test_long_windowed_decodes_split_over_the_keys_equal_the_portable_path(window):
    step = paged_step([1, 1, 1, 40], [8000, 7995, 7, 6000], 4, 2, 64, 16, seed=7)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(8))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, ref = both_with(step, sliding_window=window, sinks=sinks)
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    finally:
        torch.set_num_threads(before)


# steps of few sequences: one partition, three (an odd count), the decodes and mixed layouts
FEW_ITEMS = {"one_partition": ([1], [50]), "three_partitions": ([1], [150]), **LAYOUTS}


@pytest.mark.parametrize("window,sinks", [(None, False), (40, True)], ids=["causal", "window-sinks"])
@pytest.mark.parametrize("layout", ["one_partition", "three_partitions", "decodes", "mixed"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (32, 8, 64, 16), (4, 1, 32, 4)])
def test_batch_invariant_calls_of_few_sequences_equal_the_portable_path(
    layout, heads, kv_heads, head_dim, block_size, window, sinks
):
    """Fixed key partitions (here 64 keys, so short contexts split too): a step of few sequences
    has too few partitions for the threads, and the kernel splits their rows over its tasks (cuts
    inside a kv head's rows too); on one, two or three threads every row equals the reference,
    a sliding window and sinks included."""
    query_lens, context_lens = FEW_ITEMS[layout]
    q, k, v, k_cache, v_cache, meta = paged_step(query_lens, context_lens, heads, kv_heads, head_dim, block_size)
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(9)) if sinks else None
    kwargs = {"sliding_window": window, "sinks": sink_logits}
    ref = TorchPagedAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, **kwargs)
    backend = CpuPagedAttention(batch_invariant=True)
    backend.partition = lambda meta: 64
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, **kwargs)
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_attention_in_16_bit_matches_a_float32_reference(dtype):
    q, k, v, k_cache, v_cache, meta = paged_step([1, 1, 12], [50, 70, 30], 8, 2, 64, 16, dtype=dtype)
    out = cpu_both_ways(q, k, v, k_cache, v_cache, meta)
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta)
    torch.testing.assert_close(out.float(), ref.expand_as(out), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [96, 204])  # 204: a tail past the last eight
def test_fused_ops_in_16_bit_round_as_the_torch_ops(dtype, width):
    """The kernels round to the 16-bit type in registers, to nearest even as torch does: the
    residual sum is the same bits, the norm and the activation within one rounding."""
    g = torch.Generator().manual_seed(width)
    x, res = (torch.randn(33, width, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(width, generator=g).to(dtype)
    got, got_res = CpuOps().add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    want, want_res = TorchOps.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(got_res, want_res)
    tol = {"atol": 1e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(CpuOps().rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5), **tol)
    gate_up = (torch.randn(33, 2 * 96, generator=g) * 4).to(dtype)
    torch.testing.assert_close(CpuOps().silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up), **tol)


def test_fused_ops_equal_the_torch_ops():
    g = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(7, 96, generator=g) for _ in range(3))
    w = w[0]
    torch.testing.assert_close(CpuOps().rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-6)
    got, got_res = CpuOps().add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    want, want_res = TorchOps.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    gate_up = torch.randn(7, 2 * 64, generator=g) * 4
    torch.testing.assert_close(CpuOps().silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up), atol=1e-6, rtol=1e-6)
    qkv = torch.randn(7, (4 + 2 * 2) * 32, generator=g)  # q, k as views of one projection, as in the model
    q, k = qkv[:, :128].view(7, 4, 32), qkv[:, 128:192].view(7, 2, 32)
    angles = torch.arange(7.0)[:, None] * torch.rand(16, generator=g)[None, :]
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = TorchOps.rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = CpuOps().rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_select_backend_names_and_refusals(monkeypatch):
    monkeypatch.delenv("ATOM_ATTENTION_BACKEND", raising=False)
    assert select_backend(torch.device("cpu")).name == "cpu"
    assert select_backend(torch.device("cpu"), "auto").name == "cpu"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    assert select_backend(torch.device("cpu"), "cpu_paged").paged_prefill
    with pytest.raises(ValueError, match="attention_backend must be one of auto, cpu, cpu_paged, torch"):
        select_backend(torch.device("cpu"), "flash")
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_backend(torch.device("meta"), "cpu")


@pytest.mark.parametrize(
    ("flags", "dtype", "kernel_prefill", "amx_prefill"),
    [
        ("avx2 avx512f avx512_bf16", torch.bfloat16, True, False),  # AMD Zen 4/5: the kernel's bfloat16 dot products
        # AMX: the kernel on the tiles (SDPA when cpu_amx=false)
        ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", torch.bfloat16, False, True),
        ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", torch.float32, False, False),
        ("avx2 avx512f avx512_bf16", torch.float32, False, False),
        ("avx2 avx512f", torch.float32, False, False),  # Xeon without BF16: SDPA's AVX512 GEMMs
        ("avx2 fma", torch.float32, True, False),  # AMD Zen 3: the kernel's AVX2 code
        ("avx2 fma", torch.bfloat16, False, False),
    ],
)
def test_auto_picks_the_prefill_path_by_the_cpu_and_dtype(monkeypatch, flags, dtype, kernel_prefill, amx_prefill):
    """``auto`` decides what a CPU of each kind gets, whatever CPU runs the test; what it picks
    is forceable by name (``cpu`` / ``cpu_paged``), and both are tested on this CPU below."""
    monkeypatch.delenv("ATOM_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: f"flags : {flags}")
    variants = ["paged_attention_avx512_bf16"] if "avx512_bf16" in flags else []
    variants += ["paged_attention_amx_bf16"] if "amx_bf16" in flags else []
    monkeypatch.setattr(kernels, "native_kernels", lambda: variants)
    monkeypatch.setattr(kernels, "has_amx_attention", lambda: "paged_attention_amx_bf16" in variants)
    backend = select_backend(torch.device("cpu"), "auto", dtype=dtype)
    assert backend.paged_prefill == kernel_prefill
    assert backend.amx_prefill == amx_prefill
    assert backend.name == ("cpu_paged" if kernel_prefill else "cpu")
    assert not select_backend(torch.device("cpu"), "cpu", dtype=dtype).paged_prefill
    assert select_backend(torch.device("cpu"), "cpu_paged", dtype=dtype).paged_prefill


@pytest.mark.skipif(
    "paged_attention_amx_bf16" not in kernels.native_kernels(), reason="paged_attention_amx_bf16: no AMX tiles here"
)
def test_amx_prefill_follows_the_tiles_setting():
    """auto's AMX backend runs prefill chunks in the kernel while the tiles serve it, and through
    SDPA when cpu_amx=false turns them off (the AVX512-BF16 variant's prefill is slower),
    or when the step starts a long prompt (SDPA's causal blocks are faster there)."""
    backend = CpuPagedAttention(amx_prefill=True)

    def in_kernel(query_lens, context_lens):
        return backend.runs_in_kernel(paged_step(query_lens, context_lens, 9, 3, 64, 16, dtype=torch.bfloat16)[-1])

    assert in_kernel([1, 40], [300, 90])  # a chunk over a cached prefix
    assert in_kernel([1, 600], [300, 600])  # a short fresh prompt
    assert in_kernel([1, 1500], [300, 2000])  # a long chunk over a cached prefix
    assert not in_kernel([1, 1100], [300, 1100])  # a long fresh prompt
    backend = CpuPagedAttention(amx_prefill=True, amx=False)
    assert not in_kernel([1, 40], [300, 90])


def test_environment_variable_picks_the_offline_llms_backend(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("ATOM_ATTENTION_BACKEND", "torch")
    assert LLM(str(tiny_model_dir), num_kv_blocks=8).loaded.model.attention_backend.name == "torch"
    assert Config.from_env().attention_backend == "torch"  # the server's, read in config.py


FALLBACK = """
import json, torch
from atom_anyio import LLM
from atom_anyio.config import Config
from atom_anyio import kernels
from atom_anyio.models.attention import select_backend
error = kernels.load_cpu_kernels()
backend = select_backend(torch.device("cpu"))
try:
    select_backend(torch.device("cpu"), "cpu")
    explicit = None
except RuntimeError as exc:
    explicit = str(exc)
print(json.dumps({"error": error, "backend": backend.name, "ops": backend.ops.name, "explicit": explicit}))
"""


def test_without_a_compiler_auto_falls_back_to_the_portable_path(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    env.pop("ATOM_ATTENTION_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["error"] and result["backend"] == "torch" and result["ops"] == "torch"
    assert "attention_backend 'cpu' is unavailable" in result["explicit"]
    assert "kernels.unavailable" in run.stdout + run.stderr  # one clear log line


def test_each_ninja_on_path_has_its_own_cache_entry(tmp_path, monkeypatch):
    """torch builds with the ninja on PATH, and two ninja versions drop each other's build log:
    a server started outside the venv (the system's ninja) and the suite inside it (the venv's)
    must not share one entry, or each start rebuilds it."""
    name = kernels.build_name()
    assert kernels.build_name() == name  # stable while nothing changes
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.10.0\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert kernels.build_name() != name


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    """A build killed midway leaves ``lock`` in its build directory, and torch waits on it forever,
    even with the build cached: an old one is removed, said in one line, and the kernels load."""
    if kernels.load_cpu_kernels() is not None:
        pytest.skip("the kernels cannot be built here")
    lock = kernels.build_directory(kernels.build_name()) / "lock"
    lock.touch()
    old = time.time() - kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    load = "from atom_anyio import kernels; print(kernels.load_cpu_kernels())"
    try:
        run = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120)
    finally:
        lock.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "None"
    assert "kernels.stale_lock_removed" in run.stdout + run.stderr


def test_a_young_lock_is_left_to_the_build_that_holds_it(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    kernels.clear_stale_lock(tmp_path)
    assert lock.exists()


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 7])  # 0: a step whose chunks sample nothing
@pytest.mark.parametrize("bias", [False, True])
def test_linear_streams_few_rows_and_equals_torch(rows, bias):
    layer = torch.nn.Linear(96, 37, bias=bias)  # an odd width: the last weight rows take the tail path
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        torch.testing.assert_close(CpuOps.linear(x, layer), TorchOps.linear(x, layer), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [5, 8, 9, 16, 37, 300])  # 300: past a block of rows (the GEMM's L2 tile)
@pytest.mark.parametrize("width", [96, 1536])
def test_float32_linear_at_any_row_count_gives_each_row_its_bits_alone(rows, width):
    """Batch-invariant float32 rows go through the GEMV's arithmetic at any count (as a blocked GEMM
    past four, two rows to a sixteen-lane register where the CPU has AVX512): each row's outputs are
    the bits of that row alone, through the 1-row GEMV, whatever the other rows; close to torch's GEMM."""
    layer = torch.nn.Linear(width, 37)  # an odd width: the last weight rows take the tail path
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        out = BatchInvariantCpuOps.linear(x, layer)
        torch.testing.assert_close(out, TorchOps.linear(x, layer), atol=1e-5, rtol=1e-5)
        for i in range(rows):
            assert torch.equal(out[i], CpuOps.linear(x[i : i + 1], layer)[0]), f"row {i} of {rows}"
        assert torch.equal(BatchInvariantCpuOps.lm_head(x, layer), out)


@pytest.mark.parametrize("rows", [1, 4, 5, 16])
def test_lm_head_in_vocabulary_slices_equals_one_gemm(rows):
    head = torch.nn.Linear(64, 3 * CpuOps.LOGITS_SLICE + 5, bias=False)  # a partial last slice
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        torch.testing.assert_close(CpuOps.lm_head(x, head), TorchOps.lm_head(x, head), atol=1e-5, rtol=1e-5)


NATIVE_ELEMENTWISE = "elementwise_avx512"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def elementwise_ops(dtype: torch.dtype, width: int, head_dim: int, ops: CpuOps) -> list[torch.Tensor]:
    """Every elementwise op of ``ops`` once on rows with large, tiny, infinite and NaN values."""
    g = torch.Generator().manual_seed(width + head_dim)
    x, res = (torch.randn(37, width, generator=g) * 3 for _ in range(2))
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-30, 3e38])
    x, res = x.to(dtype), res.to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    gate_up = (torch.randn(37, 2 * width, generator=g) * 40).to(dtype)  # past exp's clamp at -88
    gate_up[1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")]).to(dtype)
    heads, kv_heads = 3, 1
    qkv = (torch.randn(37, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[:, : heads * head_dim].view(37, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(37, kv_heads, head_dim)
    angles = torch.arange(37.0)[:, None] * torch.rand(head_dim // 2, generator=g)[None, :]
    normed, residual = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    rotated = ops.rotary(q.clone(), k.clone(), angles.cos(), angles.sin())
    return [ops.rms_norm(x, w, 1e-5), normed, residual, ops.silu_and_mul(gate_up), *rotated]


@pytest.mark.skipif(
    NATIVE_ELEMENTWISE not in kernels.native_kernels(), reason=f"{NATIVE_ELEMENTWISE}: this CPU has no AVX512F/BW"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,head_dim", [(576, 64), (200, 40), (64, 128), (24, 16)])  # 200, 40, 24: 8-lane tails
def test_native_elementwise_ops_equal_their_portable_twins_bit_for_bit(dtype, width, head_dim):
    """The sixteen-lane variant of rms_norm, add_rms_norm, silu_and_mul and rotary computes each
    lane with the portable code's operations in its order: the same bits, NaN and infinities included."""
    native = elementwise_ops(dtype, width, head_dim, CpuOps(native=True))
    portable = elementwise_ops(dtype, width, head_dim, CpuOps(native=False))
    for a, b in zip(native, portable, strict=True):
        assert torch.equal(bits(a), bits(b))


NATIVE_ATTENTION = "paged_attention_avx512_bf16"
AMX_ATTENTION = "paged_attention_amx_bf16"
# the bfloat16 variants a decode can take: AVX512-BF16 (AMD Zen 4/5, and AMX CPUs with
# cpu_amx=false) and the AMX tiles (decodes on a Xeon with AMX), each skipped by name
# where the CPU cannot run it
BF16_VARIANTS = [
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(
            NATIVE_ATTENTION not in kernels.native_kernels(), reason=f"{NATIVE_ATTENTION}: this CPU has no AVX512-BF16"
        ),
    ),
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(
            AMX_ATTENTION not in kernels.native_kernels(), reason=f"{AMX_ATTENTION}: no AMX tiles on this CPU or OS"
        ),
    ),
]


@pytest.fixture
def bf16_variant(request) -> bool:
    """The ``amx`` switch that runs the test's decodes on the variant its ``variant`` parameter names."""
    return request.getfixturevalue("variant") == "amx"


@pytest.mark.parametrize("variant", BF16_VARIANTS)
@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (17, True), (None, True)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 2, 16, 4), (4, 4, 32, 32)]
)
def test_native_bf16_attention_equals_its_portable_twin(
    layout, window, sinks, heads, kv_heads, head_dim, block_size, variant, bf16_variant
):
    """The AVX512-BF16 variant (pair dot products, 16-wide values), or the AMX one for the
    decodes, against the portable AVX2 code on the same bfloat16 step, prefill rows through the
    kernel too: within a rounding of the bfloat16 output."""
    query_lens, context_lens = LAYOUTS[layout]
    q, k, v, k_cache, v_cache, meta = paged_step(
        query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16, seed=11
    )
    kwargs = {"sliding_window": window, "sinks": torch.randn(heads) if sinks else None}
    native = CpuPagedAttention(paged_prefill=True, amx=bf16_variant).forward(q, k, v, k_cache, v_cache, meta, **kwargs)
    portable = CpuPagedAttention(paged_prefill=True, native=False).forward(q, k, v, k_cache, v_cache, meta, **kwargs)
    assert not torch.equal(native, torch.zeros_like(native))
    torch.testing.assert_close(native.float(), portable.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", BF16_VARIANTS)
@pytest.mark.parametrize("context", [4096, 20000])
def test_native_bf16_long_decodes_split_over_the_keys_equal_the_float32_reference(context, variant, bf16_variant):
    q, k, v, k_cache, v_cache, meta = paged_step(
        [1, 1, 1], [context, context - 5, 7], 9, 3, 64, 16, dtype=torch.bfloat16
    )
    out = CpuPagedAttention(amx=bf16_variant).forward(q, k, v, k_cache, v_cache, meta)
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", BF16_VARIANTS)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size", [(4, 2, 64, 16), (32, 8, 64, 16), (16, 1, 128, 32), (9, 3, 64, 64)]
)
def test_bf16_decodes_ignore_what_the_slots_past_their_keys_hold(
    heads, kv_heads, head_dim, block_size, variant, bf16_variant
):
    """Decodes whose last chunk of keys is partial, over a cache whose every other slot holds NaN
    (what a freed block may hold): the AMX variant loads whole 16-key tiles, so the keys past a
    sequence must be masked and its values past them never multiplied. Contexts across the
    softmax steps' 128-key edges, rows in one and in several 16-lane blocks, a group of 16."""
    contexts = [15, 127, 128, 129, 300, 1001, 2]  # (a context of 1 would be a prefill: no kernel)
    q, k, v, k_cache, v_cache, meta = paged_step(
        [1] * len(contexts), contexts, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16, seed=5
    )
    valid = torch.zeros(k_cache.shape[0], dtype=torch.bool)
    for table, context in zip(meta.block_tables.tolist(), contexts, strict=True):
        for key in range(context):
            valid[table[key // block_size] * block_size + key % block_size] = True
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta)
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")
    out = CpuPagedAttention(amx=bf16_variant).forward(q, k, v, k_cache, v_cache, meta)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(AMX_ATTENTION not in kernels.native_kernels(), reason=f"{AMX_ATTENTION}: no AMX tiles here")
def test_the_amx_decode_leaves_the_tiles_as_torch_set_them():
    """torch's own AMX code (oneDNN's GEMMs, its flash SDPA) runs on the same thread as the
    kernel's tiles: after a decode it answers as before (the kernel puts back the tile shapes it
    found, in case a library keeps them configured between its calls; torch 2.13 re-configures)."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 512).bfloat16(), torch.randn(512, 256).bfloat16()
    qs, ks, vs = (torch.randn(1, 4, 200, 64).bfloat16() for _ in range(3))

    def torch_work():
        return a @ b, F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    before = torch_work()
    step = paged_step([1, 1], [300, 40], 9, 3, 64, 16, dtype=torch.bfloat16)
    decoded = CpuPagedAttention().forward(*step)
    after = torch_work()
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert torch.equal(decoded, CpuPagedAttention().forward(*step))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_writes_what_index_copy_writes(dtype):
    """The cpu backend's one-call store of a step's keys and values (views of the qkv rows, token
    stride wider than a row) leaves the caches as the two index_copy_ calls do; a slot past the
    cache is an error naming it, before anything is written."""
    torch.manual_seed(0)
    slots, kv_heads, head_dim, tokens = 64, 3, 32, 20
    qkv = torch.randn(tokens, (6 + 2 * kv_heads) * head_dim).to(dtype)
    _, k, v = qkv.split([6 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    mapping = torch.randperm(slots)[:tokens]
    caches = [torch.randn(slots, kv_heads, head_dim).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    expected[0].index_copy_(0, mapping, k)
    expected[1].index_copy_(0, mapping, v)
    torch.ops.atom.store_kv(caches[0], caches[1], k, v, mapping)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected, strict=True))
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match=f"slot {slots} is out of the cache"):
        torch.ops.atom.store_kv(caches[0], caches[1], k[:2], v[:2], torch.tensor([0, slots]))
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))


# Other CPU kinds' builds, by -march: what auto builds on a Zen 3 (AVX2 only) and on a Zen 4/5
# (AVX512-BF16, no AMX); the host's own build (-march=native) is the one loaded above
OTHER_CPU_KINDS = {
    "x86-64-v3": "AVX2, no AVX512 (Zen 3)",
    "skylake-avx512": "AVX512, no BF16 or VNNI (Skylake Xeon; its VNNI branch builds natively on a Zen 4 or Xeon)",
    "cooperlake": "AVX512-BF16, no AMX (Zen 4/5)",
    "sapphirerapids": "AMX, AVX512-BF16 and GFNI (Sapphire Rapids Xeon; GFNI as a Zen 4/5 has it)",
}


@functools.cache
def branch_macros() -> frozenset[str]:
    """The instruction-set macros the kernel sources test (``__AVX2__``, ``__AMX_TILE__``, ``__GFNI__``, ...)."""
    return frozenset(
        m for source in kernels.CSRC.iterdir() for m in re.findall(r"__(?:AVX|FMA|AMX|GFNI)\w*__", source.read_text())
    )


def isa_branches(march: str) -> frozenset[str]:
    """The macros the kernel sources branch on that ``-march`` defines: two kinds with the same set
    compile the same code."""
    defined = subprocess.run(
        ["c++", f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, check=True
    ).stdout
    return frozenset(macro for macro in branch_macros() if f"#define {macro} " in defined)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None, reason="an x86-64 C++ compiler"
)
def test_the_kernels_compile_for_the_other_cpu_kinds():
    """Every source compiles with the flags each other CPU kind's build gets (a #ifdef'd variant's
    names used outside their #ifdef had broken the build on every CPU without AMX while the
    suite passed on one with it). Syntax only, every source and kind at once; a kind whose ISA
    branches are those of the build loaded here (``kernels.compiler_flags``) was compiled by it."""
    assert kernels.load_cpu_kernels() is None
    built = isa_branches(kernels.compiler_flags()[-1].removeprefix("-march="))
    assert "__AVX2__" in built and "__FMA__" in built
    includes = [f"-I{path}" for path in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    flags = [f for f in kernels.FLAGS if f not in ("-O3", "-march=native")] + ["-std=c++20", "-fsyntax-only"]
    runs = {
        (arch, source.name): subprocess.Popen(
            ["c++", *flags, f"-march={arch}", *includes, str(source)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in OTHER_CPU_KINDS
        if isa_branches(arch) != built
        for source in kernels.SOURCES
        if "vec.h" in source.read_text() or "amx.h" in source.read_text()  # the ones with ISA branches
    }
    assert {name for _, name in runs} == {"paged_attention.cpp", "ops.cpp", "quant.cpp", "gemm.cpp", "registry.cpp"}
    assert len(runs) >= 10  # two kinds at least are not this CPU's
    failed = {key: run.communicate()[1] for key, run in runs.items()}
    failed = {key: err for key, err in failed.items() if runs[key].returncode != 0}
    assert not failed, "\n".join(
        f"{arch} ({OTHER_CPU_KINDS[arch]}) {name}:\n{err[:2000]}" for (arch, name), err in failed.items()
    )


XEON = "flags : fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_fp16 amx_bf16 amx_tile"


@pytest.fixture
def kernel_isa(monkeypatch):
    """Set ATOM_KERNEL_ISA for the test (on a host of ``XEON``'s flags unless the test says other),
    the cached reading cleared before and after."""

    def use(isa: str, host: str = XEON) -> None:
        monkeypatch.setattr(kernels, "host_flags", lambda: host)
        monkeypatch.setenv("ATOM_KERNEL_ISA", isa)
        kernels.kernel_isa.cache_clear()

    yield use
    monkeypatch.undo()
    kernels.kernel_isa.cache_clear()


@pytest.mark.parametrize(
    "isa,march,flags,dtype",
    [
        ("native", "native", list(kernels.ISA_FLAGS), torch.bfloat16),
        ("avx2", "x86-64-v3", ["avx2", "fma"], torch.float32),
        ("avx512", "skylake-avx512", ["avx2", "fma", "avx512f", "avx512bw", "avx512vl"], torch.float32),
        (
            "avx512_bf16",
            "cooperlake",
            ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"],
            torch.bfloat16,
        ),
    ],
)
def test_kernel_isa_builds_and_picks_as_a_lower_cpu_kind_would(kernel_isa, isa, march, flags, dtype):
    """ATOM_KERNEL_ISA on a Xeon with AMX: the build's -march and cache entry, and every choice
    made by the flags (auto's dtype, oneDNN packing, the attention's prefill path) as on that kind."""
    kernel_isa("native")
    native_name = kernels.build_name()
    kernel_isa(isa)
    assert kernels.isa_flags() == flags
    assert f"-march={march}" in kernels.compiler_flags()
    assert (kernels.build_name() == native_name) == (isa == "native")
    assert resolve_dtype("auto", torch.device("cpu")) == dtype
    if isa == "avx2":
        assert not can_pack_bf16()
    backend = select_backend(torch.device("cpu"), "auto", dtype=dtype)
    assert backend.amx_prefill == (isa == "native" and kernels.has_amx_attention())


def test_a_kernel_isa_it_does_not_know_or_this_cpu_lacks_is_one_line_naming_it(kernel_isa):
    cases = {
        ("avx9", XEON): "ATOM_KERNEL_ISA=avx9: one of native, avx2, avx512, avx512_bf16",
        ("avx512_bf16", "flags : fpu avx2 fma"): "ATOM_KERNEL_ISA=avx512_bf16: this CPU lacks avx512f, avx512bw, "
        "avx512vl, avx512_bf16",
        ("avx2", "flags : fpu sse2"): "ATOM_KERNEL_ISA=avx2: this CPU lacks avx2, fma",
    }
    for (isa, host), message in cases.items():
        kernel_isa(isa, host)
        with pytest.raises(ConfigError) as raised:
            kernels.cpu_flags()
        assert str(raised.value) == message


AMX_LINEAR, VEC_LINEAR = "linear_amx_bf16", "linear_avx512_bf16"
needs_amx_linears = pytest.mark.skipif(
    AMX_LINEAR not in kernels.native_kernels(), reason=f"{AMX_LINEAR}: no AMX tiles on this CPU or OS"
)
# the tile GEMM's two variants: on the AMX tiles, and AVX512-BF16's pair products (a Zen 4, or cpu_amx=false)
TILE_VARIANTS = [
    pytest.param(True, marks=needs_amx_linears, id="amx"),
    pytest.param(
        False,
        marks=pytest.mark.skipif(VEC_LINEAR not in kernels.native_kernels(), reason=f"{VEC_LINEAR}: no AVX512-BF16"),
        id="avx512_bf16",
    ),
]


@pytest.mark.parametrize("amx", TILE_VARIANTS)
@pytest.mark.parametrize("n,k,bias", [(80, 96, True), (576, 576, False), (49, 64, True), (40, 1536, False)])
def test_tile_linears_equal_the_product_and_give_a_row_the_same_bits_in_any_batch(n, k, bias, amx):
    """The tile GEMM (gemm.cpp) within a bfloat16 rounding of the exact product, for any row
    count, on each variant: AMX (one to four column blocks a unit, 2 x 2 blocks past 16 rows, row
    chunks of 64, K in blocks of 8 tile steps with a short last one) and AVX512-BF16 (tiles of 1-6
    rows by 1-4 column blocks, K in blocks of 64 pairs past 6 rows with a short last one, chunks of
    48 rows); a last block of rows and of columns cut short. A row's output is the same bits
    whatever rows share its call, and the packed tiles unpack to the weight."""
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = pack_tile_weight(w)
    assert packed.shape == ((n + 15) // 16, k // 32, 16, 32) and torch.equal(unpack_tile_weight(packed, n), w)
    x = torch.randn(600, k).bfloat16()
    every = tile_linear(x, packed, n, b, amx)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(every.double(), exact, rtol=2**-7, atol=1e-2)
    for begin, end in [(0, 1), (5, 6), (3, 7), (0, 16), (13, 30), (16, 48), (250, 300), (0, 257), (7, 600)]:
        part = tile_linear(x[begin:end], packed, n, b, amx)
        assert torch.equal(part, every[begin:end]), f"rows {begin}:{end} differ from the same rows in 600"
    assert tile_linear(x[:0], packed, n, b, amx).shape == (0, n)


@needs_amx_linears
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k,bias", [(80, 96, True), (49, 576, False)])
def test_amx_linears_over_gguf_blocks_give_the_dense_copys_bits(qtype, n, k, bias):
    """The AMX GEMM over a layer's GGUF blocks, dequantized into the tiles as it goes, gives the bits
    of the same GEMM over the layer's dense bfloat16 copy, at any row count (the blocks' dequantizing
    rounds as the dense copy's does)."""
    torch.manual_seed(0)
    layer, dense = _quantized_tile_layer(qtype, n, k, bias, amx=True)
    for rows in (1, 4, 16, 17, 300):
        x = torch.randn(rows, k).bfloat16()
        assert torch.equal(tile_qlinear(x, layer), tile_linear(x, dense, n, layer.bias, True)), f"{rows} rows"


CHAIN_CASES = [
    (q, *shape) for q in ("Q4_0", "Q4_1", "Q8_0") for shape in [(80, 96, True), (49, 576, False), (40, 1536, True)]
]
CHAIN_CASES += [
    (q, *shape) for q in ("Q4_K", "Q6_K") for shape in [(80, 256, True), (49, 512, False), (40, 1536, True)]
]


@pytest.mark.skipif(VEC_LINEAR not in kernels.native_kernels(), reason=f"{VEC_LINEAR}: no AVX512-BF16")
@pytest.mark.parametrize("qtype,n,k,bias", CHAIN_CASES)
def test_vector_linears_over_gguf_blocks_run_the_blocks_chain_in_any_batch(qtype, n, k, bias):
    """The vector variant over a layer's GGUF blocks (the blocks' chain: each block's pair products
    of x and the integers, scaled by d, plus Q4_1's m times the block's sum of x; K-quants' sub-blocks
    alike with float32 scales, Q6_K's two halves each its own) is within a bfloat16 rounding of the
    exact product over the dequantized float32 weights, and gives a row the same bits whatever rows
    share its call: the few-row tiles (1-8 rows, four at a time) and the unpacked panel (past 8, six
    rows by 1-4 column blocks) run one chain. A last column block cut short, a bias or none; its bits
    are not the dense copy's (the scales apply to the sums, not to each weight)."""
    torch.manual_seed(0)
    layer, _ = _quantized_tile_layer(qtype, n, k, bias, amx=False)
    x = torch.randn(300, k).bfloat16()
    every = tile_qlinear(x, layer)
    exact = x.double() @ layer.weight.dequantize(torch.float32).double().t()
    exact = exact + (layer.bias.double() if bias else 0)
    torch.testing.assert_close(every.double(), exact, rtol=2**-7, atol=1e-2)
    for begin, end in [(0, 1), (5, 6), (3, 7), (0, 4), (0, 8), (1, 10), (0, 16), (13, 30), (7, 300)]:
        assert torch.equal(tile_qlinear(x[begin:end], layer), every[begin:end]), f"rows {begin}:{end} differ"
    assert tile_qlinear(x[:0], layer).shape == (0, n)


def _quantized_tile_layer(qtype: str, n: int, k: int, bias: bool, amx: bool):
    """A bfloat16 QuantLinear of random blocks with its quantized tiles, and its dense copy's tiles."""
    blocks, _ = random_quantized(n, k, gguf.GGMLQuantizationType[qtype])
    layer = QuantLinear(blocks.to(dtype=torch.bfloat16), has_bias=bias)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(n).bfloat16())
    layer.tile_qweight, layer.tile_amx = pack_tile_qweight(layer.weight), amx
    return layer, pack_tile_weight(layer.weight.dequantize(torch.bfloat16))


@needs_amx_linears
def test_the_amx_linears_leave_the_tiles_as_onednn_set_them():
    """oneDNN's bfloat16 GEMM (which runs on the tiles too) answers the same after an AMX linear."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 512).bfloat16(), torch.randn(512, 256).bfloat16()
    before = a @ b
    packed = pack_tile_weight(torch.randn(96, 64).bfloat16())
    tile_linear(torch.randn(20, 64).bfloat16(), packed, 96, None, True)
    assert torch.equal(a @ b, before)


def os_threads() -> set[str]:
    """The process's threads by id (others' threads, an earlier test's engine among them, may come
    and go meanwhile: the tests follow the ids they saw appear)."""
    return set(os.listdir("/proc/self/task"))


def test_release_openmp_threads_ends_the_calling_threads_pool():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kernels.release_openmp_threads()
        before = os_threads()
        torch.ones(1 << 24).sum()  # one OpenMP region: a pool with one more thread
        pool = os_threads() - before
        assert pool
        assert kernels.release_openmp_threads()
        assert not pool & os_threads()
    finally:
        torch.set_num_threads(previous)


def test_the_thread_that_builds_an_engine_keeps_no_openmp_pool(tiny_model_dir):
    """Loading and zeroing the KV pool run OpenMP regions on the caller's thread; the steps run on
    the engine's own. A pool left on the caller would double the threads libgomp manages on a
    2-core machine, and it then stops spinning its workers (every step's regions 2x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
        after_build = os_threads()
        kernels.release_openmp_threads()  # nothing left to release
        assert after_build <= os_threads()
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        torch.set_num_threads(previous)


def test_the_cpu_is_named_with_its_family_and_model_numbers():
    """Benchmarks' JSON lines and the load logs name the CPU; a VM's "AMD EPYC" alone does not
    tell a Zen 3 from a Zen 4, the numbers do. Only the first processor's fields are read."""
    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    other = "\nprocessor\t: 1\ncpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Intel Xeon\n"
    assert kernels.describe_cpu(zen4 + other) == "AMD EPYC (family 25 model 17)"
    assert kernels.describe_cpu("model name\t: Some CPU\n") == "Some CPU"
    assert kernels.describe_cpu("") == ""
