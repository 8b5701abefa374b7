"""The engine's one configuration object (nested in the server's ``Config``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from atom_anyio.engine.kv_events import KVEventsConfig
from atom_anyio.engine.speculative import AUTO, SpeculativeConfig
from atom_anyio.models.plan import ModelPlan
from atom_anyio.settings import setting

SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --kv-cache-dtype: auto (the model's dtype), or fp8 (fp8_e4m3, as vLLM's fp8) or fp8_e5m2, unscaled
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int | None = setting(None, "context length in tokens (default: the model's)")
    block_size: int = setting(16, "tokens per KV-cache block (and per prefix-cache hash)")
    max_num_seqs: int = setting(64, "sequences running at once")
    max_num_batched_tokens: int = setting(2048, "tokens per step, decodes and prefill chunks together")
    kv_cache_gib: float = setting(
        2.0, "memory budget of the KV pool on the CPU, capped at what max_num_seqs x max_model_len can use"
    )
    kv_cache_dtype: str = setting(
        "auto",
        "vLLM's --kv-cache-dtype: auto (the model's dtype), fp8 or fp8_e4m3, or fp8_e5m2: one byte a value, twice the "
        "tokens in the same pool and half the bytes a long decode reads (docs/engine.md)",
    )
    gpu_memory_utilization: float = setting(
        0.9, "on a GPU: the share of its memory the engine may fill (weights, activations, then the KV pool)"
    )
    num_kv_blocks: int | None = setting(None, "KV blocks in the pool, overriding the memory budget")
    enable_prefix_caching: bool = setting(True, "reuse the KV of prompt blocks seen before")
    kv_lease_ttl_s: float = setting(
        30.0,
        "a finished request's cached blocks are kept this long for its conversation's next turn (an agent "
        "running a tool), before the LRU takes them; a request's hints set its own; 0: off (docs/engine.md)",
    )
    kv_lease_fraction: float = setting(0.5, "the share of the KV pool that leases may hold at most")
    kv_offloading_size: float = setting(
        0.0,
        "GiB of a second KV tier: blocks evicted from the pool are copied there and prefix hits restored from it "
        "(vLLM's --kv-offloading-size: all tensor-parallel ranks' together, each holding its shard); on the CPU "
        "a file on local disk, on a GPU pinned host memory; 0: off",
    )
    kv_offloading_dir: str | None = setting(None, "the directory of the CPU tier's file (default: the temp dir)")
    scheduling_policy: str = setting(
        "fcfs",
        "vLLM's --scheduling-policy: fcfs (arrival order) or priority (a request's priority, lower first, then "
        "arrival; the running sequence of the lowest priority is preempted first)",
    )
    max_consecutive_step_failures: int = setting(3, "failed model steps in a row before the engine is unhealthy")
    max_pending_deltas: int = setting(64, "unread deltas per request; past it a slow reader's deltas are merged")
    # the forward leaves the GIL, and on the 2-core VM two threads served 1.6x the output of one at c16
    num_threads: int | None = setting(None, "torch threads for the forward on CPU (default: every core)")
    cpu_native_kernels: bool = setting(
        True,
        "the CPU kernels' native variants where the CPU has them (AVX512-BF16 attention); false: the portable twins",
    )
    cpu_amx: bool = setting(
        True,
        "attention and bfloat16 linears on the AMX tiles where the CPU has them; false: what an AVX512-BF16 CPU "
        "without AMX runs (the AVX512-BF16 attention, oneDNN's GEMMs)",
    )
    tensor_parallel_size: int = setting(
        1, "ranks the model is split across, one process each (gloo on CPU, NCCL on GPUs; docs/engine.md)"
    )
    cuda_graphs: bool = setting(
        False, "decode batches padded to 1, 2, 4 .. max_num_seqs and captured as CUDA graphs (untested on a GPU)"
    )
    async_scheduling: bool = setting(
        False, "schedule the next step while the model runs this one (vLLM's --async-scheduling; docs/engine.md)"
    )
    kv_events: KVEventsConfig | None = setting(
        None,
        "vLLM's --kv-events-config JSON: publish KV-cache events over ZMQ (docs/operations.md)",
        parse=KVEventsConfig.from_json,
        name="kv_events_config",
    )
    speculative_config: SpeculativeConfig | str | None = setting(
        AUTO,
        'vLLM\'s --speculative-config JSON, draft-free: {"method": "ngram" or "suffix", "num_speculative_tokens": k, '
        '"prompt_lookup_min"/"prompt_lookup_max": n, ...}; off: none; auto: suffix drafts for a lone stream where '
        "the kernels make them exact (batch invariance on), else none (docs/engine.md)",
        parse=SpeculativeConfig.from_json,
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict | str):  # LLM(speculative_config={...}), as vLLM takes it
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_json(self.speculative_config))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_pending_deltas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, not {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.cuda_graphs:
            raise ValueError("cuda_graphs runs with tensor_parallel_size 1 only")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling runs with tensor_parallel_size 1 only")
        if not 0 <= self.kv_lease_fraction <= 1 or self.kv_lease_ttl_s < 0:
            raise ValueError(
                f"kv_lease_fraction must be in [0, 1] and kv_lease_ttl_s at least 0, not "
                f"{self.kv_lease_fraction} and {self.kv_lease_ttl_s}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {self.scheduling_policy!r}"
            )
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be at least 0, not {self.kv_offloading_size}")
        if self.kv_offloading_dir is not None and not os.path.isdir(self.kv_offloading_dir):
            raise ValueError(f"kv_offloading_dir {self.kv_offloading_dir!r} is not a directory")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, not {self.kv_cache_gib}")

    def check_loaded_as(self, plan: ModelPlan | None) -> None:
        """The CPU kernels' switches are the loaded model's (its plan, models/plan.py): an engine
        does not change them, so one that asks for others is a one-line error naming the setting."""
        if plan is None:  # built in memory
            return
        for name, loaded_as in (("cpu_native_kernels", plan.native_kernels), ("cpu_amx", plan.amx)):
            if getattr(self, name) != loaded_as:
                raise ValueError(
                    f"{name}={getattr(self, name)}: the model was loaded with {name}={loaded_as} "
                    "(load it with the engine's setting)"
                )

    @property
    def cpu_threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1

    @property
    def threads_per_rank(self) -> int:
        """Each rank's share of ``cpu_threads``, so that the ranks do not oversubscribe the cores."""
        return max(1, self.cpu_threads // self.tensor_parallel_size)
