"""The server's one frozen configuration: its own settings, and the engine's nested in it.

Every setting is an ``ATOM_<NAME>`` variable and a ``serve --<name>`` flag (``settings.py``);
variables are read here and nowhere else. A bad value is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.generation_defaults import from_override
from atom_anyio.models.plan import BACKENDS, DTYPES, GGUF_WEIGHTS
from atom_anyio.parse import ParserSpec
from atom_anyio.prompt.drop_oldest import CONTEXT_OVERFLOW_POLICIES
from atom_anyio.settings import ConfigError, parse_setting, setting, setting_name, settings_of

log = structlog.get_logger("atom_anyio.config")

LOG_FORMATS = ("json", "console", "auto")
# read where they are used: the loader's conversion cache; the CPU kind the kernels are built for (process-wide)
NOT_SETTINGS = ("ATOM_CACHE_DIR", "ATOM_KERNEL_ISA")
MAX_TOKENS_PAST_CONTEXT = ("clamp", "error")


@dataclass(frozen=True)
class Config:
    model: str | None = setting(None, "Hugging Face directory or GGUF file (default: SmolLM2-135M-Instruct)")
    dtype: str = setting("auto", f"one of {', '.join(DTYPES)}; auto: the fastest faithful one for the device")
    gguf_weights: str = setting(
        "auto", "a GGUF's quantized layers: packed (CPU), dequantize, or auto (packed on the CPU when dtype is auto)"
    )
    hf_overrides: dict[str, Any] = setting(
        {},
        "JSON object merged into the model's config (vLLM's --hf-overrides), e.g. a YaRN rope_scaling and "
        "max_position_embeddings for a longer context; a GGUF takes the same keys, or its metadata keys "
        "(llama.context_length)",
    )
    override_generation_config: dict[str, Any] = setting(
        {},
        "JSON object over the model's sampling defaults (vLLM's --override-generation-config), by their "
        "generation_config.json keys: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens, "
        'the max_tokens of a request that sets none, e.g. {"max_new_tokens": 1024}',
    )
    device: str = setting("cpu", "cpu, cuda, cuda:N")
    attention_backend: str = setting("auto", f"one of {', '.join(BACKENDS)} (docs/engine.md)")
    batch_invariant: bool | None = setting(
        None,
        "a sequence's logits the same bits alone or batched, chunked or cached (CPU); default: on where it costs "
        "nothing (bfloat16 on AMX), true: everywhere, at a cost elsewhere (docs/engine.md)",
    )
    served_model_name: str | None = setting(None, "the model id clients send (default: from the model's name)")
    api_key: str | None = setting(None, "require this key (Authorization: Bearer, or x-api-key)", repr=False)
    host: str = setting("127.0.0.1", "address to listen on (atom-anyio serve)")
    port: int = setting(8000, "port to listen on (atom-anyio serve)")
    chat_template: str | None = setting(None, "a chat template file or the template itself (default: the model's)")
    default_chat_template_kwargs: dict[str, Any] = setting({}, "JSON object of template variables for every request")
    context_overflow: str = setting("error", "a chat over the context: error, or drop_oldest messages")
    max_tokens_past_context: str = setting(
        "clamp", "a max_tokens past what the context leaves: clamp (the completion gets the rest), or error (vLLM)"
    )
    reasoning_parser: str = setting("auto", "auto (from the chat template), none, or a parser name")
    tool_call_parser: str = setting("auto", "auto (from the chat template), none, hermes, qwen3_coder, ...")
    log_format: str = setting("auto", "json, console, or auto (console on a TTY)")
    log_level: str = setting("info", "debug, info, warning, error")
    max_body_bytes: int = setting(32 * 2**20, "largest request body accepted (413 past it)")
    drain_timeout_s: float = setting(30.0, "on SIGTERM: how long in-flight requests may take to finish")
    max_waiting_seqs: int = setting(256, "sequences admitted and not yet running; past it new requests get 503")
    max_waiting_tokens: int = setting(262_144, "prompt tokens of the waiting sequences; past it too")
    retry_after_s: int = setting(1, "the Retry-After of an overloaded 503 / 529")
    cors_allow_origins: str = setting("", "comma-separated CORS origins (* for any); empty: CORS off")
    body_timeout_s: float = setting(60.0, "a request body not complete by then is refused (408)")
    keep_alive_timeout_s: float = setting(5.0, "an idle connection (or half-sent head) is closed after it")
    segment_cache_tokens: int = setting(4_000_000, "tokens the prompt segment cache keeps")
    prepare_threads: int = setting(4, "worker threads for preparing prompts (render, tokenize, grammars)")
    malloc_arena_max: int = setting(2, "glibc malloc arenas; 0: glibc's default of 8 per core")
    grammar_compile_timeout_s: float = setting(10.0, "a structured-output grammar that takes longer is a 400")
    responses_store_max_items: int = setting(1000, "stored Responses, least recently used out first")
    metrics_per_request: bool = setting(
        False, "a context-tokens gauge labelled by request id while the request runs (debugging; bounded by it)"
    )
    responses_store_ttl_s: float = setting(3600.0, "a stored Response expires this long after its last use")
    responses_seal_key: str | None = setting(
        None,
        "the secret that authenticates Responses' encrypted_content (reasoning, compaction items) clients send "
        "back; unset: a random one per process, so such items do not survive a restart",
        repr=False,
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        _one_of("context_overflow", self.context_overflow, CONTEXT_OVERFLOW_POLICIES)
        _one_of("max_tokens_past_context", self.max_tokens_past_context, MAX_TOKENS_PAST_CONTEXT)
        _one_of("attention_backend", self.attention_backend, BACKENDS)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("gguf_weights", self.gguf_weights, GGUF_WEIGHTS)
        _one_of("log_format", self.log_format, LOG_FORMATS)
        if min(self.max_waiting_seqs, self.max_waiting_tokens, self.prepare_threads) < 1:
            raise ConfigError("max_waiting_seqs, max_waiting_tokens and prepare_threads must be at least 1")
        try:
            from_override(self.override_generation_config)
        except ValueError as exc:
            raise ConfigError(f"override_generation_config: {exc}") from None
        if self.model is not None and not os.path.exists(self.model):
            raise ConfigError(f"model: no such file or directory: {self.model}")
        try:
            ParserSpec.detect(None, reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.device == "cpu":  # last: the kernels import torch, which the checks above need not wait for
            from atom_anyio import kernels

            kernels.kernel_isa()  # ATOM_KERNEL_ISA, read where the kernels are built: a bad one fails here

    @classmethod
    def of(cls, **settings: Any) -> Config:
        """From settings by their names (the server's and the engine's alike; the variable and flag
        names), nothing from the environment. A string for a setting with its own parser is parsed."""
        fields = {setting_name(f): (owner, f) for owner, f in all_settings()}
        if unknown := settings.keys() - fields.keys():
            raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values: dict[type, dict[str, Any]] = {cls: {}, EngineConfig: {}}
        for name, value in settings.items():
            owner, f = fields[name]
            if isinstance(value, str) and f.metadata.get("parse"):
                value = parse_setting(owner, f, value, name)
            values[owner][f.name] = value
        try:
            return cls(**values[cls], engine=EngineConfig(**values[EngineConfig]))
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """``ATOM_<NAME>`` variables, then ``overrides`` (flags, by setting name; None: not given) on top."""
        env = os.environ if environ is None else environ
        for variable, nearest in unknown_variables(env):
            log.warning("config.unknown_variable", variable=variable, nearest=nearest)
        values: dict[str, Any] = {}
        for owner, f in all_settings():
            name = setting_name(f)
            raw = env.get(f"ATOM_{name.upper()}")
            if raw is not None and raw != "":
                values[name] = parse_setting(owner, f, raw, f"ATOM_{name.upper()}={raw}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.of(**values)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Each ``ATOM_*`` variable that names no setting, with the setting variable nearest to it
    (a misspelt one would otherwise be ignored without a word)."""
    names = [f"ATOM_{setting_name(f).upper()}" for _, f in all_settings()]
    unknown = sorted(v for v in environ if v.startswith("ATOM_") and v not in names and v not in NOT_SETTINGS)
    return [(v, next(iter(difflib.get_close_matches(v, names, n=1)), None)) for v in unknown]


def env_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from its ``ATOM_<NAME>`` variable (None when unset), for the offline ``LLM``,
    which takes no ``Config``."""
    env = os.environ if environ is None else environ
    for owner, f in all_settings():
        if setting_name(f) == name and (raw := env.get(f"ATOM_{name.upper()}")):
            return parse_setting(owner, f, raw, f"ATOM_{name.upper()}={raw}")
    return None


def all_settings() -> Iterator[tuple[type, dataclasses.Field]]:
    """Every setting, as (its dataclass, its field): the server's, then the engine's."""
    for f in settings_of(Config):
        yield Config, f
    for f in settings_of(EngineConfig):
        yield EngineConfig, f


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}")
