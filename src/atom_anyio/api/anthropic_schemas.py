"""Anthropic Messages request bodies, validated with pydantic, and their mapping onto the
OpenAI-style message dicts the chat templates expect."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from atom_anyio.api.openai_schemas import Lenient
from atom_anyio.api.structured import forced_tools
from atom_anyio.models.generation_defaults import with_defaults
from atom_anyio.parse import ParserSpec
from atom_anyio.prompt.prepare import PromptRequest
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs

MIN_THINKING_BUDGET = 1024
MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, v: Any) -> Any:
        if isinstance(v, list):
            return "\n".join(_text_of(block, i) for i, block in enumerate(v))
        return v


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # opaque here; not verified


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]

_CONTENT_BLOCKS = TypeAdapter(list[ContentBlock])
USER_BLOCKS = (TextBlock, ToolResultBlock)
ASSISTANT_BLOCKS = (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)


class Message(Lenient):
    role: Literal["user", "assistant"]
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
            where = ".".join(str(p) for p in err["loc"][:1] + err["loc"][2:])  # drop the block-type tag
            raise ValueError(f"block {where}: {err['msg'].removeprefix('Value error, ')}") from None

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> Message:
        allowed = USER_BLOCKS if self.role == "user" else ASSISTANT_BLOCKS
        for i, block in enumerate(self.content if isinstance(self.content, list) else []):
            if not isinstance(block, allowed):
                raise ValueError(f"block {i}: a {self.role} message cannot contain a {block.type} block")
        return self

    def openai(self) -> list[dict[str, Any]]:
        """This turn as template messages: tool results become ``tool`` messages (first, as
        Anthropic requires them first), thinking becomes ``reasoning_content``."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        blocks = self.content
        text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
        if self.role == "user":
            tools = [_tool_message(b) for b in blocks if isinstance(b, ToolResultBlock)]
            return tools + ([{"role": "user", "content": text}] if text or not tools else [])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking := "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock)):
            message["reasoning_content"] = thinking
        if calls := [_tool_call(b) for b in blocks if isinstance(b, ToolUseBlock)]:
            message["tool_calls"] = calls
        return [message]


def _text_of(block: Any, i: int) -> str:
    if _block_type(block, i) != "text" or not isinstance(block.get("text"), str):
        raise ValueError(f"block {i} of a tool result must be a text block with a string 'text'")
    return block["text"]


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
    content = f"Error: {block.content}" if block.is_error else block.content
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _tool_call(block: ToolUseBlock) -> dict[str, Any]:
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}


class Tool(Lenient):
    type: Literal["custom"] | None = None  # server tools (web search, bash, ...) are not run here
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]

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

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < MIN_THINKING_BUDGET):
            raise ValueError(f"budget_tokens must be at least {MIN_THINKING_BUDGET} when thinking is enabled")
        return self


class Metadata(Lenient):
    user_id: str | None = None


class MessagesInput(Lenient):
    """What renders the prompt: the body of count_tokens and the first half of a message request."""

    model: str
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> MessagesInput:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice '{choice.type}' requires tools")
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools or []}:
            raise ValueError(f"tool_choice names '{choice.name}', which is not in tools")
        return self

    @model_validator(mode="after")
    def _prefill_is_text(self) -> MessagesInput:
        last, where = self.messages[-1], f"messages.{len(self.messages) - 1}"
        if last.role != "assistant":
            return self
        if isinstance(last.content, list) and any(not isinstance(b, TextBlock) for b in last.content):
            raise ValueError(f"{where}: a final assistant message (a prefill) may contain only text blocks")
        text = last.openai()[0]["content"]
        if text != text.rstrip():
            raise ValueError(f"{where}: final assistant content cannot end with trailing whitespace")
        return self

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type != "none")

    @property
    def continues_assistant(self) -> bool:
        """A final assistant message is a prefill: the response continues it."""
        return self.messages[-1].role == "assistant"

    def openai_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system or [])
        out = [{"role": "system", "content": system}] if system else []
        for m in self.messages:
            out += m.openai()
        return out

    def prompt_request(
        self, params: SamplingParams | None = None, structured: StructuredOutputs | None = None
    ) -> PromptRequest:
        """The prompt; ``params`` None (counting tokens): the rest of the context."""
        thinking = self.thinking
        return PromptRequest(
            messages=self.openai_messages(),
            tools=[t.openai() for t in self.tools] if self.parses_tools else None,
            chat_template_kwargs=None if thinking is None else {"enable_thinking": thinking.type != "disabled"},
            add_generation_prompt=not self.continues_assistant,
            continue_final_message=self.continues_assistant,
            params=params or SamplingParams(max_tokens=None),
            structured=structured,
        )

    def structured(self, spec: ParserSpec) -> StructuredOutputs | None:
        """``tool_choice`` any or tool: a grammar forces the call."""
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return None
        tools = [t.openai() for t in self.tools or []]
        forced = "required" if choice.type == "any" else choice.name
        return forced_tools(spec, tools, forced, parallel=not choice.disable_parallel_tool_use)


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
