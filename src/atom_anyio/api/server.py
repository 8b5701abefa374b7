"""What every route shares: the loaded model, the engine, the prepare step,
admission and the lifetime that owns them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from atom_anyio.api.common import EngineFailed, Usage
from atom_anyio.api.errors import APIError
from atom_anyio.config import Config
from atom_anyio.engine.loop import Engine, EngineDeadError, EngineError
from atom_anyio.engine.sequence import Delta
from atom_anyio.models.loader import LoadedModel, load_model
from atom_anyio.obs.metrics import Metrics
from atom_anyio.obs.runtime import GCTimer, freeze_heap, monitor_loop_lag, thaw_heap
from atom_anyio.parse import ParserSpec
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
    """One request counted in flight; released exactly once."""

    def __init__(self, server: Server):
        self.server = server
        server.num_in_flight += 1
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.server._released()


class Server:
    """One per process. ``serving()`` is the lifetime: load, start the engine
    loop in a task group it owns, serve, then drain and cancel."""

    def __init__(self, config: Config, loaded: LoadedModel | None = None):
        self.config = config
        self.loaded = loaded
        self.engine: Engine | None = None
        self.prepare_ctx: PrepareContext | None = None
        self.parser_spec = ParserSpec()  # reasoning and tool-call parsers, from the effective chat template
        self.prepare_limiter = anyio.CapacityLimiter(config.prepare_threads)
        self.metrics = Metrics()
        self.is_admitting = False
        self.num_in_flight = 0
        self._idle: anyio.Event | None = None
        self.engine_crashed: anyio.Event | None = None
        self.started_at = time.time()

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or (self.loaded.name if self.loaded else "atom-anyio")

    @property
    def max_model_len(self) -> int:
        assert self.engine is not None
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.engine.is_running

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Server]:
        cfg = self.config
        if self.loaded is None:
            self.loaded = await anyio.to_thread.run_sync(load_model, cfg.model, cfg.dtype, cfg.device)
            log.info("model.loaded", model=self.loaded.name, dtype=cfg.dtype, device=cfg.device)
        self.engine = Engine(self.loaded, cfg.engine)
        self.prepare_ctx = await anyio.to_thread.run_sync(self._build_prepare_context)
        self.parser_spec = ParserSpec.detect(
            self.prepare_ctx.template_sources,
            reasoning_parser=cfg.reasoning_parser,
            tool_call_parser=cfg.tool_call_parser,
        )
        self.metrics.bind_engine(self.engine)
        self._idle = anyio.Event()
        self.engine_crashed = anyio.Event()
        gc_timer = GCTimer(self.metrics.gc_pause)
        async with anyio.create_task_group() as tg:
            await tg.start(self._run_engine)
            await self._warm_up()
            thresholds = freeze_heap()
            gc_timer.install()
            tg.start_soon(monitor_loop_lag, self.metrics.loop_lag)
            self.is_admitting = True
            try:
                yield self
            finally:
                self.is_admitting = False
                with anyio.move_on_after(cfg.drain_timeout_s, shield=True):
                    while self.num_in_flight:
                        await self._idle.wait()
                gc_timer.remove()
                thaw_heap(thresholds)
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

    async def _run_engine(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The engine loop; a crash marks the server unhealthy instead of
        tearing the process down mid-response (the CLI exits non-zero on it)."""
        assert self.engine is not None and self.engine_crashed is not None
        try:
            await self.engine.run(task_status=task_status)
        except Exception:
            self.engine_crashed.set()

    # per request

    def admit(self) -> Admission:
        """Count a request in flight until released; 503 when not serving."""
        if not self.is_admitting:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if not self.is_healthy:
            raise APIError(503, f"the engine is unavailable: {self.engine and self.engine.error}", code="engine_dead")
        return Admission(self)

    def _released(self) -> None:
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
            admission.release()
            self.finished(outcome, usage, status=200)  # the headers went out before the body

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
            admission.release()
            self.finished(outcome, usage, status)

    def finished(self, outcome: str, usage: Usage, status: int) -> None:
        """The line of a generation request, with its usage and timings."""
        record = self._take_record()
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

    def _take_record(self) -> RequestRecord:
        record = current_record.get()
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
        return [prepare_prompt(r, self.prepare_ctx) for r in requests]

    def run_in_prepare_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return anyio.to_thread.run_sync(fn, *args, limiter=self.prepare_limiter)

    def submit(self, prepared: PreparedPrompt, params: SamplingParams) -> MemoryObjectReceiveStream[Delta]:
        return self.submit_many([(prepared, params)])

    def submit_many(self, items: list[tuple[PreparedPrompt, SamplingParams]]) -> MemoryObjectReceiveStream[Delta]:
        assert self.engine is not None
        try:
            return self.engine.submit_many([(p.token_ids, p.block_hashes, params) for p, params in items])
        except EngineError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None

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
