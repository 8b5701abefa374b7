"""Helpers the test modules share: ports, bounded polling, an in-process
hypercorn, the server as a subprocess, the one fake (a scripted sampler at
the model boundary), and the one table of tiny model families."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
import transformers
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from atom_anyio.engine.sampler import SamplerOutput, SamplingInputs
from atom_anyio.models.gguf_file import load_gguf_tokenizer

READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 30.0


# words of the random prompts the engine tests mix (lengths and content vary with the seed)
WORDS = [
    "the",
    "a",
    "river",
    "stone",
    "cloud",
    "seven",
    "blue",
    "quickly",
    "runs",
    "over",
    "under",
    "bright",
    "engine",
    "token",
    "paged",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until(predicate: Callable[[], Any], timeout: float = 30) -> None:
    """Poll a condition (bounded), for state with no event to wait on."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


async def wait_healthy(base_url: str, timeout: float = 60) -> None:
    """Until GET /health answers 200: the readiness endpoint, not a fixed sleep."""
    async with httpx.AsyncClient(base_url=base_url) as http:
        with anyio.fail_after(timeout):
            while True:
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.05)


@asynccontextmanager
async def served_over_http(app: Any, port: int | None = None) -> AsyncIterator[str]:
    """Real hypercorn serving ``app`` on 127.0.0.1 in this event loop; yields
    the base URL and shuts down gracefully (the lifespan drains) at exit."""
    port = port or free_port()
    hc = HypercornConfig()
    hc.bind, hc.accesslog = [f"127.0.0.1:{port}"], None
    stop = anyio.Event()
    base_url = f"http://127.0.0.1:{port}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(hypercorn_serve, app, hc, shutdown_trigger=stop.wait))
        await wait_healthy(base_url)
        try:
            yield base_url
        finally:
            stop.set()


class ScriptedSampler:
    """The model boundary, faked: each row's next token is the next token of
    ``text`` (then EOS), whatever the logits say; ``fail_at`` raises at that
    output position, as a device error would. The forward, engine loop,
    detokenizer, parsers and API mapping all stay real."""

    def __init__(self, tokenizer: Any, text: str, fail_at: int | None = None):
        self.token_ids = tokenizer.encode(text, add_special_tokens=False)
        self.fail_at = fail_at

    def __call__(self, logits: Any, inputs: SamplingInputs, finite: Any = None) -> SamplerOutput:
        positions = [len(out) for out in inputs.output_token_ids]
        if self.fail_at is not None and self.fail_at in positions:
            raise RuntimeError("device lost")
        eos = inputs.eos_token_ids[0]
        ids = [self.token_ids[n] if n < len(self.token_ids) else eos for n in positions]
        return SamplerOutput(ids, [None] * len(ids))


class FailingSampler:
    """The model boundary failing, as a device error would: every step raises ``error``."""

    def __init__(self, error: Exception):
        self.error = error

    def __call__(self, logits: Any, inputs: SamplingInputs, finite: Any = None) -> SamplerOutput:
        raise self.error


class HookedSegmentCache:
    """The prompt's tokenizer boundary with a hook: ``hook(text)`` runs in the prepare thread
    before each encode (to block, record or fail it); the real segment cache does the work."""

    def __init__(self, real: Any, hook: Callable[[str], None]):
        self.real, self.hook = real, hook
        self.tokenizer = real.tokenizer

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.hook(text)
        return self.real.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def hook_prepare(atom: Any, hook: Callable[[str], None]) -> None:
    """Install a ``HookedSegmentCache`` in ``atom``'s prepare context (for the rest of its serving)."""
    import dataclasses

    rt = atom.runtime
    rt.prepare_ctx = dataclasses.replace(
        rt.prepare_ctx, segment_cache=HookedSegmentCache(rt.prepare_ctx.segment_cache, hook)
    )


@contextmanager
def scripted(atom: Any, text: str, fail_at: int | None = None) -> Iterator[None]:
    """Install a ScriptedSampler on ``atom``'s engine for the block."""
    worker = atom.runtime.engine.worker
    real = worker.sampler
    worker.sampler = ScriptedSampler(atom.runtime.loaded.tokenizer, text, fail_at)
    try:
        yield
    finally:
        worker.sampler = real


@asynccontextmanager
async def serving_app(loaded: Any, **config: Any) -> AsyncIterator[Any]:
    """An ``AtomApp`` over an already loaded model, serving (engine loop running) until the block exits."""
    from atom_anyio.api.app import AtomApp
    from atom_anyio.config import Config

    atom = AtomApp(Config.of(**config), loaded=loaded)
    async with atom.serving():
        yield atom


# the server as a subprocess


@dataclass
class Served:
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running(cmd: list[str], env: dict[str, str], port: int, log_path: Path) -> Iterator[Served]:
    """Start ``cmd``, wait until /health answers 200, yield; then SIGTERM and require exit 0."""
    served = Served(f"http://127.0.0.1:{port}", log_path)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, served)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    try:
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"server did not exit within {EXIT_TIMEOUT_S} s of SIGTERM; its output:\n{served.log()}")
        assert rc == 0, f"server exited {rc} on SIGTERM; its output:\n{served.log()}"


def wait_ready(proc: subprocess.Popen, served: Served) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode} before it was ready; its output:\n{served.log()}")
        try:
            if httpx.get(f"{served.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # poll interval
    pytest.fail(f"server not ready after {READY_TIMEOUT_S} s; its output:\n{served.log()}")


def clean_env(**atom: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    return {**env, **{f"ATOM_{k.upper()}": v for k, v in atom.items()}}


def write_tiny_llama(path, tokenizer_gguf: str, seed: int = 0, **config: object):
    """A 2-layer random Llama (seeded) in HF format with the SmolLM2 tokenizer; ``config`` overrides."""
    defaults = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.2,
    }
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**defaults, **config})).save_pretrained(
        path, safe_serialization=True
    )
    load_gguf_tokenizer(tokenizer_gguf).save_pretrained(path)
    return path


