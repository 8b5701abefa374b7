"""What every route shares: the loaded model, the engine, the prepare step,
admission and the lifetime that owns them."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

from atom_anyio.api.common import EngineFailed, Usage
from atom_anyio.api.errors import APIError
from atom_anyio.config import Config
from atom_anyio.engine.grammar import Constraint, GrammarError, Grammars
from atom_anyio.engine.loop import Engine, EngineDeadError, EngineError
from atom_anyio.engine.stream import DeltaStream
from atom_anyio.models.loader import LoadedModel, load_model
from atom_anyio.obs.metrics import Metrics
from atom_anyio.obs.runtime import GCTimer, freeze_heap, limit_malloc_arenas, monitor_loop_lag, thaw_heap
from atom_anyio.parse import ParserSpec
from atom_anyio.parse.reasoning import opens_reasoning
from atom_anyio.prompt.prepare import PrepareContext, PreparedPrompt, PromptError, PromptRequest, prepare_prompt
from atom_anyio.prompt.segment_cache import SegmentCache
from atom_anyio.sampling_params import SamplingParams

log = structlog.get_logger("atom_anyio.server")


def request_id() -> str | None:
    """The current request's id (bound by the app for each request)."""
    return structlog.contextvars.get_contextvars().get("request_id")


@dataclass
class RequestRecord:
    """One HTTP request's ``request.finished`` line, written exactly once: by the
    generation path with its usage (an SSE body when it ends), else by the app
    when the request context closes, from the response status."""

    endpoint: str  # the route's label, or "other": a bounded set of values
    status: int | None = None  # the response's, once there is one
    is_streamed: bool = False
    is_logged: bool = False


current_record: ContextVar[RequestRecord | None] = ContextVar("atom_request_record", default=None)


def outcome_of(status: int) -> str:
    """ok below 400, refused for a client error, cancelled for 499 (the client left), else error."""
    if status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    return "refused" if status < 500 else "error"


class Admission:
    """One request from admission to its last byte: counted in flight (and
    its sequences as waiting until submitted), finished exactly once. If the
    response body never starts (the client left before the first byte), the
    HTTP connection's end finishes it: the stream is closed, so the engine
    aborts its sequences, and the request is released."""

    def __init__(self, server: Server, num_seqs: int):
        self.server = server
        self.record = current_record.get()  # the connection's scope may finish it outside the request
        self.num_seqs = num_seqs
        self.stream: DeltaStream | None = None
        self.is_finished = False
        server.num_in_flight += 1
        server.num_preparing_seqs += num_seqs
        connection = _connection_admissions.get()
        if connection is not None:
            connection.append(self)

    def submitted(self, stream: DeltaStream) -> None:
        self.stream = stream
        self.server.num_preparing_seqs -= self.num_seqs
        self.num_seqs = 0

    def release(self) -> None:
        """Stop counting the request (its stream, if any, is closed)."""
        if not self.is_finished:
            self.is_finished = True
            if self.stream is not None:
                self.stream.close()
            self.server._released(self.num_seqs)

    def finish(self, outcome: str, usage: Usage, status: int) -> None:
        if not self.is_finished:
            self.release()
            self.server.finished(outcome, usage, status, self.record)


_connection_admissions: ContextVar[list[Admission] | None] = ContextVar("connection_admissions", default=None)


@contextmanager
def connection_scope() -> Iterator[None]:
    """Around one HTTP connection's handling: admissions made inside it and
    never finished (a body that never started) end as cancelled."""
    admissions: list[Admission] = []
    token = _connection_admissions.set(admissions)
    try:
        yield
    finally:
        _connection_admissions.reset(token)
        for admission in admissions:
            admission.finish("cancelled", Usage(), 499)


