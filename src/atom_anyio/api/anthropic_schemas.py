"""Anthropic Messages request bodies, validated with pydantic, and their mapping onto the
OpenAI-style message dicts the chat templates expect."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator

from atom_anyio.api.openai_schemas import Lenient, thinking_enabled
from atom_anyio.api.structured import forced_tools, only_one, response_format
from atom_anyio.engine.request import KVLease
from atom_anyio.generation_defaults import with_defaults
from atom_anyio.parse import ParserSpec
from atom_anyio.prompt.prepare import PromptRequest
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs

MIN_THINKING_BUDGET = 1024
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# Claude Code's first system block: billing metadata whose per-request nonce (cch=), rendered at the
# head of the prompt, would make every turn miss the prefix cache
BILLING_HEADER = "x-anthropic-billing-header:"
CACHE_TTL_S = {"5m": 300, "1h": 3600}


class CacheControl(Lenient):
    """A prompt-caching breakpoint: validated, its ``ttl`` how long the turn's KV is leased
    (``MessagesInput.cache_ttl_s``); the prefix cache itself needs no breakpoints."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def num_seconds(self) -> int:
        return CACHE_TTL_S[self.ttl]


class Block(Lenient):
    cache_control: CacheControl | None = None


class TextBlock(Block):
    type: Literal["text"]
    text: str


def _str_or_list(v: Any) -> str | None:
    return "str" if isinstance(v, str) else "list" if isinstance(v, list) else None


# a string or text blocks; tagged so that an error names the block's field, not each union member
TextOrBlocks = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextBlock], Tag("list")],
    Discriminator(
        _str_or_list, custom_error_type="invalid_type", custom_error_message="must be a string or a list of text blocks"
    ),
]


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: TextOrBlocks = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        for i, block in enumerate(v if isinstance(v, list) else []):
            if _block_type(block, i) != "text":
                raise ValueError(f"block {i} of a tool result must be a text block")
        return v

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str  # empty where the response omitted it (display "omitted")
    signature: str | None = None  # opaque here; not verified


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]

_CONTENT_BLOCKS = TypeAdapter(list[ContentBlock])
USER_BLOCKS = (TextBlock, ToolResultBlock)
ASSISTANT_BLOCKS = (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)
SYSTEM_BLOCKS = (TextBlock,)
THINKING_BLOCKS = (ThinkingBlock, RedactedThinkingBlock)


class Message(Lenient):
    role: Literal["user", "assistant", "system"]  # system: placed by ``MessagesInput.openai_messages``
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v: Any) -> Any:
        """Blocks validated here, so an error names the block rather than every union member."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content blocks")
        for i, block in enumerate(v):
            kind = _block_type(block, i)
            if kind not in BLOCK_TYPES:
                raise ValueError(f"block {i} has an unknown type {kind!r}; expected one of {', '.join(BLOCK_TYPES)}")
        try:
            return _CONTENT_BLOCKS.validate_python(v)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = err["loc"][:1] + err["loc"][2:]  # less the block-type tag and the union members
            where = ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "list"))))
            raise ValueError(f"block {where}: {err['msg'].removeprefix('Value error, ')}") from None

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> Message:
        allowed = {"user": USER_BLOCKS, "assistant": ASSISTANT_BLOCKS, "system": SYSTEM_BLOCKS}[self.role]
        for i, block in enumerate(self.blocks):
            if not isinstance(block, allowed):
                raise ValueError(f"block {i}: a {self.role} message cannot contain a {block.type} block")
        return self

    @property
    def blocks(self) -> list[ContentBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    @property
    def has_thinking(self) -> bool:
        return any(isinstance(b, THINKING_BLOCKS) for b in self.blocks)

    def without_thinking(self) -> Message:
        return self.model_copy(update={"content": [b for b in self.blocks if not isinstance(b, THINKING_BLOCKS)]})

    def openai(self, *, before: str = "", after: str = "") -> list[dict[str, Any]]:
        """This turn as template messages: tool results become ``tool`` messages (first, as
        Anthropic requires them first), thinking becomes ``reasoning_content``. ``before`` and
        ``after``: system text folded into a user turn."""
        assert self.role != "system", "a system message is placed by MessagesInput.openai_messages"
        blocks = self.blocks
        text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
        if self.role == "user":
            text = "\n\n".join(t for t in (before, text, after) if t)
            tools = [_tool_message(b) for b in blocks if isinstance(b, ToolResultBlock)]
            return tools + ([{"role": "user", "content": text}] if text or not tools else [])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking := "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock)):
            message["reasoning_content"] = thinking
        if calls := [_tool_call(b) for b in blocks if isinstance(b, ToolUseBlock)]:
            message["tool_calls"] = calls
        return [message]


def system_text(content: str | list[TextBlock] | list[ContentBlock] | None) -> str:
    """System text blocks joined with newlines, less Claude Code's billing header."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content if isinstance(b, TextBlock) and not b.text.startswith(BILLING_HEADER))


