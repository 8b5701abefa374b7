"""The serving runtime: built whole by ``serving()``, bound to by every route.

``serving(config)`` is the process's lifetime: load the model, build the
engine, the prepare context and the grammar compiler, start the engine loop
in a task group it owns, warm up, and yield a ``Runtime`` with nothing left
to fill in. On exit it drains (503 to new requests, in-flight ones finish
within ``drain_timeout_s``) and cancels the loop.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

from atom_anyio.api.errors import APIError
from atom_anyio.api.generation import Encoder, json_body, stream_body
from atom_anyio.api.http import sse_response
from atom_anyio.api.response_store import ResponseStore
from atom_anyio.api.tracker import Admission, RequestTracker, request_id
from atom_anyio.config import Config
from atom_anyio.engine.core import Engine, EngineStopped
from atom_anyio.engine.grammar import Grammars
from atom_anyio.engine.request import EngineRequest
from atom_anyio.engine.sampler import Sampler
from atom_anyio.engine.stream import RequestStream
from atom_anyio.generation_defaults import overridden
from atom_anyio.models.loader import LoadedModel, load_planned
from atom_anyio.models.plan import ModelPlan, plan_model
from atom_anyio.obs.loop_health import (
    GCTimer,
    anonymous_rss_bytes,
    freeze_heap,
    limit_malloc_arenas,
    monitor_loop_lag,
    release_freed_memory,
    thaw_heap,
)
from atom_anyio.obs.metrics import Metrics
from atom_anyio.parse import ParserSpec
from atom_anyio.prompt.prepare import PrepareContext, PreparedPrompt, PromptError, PromptRequest, prepare_prompt
from atom_anyio.prompt.segment_cache import SegmentCache
from atom_anyio.sampling_params import SamplingParams
from atom_anyio.settings import ConfigError

log = structlog.get_logger("atom_anyio.api")
GGUF_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)

# a route's wire format for its prepared prompts (their counts, text and reasoning state)
EncoderFor = Callable[[list[PreparedPrompt]], Encoder]


@dataclass
class Runtime:
    """Everything a request needs, complete from construction."""

    config: Config
    loaded: LoadedModel
    engine: Engine
    prepare_ctx: PrepareContext  # and through it the grammar compiler and the output parsers
    metrics: Metrics
    tracker: RequestTracker
    responses_store: ResponseStore
    crashed: anyio.Event  # set when the engine loop crashes
    prepare_limiter: anyio.CapacityLimiter
    started_at: float = field(default_factory=time.time)
    is_admitting: bool = False
    is_drained: bool = False
    engine_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or model_id(self.loaded.name)

    @property
    def parser_spec(self) -> ParserSpec:
        return self.prepare_ctx.parser_spec

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_in_flight(self) -> int:
        return self.tracker.num_in_flight

    @property
    def num_waiting_seqs(self) -> int:
        """The queue admission bounds: sequences in prepare and in the engine, not yet running."""
        return self.tracker.num_preparing_seqs + self.engine.num_waiting_seqs

    @property
    def num_waiting_tokens(self) -> int:
        return self.engine.num_waiting_tokens

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_running

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model != self.config.model:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    # one generation request

    async def generate(self, prompts: list[PromptRequest], *, is_stream: bool, encoder_for: EncoderFor) -> Any:
        """Admit, prepare (one worker-thread hop that builds each engine request whole), submit,
        respond: SSE events or the whole response, in the route's encoder."""
        admission = self.admit(sum(p.params.n for p in prompts))
        try:
            prepared = await self.prepare_many(prompts)
            encoder = encoder_for(prepared)
            stream = self.submit([p.request for p in prepared], admission)
        except BaseException:
            admission.release()
            raise
        if is_stream:
            return sse_response(stream_body(encoder, stream, admission))
        return await json_body(encoder.response(stream), encoder.usage, admission)

    def admit(self, num_seqs: int = 1) -> Admission:
        """Count a request in flight until finished; 503 when not serving or when its sequences
        would overflow the waiting queue (its prompt tokens are only known after prepare:
        ``submit`` checks those)."""
        cfg = self.config
        if not self.is_admitting:
            self.metrics.rejected.labels("shutting_down").inc()
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if not self.is_healthy:
            self.metrics.rejected.labels("engine_dead").inc()
            raise APIError(503, f"the engine is unavailable: {self.engine.error}", code="engine_dead")
        if num_seqs > cfg.max_waiting_seqs:
            raise APIError(
                400,
                f"The request has {num_seqs} choices; the waiting queue holds {cfg.max_waiting_seqs} "
                "(max_waiting_seqs).",
                param="n",
                code="limit_exceeded",
            )
        waiting = self.num_waiting_seqs
        if waiting and waiting + num_seqs > cfg.max_waiting_seqs:
            raise self._overloaded("max_waiting_seqs", f"{waiting} sequences are waiting")
        return self.tracker.admit(num_seqs)

    def _overloaded(self, limit: str, detail: str) -> APIError:
        self.metrics.rejected.labels(limit).inc()
        return APIError(
            503,
            f"The server is overloaded ({detail}; {limit}={getattr(self.config, limit)}); retry later.",
            code="overloaded",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    async def prepare_many(self, requests: list[PromptRequest]) -> list[PreparedPrompt]:
        """The request's one worker-thread hop: each prompt rendered, tokenized, hashed and cut,
        and its engine request built whole (grammar compiled, reasoning state found)."""
        t = time.perf_counter()
        try:
            prepared = await self.run_in_prepare_thread(_prepare_all, requests, self.prepare_ctx)
        finally:
            elapsed = time.perf_counter() - t
            self.metrics.prepare_seconds.observe(elapsed)
            structlog.contextvars.bind_contextvars(prepare_s=round(elapsed, 6))
        self.metrics.request_started(
            request_id(),
            sum(p.num_prompt_tokens for p in prepared),
            sum(p.num_segment_cache_hit_tokens for p in prepared),
        )
        return prepared

    async def run_in_prepare_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a prepare thread; a ``PromptError`` becomes the 400 that names its field."""
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.prepare_limiter)
        except PromptError as exc:
            raise _bad_prompt(exc) from None

    def submit(self, requests: list[EngineRequest], admission: Admission) -> RequestStream:
        """Queue the admitted request's prompts; 503 if their tokens would overflow the waiting
        queue (a request alone in the queue always fits) or the engine has stopped."""
        num_tokens = sum(r.num_prompt_tokens * r.params.n for r in requests)
        waiting = self.num_waiting_tokens
        if waiting and waiting + num_tokens > self.config.max_waiting_tokens:
            raise self._overloaded("max_waiting_tokens", f"{waiting} prompt tokens are waiting")
        try:
            stream = self.engine.submit_many(requests)
        except EngineStopped as exc:
            raise APIError(503, f"the engine is unavailable: {exc}", code="engine_dead") from None
        admission.submitted(stream)
        return stream

    # the end

    async def drain(self) -> None:
        """Stop admitting (503), let in-flight requests finish within the drain timeout, then stop
        the engine so the rest end with an error (an SSE error event or a 500 body). Idempotent."""
        self.is_admitting = False
        if self.is_drained:
            return
        timeout = self.config.drain_timeout_s
        t = time.perf_counter()
        log.info("server.draining", num_in_flight=self.num_in_flight, timeout_s=timeout)
        if not await self.tracker.wait_idle(timeout):
            log.warning("server.drain_timeout", num_in_flight=self.num_in_flight, timeout_s=timeout)
            self.engine.error = f"the server shut down (drain timeout of {timeout} s)"
            self.engine_scope.cancel()
            await self.tracker.wait_idle(5.0)  # their error events go out
        self.is_drained = True
        log.info("server.drained", duration_s=round(time.perf_counter() - t, 3))


def model_id(name: str) -> str:
    """The id served by default: the model's name without a GGUF quantization suffix
    (``SmolLM2-135M-Instruct.Q4_1`` -> ``SmolLM2-135M-Instruct``)."""
    return GGUF_QUANT_SUFFIX.sub("", name) or name


def _prepare_all(requests: list[PromptRequest], ctx: PrepareContext) -> list[PreparedPrompt]:
    return [prepare_prompt(r, ctx) for r in requests]


def _bad_prompt(exc: PromptError) -> APIError:
    return APIError(400, exc.message, param=exc.param, code=exc.code, anthropic_message=exc.anthropic_message)


@asynccontextmanager
async def serving(
    config: Config,
    loaded: LoadedModel | None = None,
    on_crash: Callable[[], None] | None = None,
    sampler: Sampler | None = None,
) -> AsyncIterator[Runtime]:
    """The lifetime: build everything (each phase logged with its duration), run the engine
    loop, serve; then drain and cancel. ``on_crash`` is called if the engine loop crashes."""
    t_start = time.perf_counter()
    if limit_malloc_arenas(config.malloc_arena_max):  # before the worker threads allocate
        log.info("malloc.arenas_limited", malloc_arena_max=config.malloc_arena_max)
    if loaded is None:
        with _phase("model.loaded", model=config.model or "default") as extra:
            loaded = _with_overrides(config, await anyio.to_thread.run_sync(_load, config))
            extra.update(name=loaded.name, dtype=loaded.model.dtype_name, device=config.device)
            extra.update(attention_backend=loaded.model.attention_backend.name)
            extra.update(generation_defaults=loaded.generation_defaults)  # what a request leaves out gets
    else:
        loaded = _with_overrides(config, loaded)
    with _phase("engine.built"):
        engine = Engine(loaded, config.engine, sampler)  # on the loop: its worker's limiter belongs to it
    with _phase("grammars.ready"):
        grammars = await anyio.to_thread.run_sync(_grammars, config, loaded, engine)
    with _phase("prompt.ready"):
        prepare_ctx = await anyio.to_thread.run_sync(_prepare_context, config, loaded, engine, grammars)
    metrics = Metrics(per_request=config.metrics_per_request)
    runtime = Runtime(
        config=config,
        loaded=loaded,
        engine=engine,
        prepare_ctx=prepare_ctx,
        metrics=metrics,
        tracker=RequestTracker(metrics),
        responses_store=ResponseStore(config.responses_store_max_items, config.responses_store_ttl_s),
        crashed=anyio.Event(),
        prepare_limiter=anyio.CapacityLimiter(config.prepare_threads),
    )
    metrics.bind_engine(engine, runtime.model_name)
    metrics.bind_admission(runtime)
    gc_timer = GCTimer(metrics.gc_pause)
    async with anyio.create_task_group() as tg:
        await tg.start(_run_engine, runtime, on_crash)
        with _phase("engine.warmed_up"):
            await _warm_up(runtime)
        freeze_heap()
        _release_freed_memory()
        gc_timer.install()
        tg.start_soon(monitor_loop_lag, metrics.loop_lag)
        runtime.is_admitting = True
        log.info("server.ready", model=runtime.model_name, startup_s=round(time.perf_counter() - t_start, 3))
        try:
            yield runtime
        finally:
            with anyio.CancelScope(shield=True):
                await runtime.drain()
            gc_timer.remove()
            thaw_heap()
            grammars.close()
            tg.cancel_scope.cancel()


def _release_freed_memory() -> None:
    """What loading and warming up freed goes back to the system, and the log says how much."""
    before = anonymous_rss_bytes()
    if release_freed_memory():
        after = anonymous_rss_bytes()
        known = before is not None and after is not None
        mib = {"rss_anon_mib": round(after / 2**20), "released_mib": round((before - after) / 2**20)} if known else {}
        log.info("malloc.trimmed", **mib)


class _phase:
    """Log ``event`` with the block's duration (and what the block adds to ``extra``)."""

    def __init__(self, event: str, **extra: Any):
        self.event, self.extra = event, extra

    def __enter__(self) -> dict[str, Any]:
        self.t = time.perf_counter()
        return self.extra

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            log.info(self.event, duration_s=round(time.perf_counter() - self.t, 3), **self.extra)


async def _run_engine(
    runtime: Runtime, on_crash: Callable[[], None] | None, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The engine loop; a crash marks the server unhealthy instead of tearing the process down
    mid-response (the CLI exits non-zero on it)."""
    try:
        with runtime.engine_scope:
            await runtime.engine.run(task_status=task_status)
    except Exception:
        runtime.crashed.set()
        if on_crash is not None:
            on_crash()


def _load(config: Config) -> LoadedModel:
    """The model; a model it cannot serve (unknown architecture, missing files) is a ``ConfigError``."""
    try:
        return load_planned(model_plan(config))
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"model {config.model or '(default)'}: {exc}") from None


def _with_overrides(config: Config, loaded: LoadedModel) -> LoadedModel:
    """The model with the server's ``override_generation_config`` over its sampling defaults."""
    if not config.override_generation_config:
        return loaded
    return dataclasses.replace(
        loaded, generation_defaults=overridden(loaded.generation_defaults, config.override_generation_config)
    )


def model_plan(config: Config) -> ModelPlan:
    """The plan (models/plan.py) the server loads its model as, from its settings."""
    engine = config.engine
    return plan_model(
        config.model,
        config.dtype,
        config.device,
        config.attention_backend,
        engine.tensor_parallel_size,
        config.gguf_weights,
        config.batch_invariant,
        config.hf_overrides,
        engine.cpu_native_kernels,
        engine.cpu_amx,
    )


async def _warm_up(runtime: Runtime) -> None:
    """One tiny generation, so the first client does not pay for lazy initialisation."""
    ids = runtime.loaded.tokenizer("warm up", add_special_tokens=False)["input_ids"] or [0]
    request = EngineRequest.of_tokens(ids, SamplingParams(max_tokens=1), runtime.engine)
    async with runtime.engine.submit(request) as stream:
        async for _ in stream:
            pass


def _prepare_context(config: Config, loaded: LoadedModel, engine: Engine, grammars: Grammars) -> PrepareContext:
    template = config.chat_template
    if template and _is_file(template):
        template = Path(template).read_text()
    return PrepareContext.for_engine(
        engine,
        loaded.tokenizer,
        segment_cache=SegmentCache(loaded.tokenizer, max_tokens=config.segment_cache_tokens),
        chat_template=template or loaded.chat_template,
        default_chat_template_kwargs=config.default_chat_template_kwargs,
        context_overflow=config.context_overflow,
        clamp_max_tokens=config.max_tokens_past_context == "clamp",
        default_max_tokens=loaded.generation_defaults.get("max_tokens"),
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
        grammars=grammars,
    )


def _grammars(config: Config, loaded: LoadedModel, engine: Engine) -> Grammars:
    return Grammars(
        loaded.tokenizer,
        loaded.config.vocab_size,
        engine.eos_token_ids,
        timeout_s=config.grammar_compile_timeout_s,
        num_threads=config.prepare_threads,
    )


def _is_file(path: str) -> bool:
    """Whether ``chat_template`` names a file; an inline template longer than a file name may be is not one."""
    try:
        return Path(path).is_file()
    except OSError:
        return False