class Server:
    """One per process. ``serving()`` is the lifetime: load, start the engine
    loop in a task group it owns, serve, then drain and cancel."""

    def __init__(self, config: Config, loaded: LoadedModel | None = None):
        self.config = config
        self.loaded = loaded
        self.engine: Engine | None = None
        self.prepare_ctx: PrepareContext | None = None
        self.grammars: Grammars | None = None  # structured outputs' compiler, built with the engine
        self.parser_spec = ParserSpec()  # reasoning and tool-call parsers, from the effective chat template
        self.prepare_limiter = anyio.CapacityLimiter(config.prepare_threads)
        self.metrics = Metrics()
        self.is_admitting = False
        self.num_in_flight = 0
        self.num_preparing_seqs = 0  # admitted, not yet submitted: waiting too
        self._idle: anyio.Event | None = None
        self.engine_crashed: anyio.Event | None = None
        self._engine_scope: anyio.CancelScope | None = None
        self._is_drained = False
        self.started_at = time.time()

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or (self.loaded.name if self.loaded else "atom-anyio")

    @property
    def max_model_len(self) -> int:
        assert self.engine is not None
        return self.engine.max_model_len

    @property
    def num_waiting_seqs(self) -> int:
        """The queue admission bounds: sequences in prepare and in the engine, not yet running."""
        return self.num_preparing_seqs + (self.engine.num_waiting_seqs if self.engine else 0)

    @property
    def num_waiting_tokens(self) -> int:
        return self.engine.num_waiting_tokens if self.engine else 0

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.engine.is_running

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Server]:
        cfg = self.config
        if limit_malloc_arenas(cfg.malloc_arena_max):  # before the worker threads allocate
            log.info("malloc.arenas_limited", malloc_arena_max=cfg.malloc_arena_max)
        if self.loaded is None:
            self.loaded = await anyio.to_thread.run_sync(
                load_model, cfg.model, cfg.dtype, cfg.device, cfg.attention_backend
            )
        model = self.loaded.model
        log.info(
            "model.loaded",
            model=self.loaded.name,
            dtype=model.dtype_name,
            device=cfg.device,
            attention_backend=model.attention_backend.name,
        )
        self.engine = Engine(self.loaded, cfg.engine)
        self.prepare_ctx = await anyio.to_thread.run_sync(self._build_prepare_context)
        self.parser_spec = ParserSpec.detect(
            self.prepare_ctx.template_sources,
            reasoning_parser=cfg.reasoning_parser,
            tool_call_parser=cfg.tool_call_parser,
        )
        self.grammars = await anyio.to_thread.run_sync(self._build_grammars)
        self.metrics.bind_engine(self.engine)
        self.metrics.bind_admission(self)
        self._idle = anyio.Event()
        self.engine_crashed = anyio.Event()
        gc_timer = GCTimer(self.metrics.gc_pause)
        self._engine_scope, self._is_drained = anyio.CancelScope(), False
        async with anyio.create_task_group() as tg:
            await tg.start(self._run_engine)
            await self._warm_up()
            freeze_heap()
            gc_timer.install()
            tg.start_soon(monitor_loop_lag, self.metrics.loop_lag)
            self.is_admitting = True
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self.drain()
                gc_timer.remove()
                thaw_heap()
                self.grammars.close()
                tg.cancel_scope.cancel()

    async def _warm_up(self) -> None:
        """One tiny generation, so the first client does not pay for lazy initialisation."""
        assert self.engine is not None
        ids = self.loaded.tokenizer("warm up", add_special_tokens=False)["input_ids"] or [0]
        async with self.engine.submit(ids, SamplingParams(max_tokens=1)) as stream:
            async for _ in stream:
                pass

    def _build_prepare_context(self) -> PrepareContext:
        assert self.loaded is not None and self.engine is not None
        tok = self.loaded.tokenizer
        template = self.config.chat_template
        if template and _is_file(template):
            template = Path(template).read_text()
        return PrepareContext(
            tokenizer=tok,
            segment_cache=SegmentCache(tok, max_tokens=self.config.segment_cache_tokens),
            max_model_len=self.engine.max_model_len,
            block_size=self.engine.cfg.block_size,
            chat_template=template or self.loaded.chat_template,
            default_chat_template_kwargs=self.config.default_chat_template_kwargs,
            context_overflow=self.config.context_overflow,
        )

    def _build_grammars(self) -> Grammars:
        assert self.loaded is not None and self.engine is not None
        return Grammars(
            self.loaded.tokenizer,
            self.loaded.config.vocab_size,
            self.engine.eos_token_ids,
            timeout_s=self.config.grammar_compile_timeout_s,
            num_threads=self.config.prepare_threads,
        )

    async def _run_engine(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The engine loop; a crash marks the server unhealthy instead of
        tearing the process down mid-response (the CLI exits non-zero on it)."""
        assert self.engine is not None and self.engine_crashed is not None
        try:
            with self._engine_scope:
                await self.engine.run(task_status=task_status)
        except Exception:
            self.engine_crashed.set()

    async def drain(self) -> None:
        """Stop admitting (503), let in-flight requests finish within the
        drain timeout, then stop the engine so the rest end with an error
        (an SSE error event or a 500 body). Idempotent."""
        self.is_admitting = False
        if self._is_drained or self.engine is None:
            return
        if not await self._wait_idle(self.config.drain_timeout_s):
            log.warning("server.drain_timeout", num_in_flight=self.num_in_flight, timeout_s=self.config.drain_timeout_s)
            self.engine.error = f"the server shut down (drain timeout of {self.config.drain_timeout_s} s)"
            self._engine_scope.cancel()
            await self._wait_idle(5.0)  # their error events go out
        self._is_drained = True

    async def _wait_idle(self, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            while self.num_in_flight:
                await self._idle.wait()
        return not self.num_in_flight

    # per request

    def admit(self, num_seqs: int = 1) -> Admission:
        """Count a request in flight until finished; 503 when not serving or
        when its sequences would overflow the waiting queue (prompt tokens
        are only known after prepare: ``submit`` checks those)."""
        if not self.is_admitting:
            self.metrics.rejected.labels("shutting_down").inc()
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if not self.is_healthy:
            self.metrics.rejected.labels("engine_dead").inc()
            raise APIError(503, f"the engine is unavailable: {self.engine and self.engine.error}", code="engine_dead")
        if num_seqs > self.config.max_waiting_seqs:
            raise APIError(
                400,
                f"The request has {num_seqs} choices; the waiting queue holds {self.config.max_waiting_seqs} "
                "(max_waiting_seqs).",
                param="n",
                code="limit_exceeded",
            )
        waiting = self.num_waiting_seqs
        if waiting and waiting + num_seqs > self.config.max_waiting_seqs:
            raise self._overloaded("max_waiting_seqs", f"{waiting} sequences are waiting")
        return Admission(self, num_seqs)

    def _overloaded(self, limit: str, detail: str) -> APIError:
        self.metrics.rejected.labels(limit).inc()
        value = getattr(self.config, limit)
        return APIError(
            503,
            f"The server is overloaded ({detail}; {limit}={value}); retry later.",
            code="overloaded",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    def _released(self, num_preparing_seqs: int) -> None:
        self.num_preparing_seqs -= num_preparing_seqs
        self.num_in_flight -= 1
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = anyio.Event()

    def stream_events(
        self,
        events: AsyncIterator[str],
        usage: Usage,
        admission: Admission,
        error_event: Callable[[APIError], str],
    ) -> AsyncIterator[str]:
        """An SSE body: the encoder's events, an error event if the engine
        fails mid-stream, then release the request (and write its line)."""
        if (record := current_record.get()) is not None:
            record.is_streamed = True
        return self._stream_events(events, usage, admission, error_event)

    async def _stream_events(
        self,
        events: AsyncIterator[str],
        usage: Usage,
        admission: Admission,
        error_event: Callable[[APIError], str],
    ) -> AsyncIterator[str]:
        outcome = "cancelled"
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
            outcome = "ok"
        except EngineFailed as exc:
            outcome = "error"
            yield error_event(APIError(500, f"The engine failed while generating: {exc}", code="engine_error"))
        except APIError as exc:
            outcome = "error"
            yield error_event(exc)
        finally:
            admission.finish(outcome, usage, status=200)  # the headers went out before the body

    async def json_response(self, body: Awaitable[dict], usage: Usage, admission: Admission) -> dict:
        outcome, status = "cancelled", 499  # client closed the request
        try:
            result = await body
            outcome, status = "ok", 200
            return result
        except EngineFailed as exc:
            outcome, status = "error", 500
            raise APIError(500, f"The engine failed while generating: {exc}", code="engine_error") from None
        except APIError as exc:
            outcome, status = outcome_of(exc.status), exc.status
            raise
        finally:
            admission.finish(outcome, usage, status)

    def finished(self, outcome: str, usage: Usage, status: int, record: RequestRecord | None = None) -> None:
        """The line of a generation request, with its usage and timings."""
        record = self._take_record(record)
        self.metrics.observe_finished(record.endpoint, outcome, usage, request_id())
        log.info(
            "request.finished",
            endpoint=record.endpoint,
            outcome=outcome,
            status=status,
            finish_reason=usage.finish_reason,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            generated_tokens=usage.completion_tokens,
            **{f"{k}_s": round(v, 6) for k, v in usage.timings.items()},
        )

    def request_closed(self) -> None:
        """The request context closes: the line of any request no generation path wrote
        (refused, or not a generation), from its response status (499: none, the client left)."""
        record = current_record.get()
        if record is None or record.is_logged or record.is_streamed:
            return
        record.is_logged = True
        status = record.status or 499
        outcome = outcome_of(status)
        self.metrics.requests.labels(record.endpoint, outcome).inc()
        log.info("request.finished", endpoint=record.endpoint, outcome=outcome, status=status)

    def _take_record(self, record: RequestRecord | None) -> RequestRecord:
        record = record or current_record.get()
        if record is None:  # driven without the app (no HTTP request)
            return RequestRecord("other", is_logged=True)
        assert not record.is_logged, "one request.finished line per request"
        record.is_logged = True
        return record

    async def prepare(self, request: PromptRequest) -> PreparedPrompt:
        return (await self.prepare_many([request]))[0]

    async def prepare_many(self, requests: list[PromptRequest]) -> list[PreparedPrompt]:
        """The request's one worker-thread hop: render, tokenize, hash, cut."""
        t = time.perf_counter()
        try:
            prepared = await anyio.to_thread.run_sync(self._prepare_all, requests, limiter=self.prepare_limiter)
        except PromptError as exc:
            raise APIError(400, exc.message, param=exc.param, code=exc.code) from None
        except GrammarError as exc:
            raise APIError(400, exc.message, param=exc.param, code="invalid_value") from None
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

    def _prepare_all(self, requests: list[PromptRequest]) -> list[PreparedPrompt]:
        return [self._prepare_one(r) for r in requests]

    def _prepare_one(self, request: PromptRequest) -> PreparedPrompt:
        prepared = prepare_prompt(request, self.prepare_ctx)
        if request.structured is None:
            return prepared
        return dataclasses.replace(prepared, constraint=self._constraint(request, prepared.text))

    def _constraint(self, request: PromptRequest, prompt_text: str | None) -> Constraint:
        """The request's grammar; with a reasoning model whose prompt leaves the reasoning block
        open, it starts after the block's end tag."""
        grammar = self.grammars.compile(request.structured)
        tags = self.parser_spec.reasoning_tags
        if tags is None or not opens_reasoning(prompt_text, tags):
            return Constraint(grammar)
        end_ids = self.loaded.tokenizer.encode(tags[1], add_special_tokens=False)
        return Constraint(grammar, start_after=tuple(end_ids))

    def run_in_prepare_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return anyio.to_thread.run_sync(fn, *args, limiter=self.prepare_limiter)

    def submit(self, prepared: PreparedPrompt, params: SamplingParams, admission: Admission) -> DeltaStream:
        return self.submit_many([(prepared, params)], admission)

    def submit_many(self, items: list[tuple[PreparedPrompt, SamplingParams]], admission: Admission) -> DeltaStream:
        """Queue the admitted request's prompts; 503 if their tokens would
        overflow the waiting queue (a request alone in the queue always fits)."""
        assert self.engine is not None
        num_tokens = sum(p.num_prompt_tokens * params.n for p, params in items)
        waiting = self.num_waiting_tokens
        if waiting and waiting + num_tokens > self.config.max_waiting_tokens:
            raise self._overloaded("max_waiting_tokens", f"{waiting} prompt tokens are waiting")
        try:
            stream = self.engine.submit_many(
                [(p.token_ids, p.block_hashes, params, p.constraint) for p, params in items]
            )
        except EngineError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        admission.submitted(stream)
        return stream

    async def stop_on_crash(self) -> None:
        """Return when the engine crashes (the CLI then exits non-zero)."""
        while self.engine_crashed is None:
            await anyio.sleep(0.05)
        await self.engine_crashed.wait()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model != self.config.model:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _is_file(path: str) -> bool:
    """Whether ``chat_template`` names a file; an inline template longer than a file name may be is not one."""
    try:
        return Path(path).is_file()
    except OSError:
        return False
