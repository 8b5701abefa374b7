"""One request's prompt, made into the engine's finished request: rendered, tokenized, cut to
the context, hashed, its reasoning state found, its grammar compiled, its max_tokens resolved.

``prepare_prompt`` is the only tokenization a request gets; the engine never encodes again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import structlog

from atom_anyio.engine.block_hash import block_hash_chain, salted_root
from atom_anyio.engine.grammar import Constraint, GrammarError, Grammars
from atom_anyio.engine.request import EngineRequest, KVLease
from atom_anyio.parse import ParserSpec
from atom_anyio.parse.reasoning import opens_reasoning
from atom_anyio.prompt.drop_oldest import CONTEXT_OVERFLOW_POLICIES, drop_oldest
from atom_anyio.prompt.render import (
    RESERVED_TEMPLATE_VARIABLES,
    compile_chat_template,
    default_tools,
    reads_tools,
    render_chat,
)
from atom_anyio.prompt.segment_cache import SegmentCache, Tokenized
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs

log = structlog.get_logger("atom_anyio.prompt")

TRUNCATION_MODES = ("disabled", "auto", "drop_oldest")


class PromptError(ValueError):
    """A prompt that cannot be prepared; the API layer answers 400 in its own error shape."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",
        param: str | None = None,
        anthropic_message: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code  # "invalid_value" or "context_length_exceeded"
        self.param = param  # the request field at fault
        self.anthropic_message = anthropic_message  # Anthropic's own wording, which its clients read