def _block_type(block: Any, i: int) -> Any:
    """The block's type; media blocks are refused by name (the model reads text only)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind is None:
        raise ValueError(f"block {i} must be an object with a 'type'")
    if kind in MEDIA_BLOCKS:
        raise ValueError(f"block {i} has type {kind!r}; this model is text-only and reads only text blocks")
    return kind


def _tool_message(block: ToolResultBlock) -> dict[str, Any]:
    # the templates have no error flag, so an error result says so in its text
    content = f"Error: {block.text}" if block.is_error else block.text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _tool_call(block: ToolUseBlock) -> dict[str, Any]:
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}


class Tool(Lenient):
    """A custom tool, offered to the model; or a server tool (a ``type`` such as
    ``web_search_20250305`` or ``bash_20250124``) that Anthropic runs, accepted and not offered."""

    type: str | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _custom_has_a_schema(self) -> Tool:
        if not self.is_server_tool and self.input_schema is None:
            raise ValueError("input_schema is required for a custom tool (one without a server tool 'type')")
        return self

    @property
    def is_server_tool(self) -> bool:
        return self.type not in (None, "custom")

    def openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required when type is 'tool', and only then")
        return self


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty, signed

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < MIN_THINKING_BUDGET):
            raise ValueError(f"budget_tokens must be at least {MIN_THINKING_BUDGET} when thinking is enabled")
        return self


class OutputConfig(Lenient):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}


class ThinkingTurns(Lenient):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearThinking(Lenient):
    """Drops the thinking of all but the last ``keep.value`` assistant turns that have some."""

    type: Literal["clear_thinking_20251015"]
    keep: ThinkingTurns | None = ThinkingTurns(type="thinking_turns", value=1)  # None: "all"

    @field_validator("keep", mode="before")
    @classmethod
    def _all(cls, v: Any) -> Any:
        if isinstance(v, str) and v != "all":
            raise ValueError('must be "all" or {"type": "thinking_turns", "value": N}')
        return None if v == "all" else v


class ClearToolUses(Lenient):
    """Accepted, not applied (its other fields are ignored): its ``trigger`` and ``clear_at_least``
    count the rendered prompt's tokens, which only preparation knows."""

    type: Literal["clear_tool_uses_20250919"]


class ContextManagement(Lenient):
    edits: list[Annotated[ClearThinking | ClearToolUses, Field(discriminator="type")]] = Field(default_factory=list)

    @property
    def num_thinking_turns(self) -> int | None:
        """How many assistant turns keep their thinking; None: all."""
        return next((e.keep.value for e in self.edits if isinstance(e, ClearThinking) and e.keep), None)


class Metadata(Lenient):
    user_id: str | None = None


class MessagesInput(Lenient):
    """What renders the prompt: the body of count_tokens and the first half of a message request."""

    model: str
    system: TextOrBlocks | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None  # the request-wide breakpoint (automatic caching)
    mcp_servers: list[dict[str, Any]] | None = None  # Anthropic's MCP connector: not run here

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> MessagesInput:
        choice, offered = self.tool_choice, {t.name for t in self.offered_tools}
        if choice is not None and choice.type in ("any", "tool") and not offered:
            raise ValueError(f"tool_choice '{choice.type}' requires tools")
        if choice is not None and choice.type == "tool" and choice.name not in offered:
            raise ValueError(f"tool_choice names '{choice.name}', which is not in tools (or is a server tool)")
        return self

    @model_validator(mode="after")
    def _prefill_is_text(self) -> MessagesInput:
        last, where = self.messages[-1], f"messages.{len(self.messages) - 1}"
        if last.role != "assistant":
            return self
        if any(not isinstance(b, TextBlock) for b in last.blocks):
            raise ValueError(f"{where}: a final assistant message (a prefill) may contain only text blocks")
        text = last.openai()[0]["content"]
        if text != text.rstrip():
            raise ValueError(f"{where}: final assistant content cannot end with trailing whitespace")
        return self

    @property
    def offered_tools(self) -> list[Tool]:
        return [t for t in self.tools or [] if not t.is_server_tool]

    @property
    def parses_tools(self) -> bool:
        return bool(self.offered_tools) and (self.tool_choice is None or self.tool_choice.type != "none")

    @property
    def continues_assistant(self) -> bool:
        """A final assistant message is a prefill: the response continues it."""
        return self.messages[-1].role == "assistant"

    @property
    def shows_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"

    @property
    def cache_ttl_s(self) -> int | None:
        """The longest time to live any ``cache_control`` asks, in seconds; None: none asks."""
        holders = [self, *(self.tools or []), *_listed(self.system), *(b for m in self.messages for b in m.blocks)]
        holders += [t for b in holders if isinstance(b, ToolResultBlock) for t in _listed(b.content)]
        return max((h.cache_control.num_seconds for h in holders if h.cache_control), default=None)

    @property
    def unapplied(self) -> tuple[str, ...]:
        """What is accepted but not done here: server tools, MCP servers, tool-use clearing."""
        edits = self.context_management.edits if self.context_management else []
        return (
            *(f"server tool {t.name} ({t.type})" for t in self.tools or [] if t.is_server_tool),
            *(["mcp_servers"] if self.mcp_servers else []),
            *(f"context_management {e.type}" for e in edits if isinstance(e, ClearToolUses)),
        )

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's thinking switch: ``thinking`` if given, else ``output_config.effort``."""
        effort = self.output_config and self.output_config.effort
        if self.thinking is not None:
            return {"enable_thinking": self.thinking.type != "disabled"}
        return None if effort is None else {"enable_thinking": thinking_enabled(effort)}

    def openai_messages(self) -> list[dict[str, Any]]:
        """The template's messages, ``context_management``'s thinking clearing applied. System
        messages before the first turn join ``system``; a later one is folded into the user turn
        beside it (see ``_placed``)."""
        messages = _cleared_thinking(self.messages, self.context_management)
        num_leading = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        leading = [system_text(self.system), *(system_text(m.content) for m in messages[:num_leading])]
        system = "\n".join(t for t in leading if t)
        out = [{"role": "system", "content": system}] if system else []
        for turn in _placed(messages[num_leading:]):
            out += turn.openai()
        return out

    def prompt_request(
        self,
        params: SamplingParams | None = None,
        structured: StructuredOutputs | None = None,
        lease: KVLease = KVLease(),
    ) -> PromptRequest:
        """The prompt; ``params`` None (counting tokens): the rest of the context."""
        return PromptRequest(
            messages=self.openai_messages(),
            tools=[t.openai() for t in self.offered_tools] if self.parses_tools else None,
            chat_template_kwargs=self.template_kwargs,
            add_generation_prompt=not self.continues_assistant,
            continue_final_message=self.continues_assistant,
            params=params or SamplingParams(max_tokens=None),
            structured=structured,
            lease=lease,
        )

    def structured(self, spec: ParserSpec) -> StructuredOutputs | None:
        """``output_config.format``, or ``tool_choice`` any or tool (a grammar forces the call)."""
        fmt = response_format(self.output_config and self.output_config.format, "output_config.format")
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return fmt
        tools = [t.openai() for t in self.offered_tools]
        forced = "required" if choice.type == "any" else choice.name
        return only_one(fmt, forced_tools(spec, tools, forced, parallel=not choice.disable_parallel_tool_use))