# tiny model families: the one table test_models, test_models_arch and test_gguf_moe select from

# the dense families of test_models (each family sets its own KV heads)
TINY_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
# the architectures of test_models_arch: three layers, so windowed and full or dense and sparse layers mix
TINY_ARCH_SIZES = {
    **TINY_SIZES,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}
BYTE_LEVEL_VOCAB = dict(vocab_size=262)  # support_gguf.byte_level_tokenizer_metadata's vocabulary
# the MoE GGUFs of test_gguf_moe: the byte-level GGUF tokenizer's vocabulary, two layers
TINY_GGUF_MOE_SIZES = {**TINY_ARCH_SIZES, **BYTE_LEVEL_VOCAB, "num_hidden_layers": 2}
TINY_WINDOW = 7
TINY_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)
TINY_FAMILIES: dict[str, tuple[type, dict]] = {
    # test_models, on TINY_SIZES
    # grouped-query attention (2 KV heads of 4), an untied head, plain RoPE
    "llama": (transformers.LlamaConfig, dict(num_key_value_heads=2)),
    # Llama 3 rope scaling
    "llama3-rope": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,  # wavelengths fall in all three llama3 bands
            ),
        ),
    ),
    # q/k/v biases, the head tied to the embedding
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k norms, a head_dim (32) other than hidden_size / heads (16)
    "qwen3": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=32)),
    # one KV head for all four query heads, another RoPE base
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=1, rope_parameters=dict(rope_theta=1e6))),
    # test_models_arch, on TINY_ARCH_SIZES
    # a sliding window on every layer
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=TINY_WINDOW)),
    # layer 0 full, layers 1 and 2 windowed
    "qwen2-window": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1),
    ),
    # YaRN with q/k norms and a wider head_dim
    "qwen3-yarn": (transformers.Qwen3Config, dict(head_dim=32, rope_parameters=TINY_YARN)),
    # YaRN with mscale and mscale_all_dim (the attention factor) and another beta_fast
    "llama-yarn-mscale": (
        transformers.LlamaConfig,
        dict(rope_parameters={**TINY_YARN, "factor": 8.0, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16}),
    ),
    # layer 1 dense (mlp_only_layers), a window on every layer (Qwen3-MoE's rule)
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            use_sliding_window=True,
            sliding_window=TINY_WINDOW,
        ),
    ),
    # every second layer sparse, top-k renormalised, YaRN
    "qwen3-moe-norm-yarn": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            rope_parameters=TINY_YARN,
        ),
    ),
    # top 2 of 4 experts on every layer, a window on every layer
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW),
    ),
    # sinks, windowed and full layers alternating, YaRN without truncation, biased experts and clamped SwiGLU
    "gpt-oss": (
        transformers.GptOssConfig,
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_WINDOW,
            swiglu_limit=1.0,  # the clamps bind at this scale
            rope_parameters={**TINY_YARN, "rope_theta": 150000.0, "truncate": False, "beta_fast": 8.0},
        ),
    ),
    # test_gguf_moe, on TINY_GGUF_MOE_SIZES, as llama.cpp runs them: every layer routed;
    # Qwen3-MoE and Mixtral renormalise the top k and have no window
    # top 3 of 8 experts renormalised, q/k norms
    "qwen3moe-gguf": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # top 2 of 4 experts, written as GGUF ``llama`` with experts (q/k rows permuted)
    "mixtral-gguf": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    # windowed and full layers alternating, sinks, biases; YaRN as a GGUF carries it (llama.cpp truncates)
    "gpt-oss-gguf": (
        transformers.GptOssConfig,
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_WINDOW,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=True,
            ),
        ),
    ),
}


def tiny_families(*names: str) -> dict[str, tuple[type, dict]]:
    """The named families of ``TINY_FAMILIES``, in that order (a module's parametrized ids)."""
    return {name: TINY_FAMILIES[name] for name in names}


# what `auto` picks on some CPU, each forced: (dtype, gguf_weights). The suite runs every one on
# whatever CPU it is on (bfloat16 is slow on an AVX2-only CPU, not wrong).
CPU_COMBINATIONS = {
    "float32+both": ("float32", "both"),  # auto on AVX2 CPUs: blocks (the fused decoder's GEMV) and a dense copy
    "float32+packed": ("float32", "packed"),  # auto there when the dense copy does not fit
    "bfloat16+both": ("bfloat16", "both"),  # auto on AVX512-BF16 / AMX CPUs: blocks and a dense copy
    "bfloat16+packed": ("bfloat16", "packed"),  # auto there when the dense copy does not fit
    "float32+dequantize": ("float32", "dequantize"),
    "bfloat16+dequantize": ("bfloat16", "dequantize"),
}


def assert_greedy_close(outputs: list[list[Any]], reference: list[list[Any]]) -> None:
    """Greedy token lists compared the standard way for low precision: equal, or where they first
    diverge, each side's token is among the other's top logprobs there (then the rest is not
    compared). Each item is a ``CompletionOutput`` sampled with ``logprobs`` > 0."""
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        for j, (a, b) in enumerate(zip(out.logprobs, ref.logprobs, strict=False)):
            if a.token_id == b.token_id:
                continue
            assert a.token_id in dict(b.top), f"sequence {i} token {j}: {a.token_id} not in the reference's top {b.top}"
            assert b.token_id in dict(a.top), f"sequence {i} token {j}: {b.token_id} not in this run's top {a.top}"
            break
        else:
            assert len(out.token_ids) == len(ref.token_ids), f"sequence {i}: lengths differ"