@dataclass(frozen=True)
class PromptRequest:
    """One prompt of a request as its route parsed it (exactly one of messages, prompt,
    prompt_token_ids) and how to continue it."""

    messages: list[dict] | None = None  # chat; content already flattened to str
    prompt: str | None = None  # completions, raw text
    prompt_token_ids: list[int] | None = None  # completions, token ids
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None  # merged over the server's defaults
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # the route's sampling, as asked: params.max_tokens None is the rest of the context (resolved here)
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=None))
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens; -1: as many as fit
    truncation: str | None = None  # None: the server's policy; "disabled"; "auto"/"drop_oldest"
    structured: StructuredOutputs | None = None  # compiled in the same step, by the context's grammar compiler
    lease: KVLease = KVLease()  # how the request's KV outlasts it: its conversation and TTL, from the API's hints
    cache_salt: str | None = None  # vLLM's: a tenant's prefix hits kept from another's
    priority: int = 0  # vLLM's: lower first, under the engine's scheduling_policy=priority

    @property
    def param(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    @property
    def num_reserved_output_tokens(self) -> int:
        return self.params.max_tokens if self.params.max_tokens is not None else 1


@dataclass(frozen=True)
class PrepareContext:
    """Everything ``prepare_prompt`` reads besides the request; built once at startup."""

    tokenizer: Any
    segment_cache: SegmentCache
    max_model_len: int
    block_size: int
    chat_template: str | Mapping[str, str] | None = None  # None: the tokenizer's
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    context_overflow: str = "error"  # or "drop_oldest": drop the oldest messages of a chat that does not fit
    max_kv_tokens: int | None = None  # the most one sequence can hold in the engine's KV pool; None: no bound
    model_vocab_size: int | None = None  # the model's embedding rows (the bound on token ids); None: the tokenizer's
    default_max_tokens: int | None = None  # for a request without max_tokens (the model's max_new_tokens); None: no cap
    priority_scheduling: bool = False  # the engine's scheduling_policy is priority: a request may set one
    # a max_tokens past the context: the completion gets the rest of it (True), or the request is refused (vLLM)
    clamp_max_tokens: bool = True
    # ParserSpec.detect's choices over the served template: "auto" detects, "none" (offline) leaves the
    # output unparsed, so no prompt opens a reasoning block
    reasoning_parser: str = "none"
    tool_call_parser: str = "none"
    grammars: Grammars | None = None  # compiles a request's structured outputs; None: it has none (offline)

    @classmethod
    def for_engine(cls, engine: Any, tokenizer: Any, **kwargs: Any) -> PrepareContext:
        """The context an ``Engine`` serves: its context length, block size, pool and vocabulary."""
        return cls(
            tokenizer=tokenizer,
            segment_cache=kwargs.pop("segment_cache", None) or SegmentCache(tokenizer),
            max_model_len=engine.max_model_len,
            block_size=engine.cfg.block_size,
            max_kv_tokens=engine.max_kv_tokens,
            model_vocab_size=engine.model_config.vocab_size,
            priority_scheduling=engine.cfg.scheduling_policy == "priority",
            **kwargs,
        )

    def __post_init__(self) -> None:
        if self.context_overflow not in CONTEXT_OVERFLOW_POLICIES:
            raise ValueError(
                f"context_overflow must be one of {CONTEXT_OVERFLOW_POLICIES}, got {self.context_overflow!r}"
            )
        if self.segment_cache.tokenizer is not self.tokenizer:
            raise ValueError("segment_cache must wrap this context's tokenizer")
        if self.max_model_len < 1 or self.block_size < 1:
            raise ValueError("max_model_len and block_size must be at least 1")
        if reserved := RESERVED_TEMPLATE_VARIABLES & self.default_chat_template_kwargs.keys():
            raise ValueError(f"default_chat_template_kwargs may not set {sorted(reserved)}")
        sources = self.template_sources
        for source in sources.values() if isinstance(sources, Mapping) else [sources]:
            if source is not None:
                compile_chat_template(source)  # a broken template fails at startup, not per request
        if self.parser_spec.reasoning_tags is not None and not self.reasoning_end_ids:  # encoded once, here
            raise ValueError(f"the reasoning end tag {self.parser_spec.reasoning_tags[1]!r} encodes to no tokens")

    @property
    def template_sources(self) -> str | Mapping[str, str] | None:
        if self.chat_template is not None:
            return self.chat_template
        return getattr(self.tokenizer, "chat_template", None)

    @functools.cached_property
    def template_globals(self) -> dict[str, Any]:
        """What every render sees under the request's kwargs: bos/eos tokens and the server's defaults."""
        return {**self.tokenizer.special_tokens_map, **self.default_chat_template_kwargs}

    @functools.cached_property
    def vocab_size(self) -> int:
        return self.model_vocab_size or len(self.tokenizer)

    @functools.cached_property
    def parser_spec(self) -> ParserSpec:
        """Which parsers read the output (reasoning tags, tool-call format), from the served template;
        one that reads no tools gets them in the default format (``default_tools``), parsed as such."""
        sources = self.template_sources
        tool_source = sources.get("tool_use", sources.get("default")) if isinstance(sources, Mapping) else sources
        return ParserSpec.detect(
            sources,
            reasoning_parser=self.reasoning_parser,
            tool_call_parser=self.tool_call_parser,
            renders_default_tools=tool_source is not None and not reads_tools(tool_source),
        )

    @functools.cached_property
    def reasoning_end_ids(self) -> tuple[int, ...]:
        """The reasoning block's end tag as tokens; () for output without reasoning tags."""
        tags = self.parser_spec.reasoning_tags
        return () if tags is None else tuple(self.tokenizer.encode(tags[1], add_special_tokens=False))

    def num_reserved_output_tokens(self, request: PromptRequest) -> int:
        """What a cut of the prompt leaves for the completion: its max_tokens, or one token where
        that is the whole context and would be clamped anyway."""
        num = request.num_reserved_output_tokens
        return 1 if self.clamp_max_tokens and num >= self.max_model_len else num

    def template_for(self, tools: list[dict] | None) -> jinja2.Template:
        return compile_chat_template(self._source_for(tools))

    def reads_tools(self, tools: list[dict] | None) -> bool:
        """Whether the template ``template_for(tools)`` renders tools itself; else they take the default format."""
        return reads_tools(self._source_for(tools))

    def _source_for(self, tools: list[dict] | None) -> str:
        source = self.template_sources
        if isinstance(source, Mapping):
            source = source.get("tool_use") if tools and "tool_use" in source else source.get("default")
        if source is None:
            raise PromptError("this model has no chat template; send a raw prompt instead", param="messages")
        return source


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt, prepared: the engine's finished request, and what the route reports of the prompt."""

    request: EngineRequest
    text: str | None  # the text the engine runs (None for a prompt given as token ids)
    num_segment_cache_hit_tokens: int = 0
    num_dropped_messages: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def opens_reasoning(self) -> bool:
        """The prompt ends inside a reasoning block: the output starts in the reasoning channel."""
        return bool(self.request.reasoning_end_ids)


def prepare_prompt(request: PromptRequest, ctx: PrepareContext) -> PreparedPrompt:
    """Render, tokenize (through the segment cache), cut to the context and hash one request's
    prompt, then build its engine request whole: max_tokens resolved, the sampling's token ids
    checked, the open reasoning block found (a scan of the whole prompt) and the grammar compiled.
    Plain synchronous code, meant for one worker-thread hop; raises ``PromptError``."""
    _validate(request)
    prepare = _prepare_chat if request.messages is not None else _prepare_completion
    text, token_ids, num_hits, num_dropped = prepare(request, ctx)
    if not token_ids:
        raise PromptError(f"the {request.param} must not be empty", param=request.param)
    token_ids, text = _truncate_tokens(request, ctx, token_ids, text)
    max_tokens = _max_tokens(request, ctx, len(token_ids), num_dropped)
    _check_vocabulary(request.params, ctx)
    if request.priority and not ctx.priority_scheduling:  # as vLLM refuses it under fcfs
        raise PromptError(
            f"priority {request.priority}: priority scheduling is not enabled (scheduling_policy=priority)",
            param="priority",
        )
    root = salted_root(request.cache_salt)
    engine_request = EngineRequest(
        token_ids,
        block_hash_chain(token_ids, ctx.block_size, root),
        request.params,
        max_tokens,
        _constraint(request, ctx),
        ctx.reasoning_end_ids if opens_reasoning(text, ctx.parser_spec.reasoning_tags) else (),
        request.lease,
        root,
        request.priority,
    )
    return PreparedPrompt(engine_request, text, num_hits, num_dropped)


def _max_tokens(request: PromptRequest, ctx: PrepareContext, num_prompt_tokens: int, num_dropped: int) -> int:
    """The request's max_tokens, or the rest of the context. One past the context or the KV pool is
    cut to what is left (``clamp_max_tokens``; logged), or refused; a prompt that leaves no room
    for one output token is refused either way."""
    num_room = min(ctx.max_model_len, ctx.max_kv_tokens or ctx.max_model_len) - num_prompt_tokens
    asked = request.params.max_tokens
    if num_room < 1 or (asked is not None and asked > num_room and not ctx.clamp_max_tokens):
        raise _context_length_error(request, ctx, num_prompt_tokens, num_dropped)
    if asked is None:  # the rest of the context, or less where the model says so
        return min(num_room, ctx.default_max_tokens or num_room)
    if asked > num_room:
        log.info(
            "request.max_tokens_clamped",
            max_tokens=asked,
            clamped_to=num_room,
            num_prompt_tokens=num_prompt_tokens,
            max_model_len=ctx.max_model_len,
            max_kv_tokens=ctx.max_kv_tokens,
        )
        return num_room
    return asked


def _check_vocabulary(params: SamplingParams, ctx: PrepareContext) -> None:
    """The sampling's token ids, checked against the vocabulary once (a prompt given as ids: in
    ``_prepare_completion``)."""
    for param, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < ctx.vocab_size for t in ids):
            raise PromptError(f"{param} token ids must be in [0, {ctx.vocab_size})", param=param)