def _listed(content: str | list[TextBlock] | None) -> list[TextBlock]:
    return content if isinstance(content, list) else []


def _cleared_thinking(messages: list[Message], cm: ContextManagement | None) -> list[Message]:
    """``clear_thinking_20251015``: the assistant turns with thinking, all but the last N lose it."""
    keep = cm.num_thinking_turns if cm else None
    if keep is None:
        return messages
    thinking = [i for i, m in enumerate(messages) if m.role == "assistant" and m.has_thinking]
    cleared = set(thinking[: len(thinking) - keep])
    return [m.without_thinking() if i in cleared else m for i, m in enumerate(messages)]


@dataclass
class _Turn:
    message: Message | None  # None: system text with no user turn beside it, as a user turn of its own
    before: str = ""
    after: str = ""

    def openai(self) -> list[dict[str, Any]]:
        if self.message is None:
            return [{"role": "user", "content": self.before}]
        return self.message.openai(before=self.before, after=self.after)


def _placed(messages: list[Message]) -> list[_Turn]:
    """The turns with each later run of system messages folded into the user turn beside it: the
    next one (before its text), else the one before (after its text), else a user turn of its own.
    Templates differ on a system turn mid-conversation (ChatML renders it, others refuse it or
    drop it), so it never becomes one; its text always reaches the model, in its place."""
    turns: list[_Turn] = []
    pending = ""
    for m in [*messages, None]:  # None: the end, where a last run of system messages is placed
        if m is not None and m.role == "system":
            pending = "\n".join(t for t in (pending, system_text(m.content)) if t)
            continue
        if pending and m is not None and m.role == "user":
            turns.append(_Turn(m, before=pending))
            pending = ""
            continue
        if pending:
            previous = turns[-1].message if turns else None
            if previous is not None and previous.role == "user":
                turns[-1].after = pending
            else:
                turns.append(_Turn(None, before=pending))
            pending = ""
        if m is not None:
            turns.append(_Turn(m))
    return turns


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] = Field(default_factory=list)  # at most limits.MAX_STOP_SEQUENCES
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None  # an extension (extra_body), as in the OpenAI formats: the same request, the same tokens
    metadata: Metadata | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking and self.thinking.budget_tokens
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({self.max_tokens})")
        return self

    def sampling_params(self, keep_special_tokens: bool = False, *, defaults: Mapping[str, Any]) -> SamplingParams:
        """``keep_special_tokens``: the tool-call parser reads a special token (Mistral's ``[TOOL_CALLS]``).
        ``defaults``: the model's (``LoadedModel.generation_defaults``), for the fields left out."""
        return SamplingParams(
            **with_defaults(defaults, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
            max_tokens=self.max_tokens,
            seed=self.seed,
            stop=list(self.stop_sequences),
            skip_special_tokens=not keep_special_tokens,
            reasoning_budget=self.thinking.budget_tokens if self.thinking and self.thinking.type == "enabled" else None,
        )
