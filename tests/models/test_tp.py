"""Tensor parallelism at tensor_parallel_size=2 (two gloo ranks on the CPU): the same greedy
output as one rank and as transformers, offline and served; the ranks' lifetime is the server's."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import torch
import transformers
from support_models import write_tiny_llama
from support_servers import Served, clean_env, free_port, running, wait_ready

from atom_anyio.config import Config
from atom_anyio.llm import LLM
from atom_anyio.models.quant import Q, QuantizedWeight
from atom_anyio.models.tensor_parallel import TensorParallel
from atom_anyio.sampling_params import SamplingParams
from atom_anyio.settings import ConfigError

SMOLLM2_HF = Path("/work/smollm2-hf")  # a local float32 export; not in CI
PROMPT = "Tell me a story about a river and a stone."
EXIT_TIMEOUT_S = 30.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def transformers_greedy(path: Path, ids: list[int], max_tokens: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out, step, cache = [], torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(max_tokens):
            result = hf(step, cache=cache, use_cache=True)
            out.append(int(result.logits[0, -1].argmax()))
            step, cache = torch.tensor([[out[-1]]]), result.cache
    return out


@contextmanager
def offline(model, **kwargs) -> Iterator[LLM]:
    llm = LLM(model, **kwargs)
    try:
        yield llm
    finally:
        if kwargs.get("tensor_parallel_size", 1) > 1:
            llm.engine.worker.close()  # one tensor-parallel engine per process at a time


def ranks_of(pid: int) -> list[psutil.Process]:
    procs = psutil.Process(pid).children(recursive=True)
    return [p for p in procs if "atom_anyio.engine.tp_workers" in " ".join(p.cmdline())]


def assert_all_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=EXIT_TIMEOUT_S)
    assert not alive, f"ranks left behind: {alive}"


@pytest.fixture(scope="module")
def replicated_kv_dir(tmp_path_factory) -> Path:
    """A tiny Llama with one KV head: at two ranks, each holds it and half the query heads."""
    path = tmp_path_factory.mktemp("tiny-llama-kv1")
    return write_tiny_llama(
        path, seed=1, num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=False
    )


# offline


def test_greedy_output_at_two_ranks_equals_one_and_transformers_with_a_replicated_kv_head(replicated_kv_dir):
    ids = [[5, 99, 1234, 7, 4000, 42], list(range(300, 340))]
    with offline(str(replicated_kv_dir), dtype="float32", kv_cache_gib=0.02) as one:
        at_one = [o.outputs[0].token_ids for o in one.generate(ids, greedy(24))]
    with offline(str(replicated_kv_dir), dtype="float32", kv_cache_gib=0.02, tensor_parallel_size=2) as two:
        assert two.engine.worker.model.config.num_key_value_heads == 1  # replicated
        assert two.engine.worker.model.config.num_attention_heads == 2
        at_two = [o.outputs[0].token_ids for o in two.generate(ids, greedy(24))]
    assert at_two == at_one == [transformers_greedy(replicated_kv_dir, p, 24) for p in ids]


def test_a_history_restored_from_the_tier_at_two_ranks_gives_one_ranks_tokens(tiny_model_dir, tmp_path):
    """Each rank keeps its shard of the evicted blocks in a tier of its own and copies the same
    blocks back as rank 0: a 40-block pool, 24-block prompts, the first evicted by the second and
    restored from the tiers, continues as computed afresh at one rank."""
    history = [(7 * i) % 997 + 3 for i in range(24 * 16)]
    other = [(11 * i) % 991 + 5 for i in range(24 * 16)]
    small = dict(dtype="float32", max_model_len=1024, num_kv_blocks=40, block_size=16)
    tier = dict(kv_offloading_size=0.02, kv_offloading_dir=str(tmp_path))
    with offline(str(tiny_model_dir), **small, **tier, tensor_parallel_size=2) as two:
        assert two.engine.worker.tier is not None and two.engine.block_manager.tier.num_slots > 0
        first, _, again = (two.generate([p], greedy(8))[0] for p in (history, other, history))
        stats = two.engine.stats().tier
    assert stats.num_saved_blocks > 0 and stats.num_restored_blocks > 0
    assert again.num_cached_tokens == 23 * 16  # the pool's hits, then the tiers'
    with offline(str(tiny_model_dir), **small, enable_prefix_caching=False) as one:
        (computed,) = one.generate([history], greedy(8))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == computed.outputs[0].token_ids


def test_every_rank_loads_its_shard_as_rank_0s_plan(replicated_kv_dir):
    """cpu_native_kernels and cpu_amx are part of the plan the model is loaded as, and every rank's
    process loads its shard from rank 0's plan: they all run the same kernel variants."""
    with offline(
        str(replicated_kv_dir),
        kv_cache_gib=0.02,
        tensor_parallel_size=2,
        cpu_native_kernels=False,
        cpu_amx=False,
    ) as two:
        plan = two.loaded.plan
        assert (plan.native_kernels, plan.amx, plan.tensor_parallel_size) == (False, False, 2)
        assert two.engine.worker.rank_plans == [plan]
        backend = two.engine.worker.model.attention_backend
        assert (backend.native, backend.amx) == (False, False)
        assert two.generate([[5, 99, 1234]], greedy(4))[0].outputs[0].token_ids