def _constraint(request: PromptRequest, ctx: PrepareContext) -> Constraint | None:
    """The request's grammar, compiled (``Grammars.compile`` bounds the time)."""
    if request.structured is None:
        return None
    assert ctx.grammars is not None, "a structured request needs a context with a grammar compiler"
    try:
        return ctx.grammars.constraint(request.structured)
    except GrammarError as exc:
        raise PromptError(exc.message, param=exc.param) from None


def tokenize_prompt(request: PromptRequest, ctx: PrepareContext) -> list[int]:
    """The ids ``prepare_prompt`` would start from, before any context rule (for /tokenize)."""
    _validate(request)
    prepare = _prepare_chat if request.messages is not None else _prepare_completion
    return prepare(dataclasses.replace(request, truncation="disabled"), ctx)[1]


def _validate(request: PromptRequest) -> None:
    if sum(x is not None for x in (request.messages, request.prompt, request.prompt_token_ids)) != 1:
        raise PromptError("exactly one of messages, prompt and prompt_token_ids is required", param=request.param)
    if (n := request.truncate_prompt_tokens) is not None and n < 1 and n != -1:
        raise PromptError(f"truncate_prompt_tokens must be -1 or at least 1, got {n}", param="truncate_prompt_tokens")
    if request.truncation is not None and request.truncation not in TRUNCATION_MODES:
        raise PromptError(
            f"truncation must be one of {TRUNCATION_MODES}, got {request.truncation!r}", param="truncation"
        )
    if request.continue_final_message and request.add_generation_prompt:
        raise PromptError(
            "continue_final_message and add_generation_prompt cannot both be set", param="continue_final_message"
        )
    if reserved := RESERVED_TEMPLATE_VARIABLES & (request.chat_template_kwargs or {}).keys():
        raise PromptError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")


