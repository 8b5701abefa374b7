"""The server's one frozen configuration, from ``ATOM_*`` variables or flags."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from atom_anyio.engine.attention import BACKENDS
from atom_anyio.engine.config import EngineConfig
from atom_anyio.models.loader import DTYPES
from atom_anyio.parse import ParserSpec


@dataclass(frozen=True)
class Config:
    model: str | None = None  # HF dir or GGUF file; None: SmolLM2-135M-Instruct
    dtype: str = "auto"  # float32, bfloat16, or auto: the fastest faithful one for the device
    device: str = "cpu"
    attention_backend: str = "auto"  # auto, cpu (the C++ kernel), torch (the portable path)
    served_model_name: str | None = None  # default: the model's name
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_gib: float = 2.0
    block_size: int = 16
    num_threads: int | None = None  # torch threads on CPU; default every core
    api_key: str | None = field(default=None, repr=False)
    host: str = "127.0.0.1"
    port: int = 8000
    chat_template: str | None = None  # a file path or the template itself
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    context_overflow: str = "error"  # or "drop_oldest"
    reasoning_parser: str = "auto"  # auto (from the chat template), none, or a name in parse.reasoning
    tool_call_parser: str = "auto"  # auto (from the chat template), none, hermes, qwen3_coder, llama3_json, mistral
    log_format: str = "auto"  # json, console, auto (console on a TTY)
    log_level: str = "info"
    max_body_bytes: int = 32 * 2**20
    drain_timeout_s: float = 30.0
    max_waiting_seqs: int = 256  # sequences admitted and not yet running; past it new requests get 503
    max_waiting_tokens: int = 262_144  # their prompt tokens; past it too
    retry_after_s: int = 1  # the Retry-After of an overloaded 503 / 529
    max_pending_deltas: int = 64  # unread deltas per request; past it a slow reader's deltas are merged
    cors_allow_origins: str = ""  # comma-separated origins ("*" for any); empty: CORS off
    body_timeout_s: float = 60.0  # a request body not complete by then is refused (408)
    keep_alive_timeout_s: float = 5.0  # atom-anyio serve: an idle connection (or half-sent head) is closed
    segment_cache_tokens: int = 4_000_000
    prepare_threads: int = 4
    malloc_arena_max: int = 2  # glibc malloc arenas (MALLOC_ARENA_MAX); 0: glibc's default of 8 per core
    grammar_compile_timeout_s: float = 10.0  # a structured-output grammar that takes longer is a 400
    responses_store_max_items: int = 1000  # stored Responses, least recently used out first
    responses_store_ttl_s: float = 3600.0  # a stored Response expires this long after its last use

    def __post_init__(self) -> None:
        if self.context_overflow not in ("error", "drop_oldest"):
            raise ValueError("context_overflow must be 'error' or 'drop_oldest'")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.log_format not in ("json", "console", "auto"):
            raise ValueError("log_format must be json, console or auto")
        if min(self.max_waiting_seqs, self.max_waiting_tokens, self.max_pending_deltas) < 1:
            raise ValueError("max_waiting_seqs, max_waiting_tokens and max_pending_deltas must be at least 1")
        ParserSpec.detect(None, reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Config:
        """``ATOM_<FIELD>`` variables, then ``overrides`` (flags) on top."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"ATOM_{f.name.upper()}")
            if raw is not None and raw != "":
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @cached_property
    def engine(self) -> EngineConfig:
        return EngineConfig(
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_gib=self.kv_cache_gib,
            num_threads=self.num_threads,
            max_pending_deltas=self.max_pending_deltas,
        )

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = str(f.type)
    if "dict" in kind:
        return json.loads(raw)
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    if kind.startswith("bool"):
        return raw.lower() in ("1", "true", "yes", "on")
    return raw