@pytest.mark.slow
def test_default_gguf_kept_quantized_splits_its_blocks_and_generates_as_one_rank(smollm2):
    """The real SmolLM2 shape: 3 KV heads over 2 ranks (2 + 1), Q4_1 blocks cut whole."""
    ids = smollm2.tokenizer("What is the capital of France?")["input_ids"]
    with offline(smollm2, kv_cache_gib=0.05) as one:
        at_one = one.generate([ids], greedy(12))[0].outputs[0].token_ids
    with offline(None, kv_cache_gib=0.05, tensor_parallel_size=2) as two:
        shard = two.engine.worker.model
        assert (shard.config.num_key_value_heads, shard.config.num_attention_heads) == (2, 6)
        assert "Q4_1" in shard.dtype_name
        assert two.generate([ids], greedy(12))[0].outputs[0].token_ids == at_one


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2_HF.is_dir(), reason=f"{SMOLLM2_HF} (SmolLM2-135M, float32) is not here")
def test_smollm2_float32_at_two_ranks_equals_transformers():
    with offline(str(SMOLLM2_HF), dtype="float32", kv_cache_gib=0.05, tensor_parallel_size=2) as two:
        ids = two.tokenizer("What is the capital of France?")["input_ids"]
        out = two.generate([ids], greedy(12))[0].outputs[0].token_ids
    assert out == transformers_greedy(SMOLLM2_HF, ids, 12)


def test_a_split_the_model_cannot_take_is_one_line_naming_the_setting(tiny_model):
    assert Config.from_env({"ATOM_TENSOR_PARALLEL_SIZE": "2"}).engine.tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split the model's 2 KV heads"):
        TensorParallel(tiny_model.config, 0, 3)
    with pytest.raises(ConfigError, match="cuda_graphs runs with tensor_parallel_size 1 only"):
        Config.of(tensor_parallel_size=2, cuda_graphs=True)


def test_quantized_weights_are_cut_along_whole_blocks_or_refused(tiny_model):
    cfg = dataclasses.replace(tiny_model.config, num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    data = torch.randint(0, 256, (64, 64 // 32 * 18), dtype=torch.uint8)
    data.view(64, 2, 18)[..., :2] = torch.tensor([0, 0x2C], dtype=torch.uint8)  # each block's float16 scale: 0.0625
    o_proj = QuantizedWeight(data, Q.Q4_0, torch.Size((64, 64)))
    name = "model.layers.0.self_attn.o_proj.weight"
    for rank, columns in ((0, slice(0, 32)), (1, slice(32, 64))):
        shard = TensorParallel(cfg, rank, 2).shard_state({name: o_proj})[name]
        assert torch.equal(shard.dequantize(), o_proj.dequantize()[:, columns])
    cut = dataclasses.replace(cfg, head_dim=16, hidden_size=32)
    narrow = QuantizedWeight(data[:, :18], Q.Q4_0, torch.Size((64, 32)))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: the split cuts a 32-weight quantized block"):
        TensorParallel(cut, 0, 2).shard_state({name: narrow})


# served


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_kernels_built")  # a server process starts
def test_served_greedy_output_equals_one_rank_and_sigterm_leaves_no_rank(tiny_model_dir, tiny_model, tmp_path):
    messages = [{"role": "user", "content": PROMPT}]
    with offline(tiny_model, kv_cache_gib=0.05) as one:
        expected = one.chat(messages, greedy(24))[0].outputs[0].text
    port = free_port()
    env = clean_env(model=str(tiny_model_dir), dtype="float32", kv_cache_gib="0.05", tensor_parallel_size="2")
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    with running(cmd, env, port, tmp_path / "hypercorn.log") as served:  # exits 0 on SIGTERM
        body = {"messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
        server = psutil.Process(int(_listener_pid(port)))
        ranks = ranks_of(server.pid)
        assert len(ranks) == 1
    assert_all_gone(ranks)


def _listener_pid(port: int) -> int:
    """The process that listens on ``port`` (hypercorn's worker, which holds rank 0)."""
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise AssertionError(f"nothing listens on {port}")


@contextmanager
def cli_server(model_dir: Path, log_path: Path) -> Iterator[tuple[subprocess.Popen, Served]]:
    port = free_port()
    script = Path(sys.executable).with_name("atom-anyio")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "atom_anyio.cli"]
    cmd = [*cli, "serve", f"--port={port}", f"--model={model_dir}", "--dtype=float32", "--kv-cache-gib=0.05"]
    cmd += ["--tensor-parallel-size=2", "--log-format=json"]
    served = Served(f"http://127.0.0.1:{port}", log_path)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, served)
        yield proc, served
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_kernels_built")  # a server process starts
def test_sigkill_of_the_server_leaves_no_rank(tiny_model_dir, tmp_path):
    with cli_server(tiny_model_dir, tmp_path / "serve.log") as (proc, _):
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert_all_gone(ranks)


@pytest.mark.slow
@pytest.mark.usefixtures("cpu_kernels_built")  # a server process starts
def test_a_rank_killed_mid_run_fails_the_engine_and_the_server_exits_non_zero(tiny_model_dir, tmp_path):
    with cli_server(tiny_model_dir, tmp_path / "serve.log") as (proc, served):
        (rank,) = ranks_of(proc.pid)
        body = {"prompt": "The river", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    rank.kill()  # mid-stream
        error = json.loads(events[-1])["error"]
        assert "rank 1" in error["message"], error
        health = _health_until_exit(proc, served)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 1, served.log()
        assert 200 not in health
        assert '"engine.crashed"' in served.log() and "WorkerFailed" in served.log()


def _health_until_exit(proc: subprocess.Popen, served: Served) -> list[int]:
    """Every /health status answered between the failure and the process's exit (bounded)."""
    statuses, deadline = [], time.monotonic() + EXIT_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.append(httpx.get(f"{served.url}/health", timeout=2).status_code)
        except httpx.TransportError:
            break  # the listener closed: the server is exiting
    return statuses