def _prepare_completion(request: PromptRequest, ctx: PrepareContext) -> tuple[str | None, list[int], int, int]:
    """(text, token ids, cache-hit tokens, 0); a text prompt gets BOS/EOS as ``tokenizer(text)`` adds them."""
    if request.prompt is not None:
        if not request.prompt:
            raise PromptError("the prompt must not be empty", param="prompt")
        tokens = ctx.segment_cache.encode(request.prompt, add_special_tokens=True)
        return request.prompt, tokens.token_ids, tokens.num_hit_tokens, 0
    token_ids = request.prompt_token_ids
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= ctx.vocab_size):
        raise PromptError(f"prompt token ids must be in [0, {ctx.vocab_size})", param="prompt")
    return None, token_ids, 0, 0


def _prepare_chat(request: PromptRequest, ctx: PrepareContext) -> tuple[str, list[int], int, int]:
    """(text, token ids, cache-hit tokens, dropped messages): the rendered, tokenized chat,
    with the oldest messages dropped if it must and may."""
    if not request.messages:
        raise PromptError("messages must not be empty", param="messages")
    render = functools.partial(
        _render_tokenize,
        template=ctx.template_for(request.tools),
        reads_tools=ctx.reads_tools(request.tools),
        request=request,
        template_kwargs={**ctx.template_globals, **(request.chat_template_kwargs or {})},
        segment_cache=ctx.segment_cache,
    )
    text, tokens = render(request.messages)
    cap = ctx.max_model_len - ctx.num_reserved_output_tokens(request)
    num_dropped = 0
    if len(tokens.token_ids) > cap >= 1 and _drops_oldest(request, ctx):
        text, tokens, num_dropped = drop_oldest(render, request.messages, text, tokens, cap)
    return text, tokens.token_ids, tokens.num_hit_tokens, num_dropped


def _render_tokenize(
    messages: Sequence[Mapping[str, Any]],
    *,
    template: jinja2.Template,
    reads_tools: bool,
    request: PromptRequest,
    template_kwargs: Mapping[str, Any],
    segment_cache: SegmentCache,
) -> tuple[str, Tokenized]:
    tools = request.tools
    if not reads_tools:
        messages, tools = default_tools(messages, tools), None
    try:
        text = render_chat(
            template,
            messages,
            tools=tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=template_kwargs,
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise PromptError(f"the chat template cannot render these messages: {exc}", param="messages") from exc
    return text, segment_cache.encode(text)


def _drops_oldest(request: PromptRequest, ctx: PrepareContext) -> bool:
    if request.truncate_prompt_tokens is not None:
        return False  # the request chose its own cut
    return (request.truncation or ctx.context_overflow) in ("auto", "drop_oldest")


def _truncate_tokens(
    request: PromptRequest, ctx: PrepareContext, token_ids: list[int], text: str | None
) -> tuple[list[int], str | None]:
    """``truncate_prompt_tokens``: keep the last N tokens (-1: as many as leave room for the completion)."""
    n = request.truncate_prompt_tokens
    if n is None:
        return token_ids, text
    keep = ctx.max_model_len - ctx.num_reserved_output_tokens(request) if n == -1 else n
    if keep < 1 or len(token_ids) <= keep:
        return token_ids, text
    token_ids = token_ids[-keep:]
    return token_ids, ctx.tokenizer.decode(token_ids) if text is not None else None


def _context_length_error(
    request: PromptRequest, ctx: PrepareContext, num_prompt_tokens: int, num_dropped: int
) -> PromptError:
    """The prompt, or the prompt and the completion asked for, past the context or the KV pool."""
    num_output = request.num_reserved_output_tokens
    num_asked = num_prompt_tokens + num_output
    # the pool is the bound where it is smaller than the context and the request fits the context
    is_pool = ctx.max_kv_tokens is not None and ctx.max_kv_tokens < ctx.max_model_len and num_asked <= ctx.max_model_len
    limit = ctx.max_kv_tokens if is_pool else ctx.max_model_len
    if is_pool:
        message = (
            f"The request needs {num_asked} tokens of KV cache ({num_prompt_tokens} in the {request.param}, "
            f"{num_output} in the completion) but the pool holds {limit}."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_asked} tokens ({num_prompt_tokens} in the {request.param}, {num_output} in the completion)."
        )
    if num_dropped:
        message += (
            f" That is after dropping the {num_dropped} oldest messages that may be dropped "
            "(system messages and the latest turn are kept)."
        )
    message += f" Please reduce the length of the {request.param} or completion."
    if num_prompt_tokens >= limit:  # the prompt alone: Anthropic's words, which Claude Code reads to compact
        anthropic = f"prompt is too long: {num_prompt_tokens} tokens > {limit - 1} maximum"
    else:
        anthropic = (
            f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} + {num_output} > {limit}, "
            "decrease input length or `max_tokens` and try again"
        )
    return PromptError(message, code="context_length_exceeded", param=request.param, anthropic_message=anthropic)
