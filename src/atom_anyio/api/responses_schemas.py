"""OpenAI Responses request bodies, and their input items turned into chat messages."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from atom_anyio.api.errors import APIError, from_validation_error
from atom_anyio.api.openai_schemas import Lenient, parse_arguments, thinking_enabled
from atom_anyio.api.sealed import Sealer, SealError

MAX_METADATA_PAIRS = 16
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")
NAMESPACE_SEPARATOR = "__"  # a namespaced tool is offered to the model as <namespace>__<name>
SUMMARY_PREFIX = "Summary of the conversation so far (earlier turns were compacted into it):\n\n"

M = TypeVar("M", bound=BaseModel)


def call_name(namespace: str | None, name: str) -> str:
    """The name the model calls a tool by."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]

    def flatten(self, where: str, sealer: Sealer) -> None:
        self.content = text_of(self.content, f"{where}.content")


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None
    arguments: str

    def flatten(self, where: str, sealer: Sealer) -> None:
        pass

    def chat_call(self) -> dict[str, Any]:
        function = {"name": call_name(self.namespace, self.name), "arguments": self.arguments}
        return parse_arguments({"id": self.call_id, "type": "function", "function": function})


class CustomToolCallItem(Lenient):
    """A freeform tool's call: the model wrote it as a function call with one ``input`` argument."""

    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None
    input: str

    def flatten(self, where: str, sealer: Sealer) -> None:
        pass

    def chat_call(self) -> dict[str, Any]:
        function = {"name": call_name(self.namespace, self.name), "arguments": {"input": self.input}}
        return {"id": self.call_id, "type": "function", "function": function}


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]

    def flatten(self, where: str, sealer: Sealer) -> None:
        self.output = text_of(self.output, f"{where}.output")


class ReasoningItem(Lenient):
    """Reasoning passed back: its sealed ``encrypted_content``, else its content text, else its
    summary text, becomes ``reasoning_content``."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None

    def flatten(self, where: str, sealer: Sealer) -> None:
        if self.encrypted_content is not None:
            text = opened(sealer, "reasoning", self.encrypted_content, f"{where}.encrypted_content")
        else:
            field = "content" if self.content else "summary"
            text = text_of(getattr(self, field), f"{where}.{field}")
        self.content, self.summary = [{"type": "reasoning_text", "text": text}], []

    @property
    def text(self) -> str:
        return self.content[0]["text"] if self.content else ""


class CompactionItem(Lenient):
    """A compacted conversation: the summary sealed in it stands for every item before it."""

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1)
    _summary: str = PrivateAttr("")

    def flatten(self, where: str, sealer: Sealer) -> None:
        self._summary = opened(sealer, "compaction", self.encrypted_content, f"{where}.encrypted_content")

    @property
    def summary(self) -> str:
        return self._summary


InputItem = (
    MessageItem | FunctionCallItem | CustomToolCallItem | FunctionCallOutputItem | ReasoningItem | CompactionItem
)
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "custom_tool_call": CustomToolCallItem,
    "function_call_output": FunctionCallOutputItem,
    "custom_tool_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "compaction": CompactionItem,
}
COMPACTION_TRIGGER = "compaction_trigger"  # the request's last input item: answer with one compaction item


class ReasoningConfig(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(Lenient):
    type: Literal["text", "json_schema", "json_object"] = "text"


class TextConfig(Lenient):
    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("format")
    @classmethod
    def _format(cls, v: dict[str, Any]) -> dict[str, Any]:
        TextFormat.model_validate(v)
        if v.get("type") == "json_schema" and not isinstance(v.get("schema"), dict):
            raise ValueError("a json_schema format needs a 'schema' object")
        return v


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)  # echoed: it bounds hosted tools' calls, which do not run here
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    top_logprobs: int = Field(0, ge=0, le=20)  # echoed; output text carries no logprobs
    seed: int | None = None  # vLLM's extension (extra_body): the same request, the same tokens
    truncation: Literal["disabled", "auto"] = "disabled"
    reasoning: ReasoningConfig | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] = Field(default_factory=list)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=64)  # echoed; the conversation whose KV lease it renews
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: a tenant's prefix hits kept from another's
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower first, under scheduling_policy=priority
    service_tier: Literal["auto", "default", "flex", "priority"] = "auto"
    stream: bool = False
    generate: bool = True  # false (WebSocket warm-up): the prompt is prefilled, nothing is generated
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    conversation: Any = None

    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list) -> str | list:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and len(v) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed")
        for k, val in (v or {}).items():
            if len(k) > 64 or len(val) > 512:
                raise ValueError("keys are at most 64 characters and values at most 512")
        return v

    @field_validator("background")
    @classmethod
    def _background(cls, v: bool) -> bool:
        if v:
            raise ValueError("background responses are not supported; use stream or a plain request")
        return v

    @field_validator("conversation")
    @classmethod
    def _conversation(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("conversations are not supported; chain responses with previous_response_id")
        return v

    @property
    def is_compaction(self) -> bool:
        """The input ends with a ``compaction_trigger``: the response is one compaction item."""
        return isinstance(self.input, list) and self.input[-1].get("type") == COMPACTION_TRIGGER

    @property
    def seals_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in self.include

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None:
        """reasoning.effort onto the template's thinking switch; absent: the template's default."""
        if self.reasoning is None or self.reasoning.effort is None:
            return None
        return {"enable_thinking": thinking_enabled(self.reasoning.effort)}

    def input_items(self, sealer: Sealer) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        raw = self.input[:-1] if self.is_compaction else self.input
        return parse_items(raw, "input", sealer)


class CompactRequest(Lenient):
    """``POST /v1/responses/compact``: the conversation to compact (run as a Responses request
    whose input ends with a ``compaction_trigger``)."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=64)


def parse_items(raw: list[dict[str, Any]], where: str, sealer: Sealer) -> list[InputItem]:
    """Input items, each validated against its type (sealed content opened); other types are refused."""
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            reason = "must be the last input item" if kind == COMPACTION_TRIGGER else "is not supported"
            raise APIError(
                400,
                f"'{where}.{i}.type' {kind!r} {reason}; items may be {', '.join(ITEM_TYPES)} "
                f"(and a last {COMPACTION_TRIGGER})",
                param=f"{where}.{i}.type",
                code="unsupported_item",
            )
        parsed = validated(model, item, f"{where}.{i}")
        parsed.flatten(f"{where}.{i}", sealer)
        items.append(parsed)
    return items


def check_call_outputs(history: list[InputItem], items: list[InputItem]) -> None:
    """Each tool output in ``items`` (the request's input) answers a call made before it."""
    call_ids = {item.call_id for item in history if isinstance(item, FunctionCallItem | CustomToolCallItem)}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem | CustomToolCallItem):
            call_ids.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in call_ids:
            raise APIError(
                400,
                f"No tool call found for the {item.type} with call_id {item.call_id!r} ('input.{i}.call_id')",
                param=f"input.{i}.call_id",
                code="invalid_value",
            )


def validated(model: type[M], value: dict[str, Any], where: str) -> M:
    """``model`` validated from ``value``; a 400 naming the field under ``where`` otherwise."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        inner = from_validation_error(exc)
        param = f"{where}.{inner.param}" if inner.param else where
        reason = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{param}': {reason}", param=param, code="invalid_value") from None


def opened(sealer: Sealer, kind: str, sealed: str, param: str) -> str:
    """The text a sealed item carries; a 400 naming ``param`` if it does not open."""
    try:
        text = sealer.open(kind, sealed).get("text")
    except SealError as exc:
        raise APIError(
            400, f"Invalid value for '{param}': {exc}", param=param, code="invalid_encrypted_content"
        ) from None
    assert isinstance(text, str), "this server seals {'text': str}"
    return text


def compacted(items: list[InputItem]) -> list[InputItem]:
    """The conversation from its latest compaction item on: the summary stands for the items before
    it, except system and developer messages (instructions, not conversation), which stay."""
    last = max((i for i, item in enumerate(items) if isinstance(item, CompactionItem)), default=None)
    if last is None:
        return items
    kept = [item for item in items[:last] if isinstance(item, MessageItem) and item.role in ("system", "developer")]
    return kept + items[last:]


def to_messages(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages for the template (items already flattened by ``parse_items``), from the latest
    compaction on. One assistant turn gathers its reasoning, text and tool calls; a call's output
    becomes a tool message; a compaction's summary a user message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    calls = [item for item in items if isinstance(item, FunctionCallItem | CustomToolCallItem)]
    names = {call.call_id: call_name(call.namespace, call.name) for call in calls}
    turn: dict[str, Any] | None = None
    for item in compacted(items):
        if isinstance(item, FunctionCallOutputItem):
            name = names.get(item.call_id, "")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": name, "content": item.output})
            turn = None
        elif isinstance(item, CompactionItem):
            messages.append({"role": "user", "content": SUMMARY_PREFIX + item.summary})
            turn = None
        elif isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.content})
            turn = None
        else:
            turn = _add_to_turn(messages, turn, item)
    return messages


def _add_to_turn(messages: list[dict[str, Any]], turn: dict[str, Any] | None, item: InputItem) -> dict[str, Any]:
    """Fold an assistant-side item into the open assistant turn, or start a new one when
    the item cannot belong to it (a second reasoning or text, or anything after a call)."""
    if isinstance(item, ReasoningItem):
        if turn is None or "reasoning_content" in turn or turn["content"] or "tool_calls" in turn:
            turn = _new_turn(messages)
        turn["reasoning_content"] = item.text
    elif isinstance(item, MessageItem):
        if turn is None or turn["content"] or "tool_calls" in turn:
            turn = _new_turn(messages)
        turn["content"] = item.content
    else:
        assert isinstance(item, FunctionCallItem | CustomToolCallItem)
        turn = turn or _new_turn(messages)
        turn.setdefault("tool_calls", []).append(item.chat_call())
    return turn


def _new_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def text_of(content: str | list[dict[str, Any]], where: str) -> str:
    """A content string, or its text parts joined; image, file and audio parts are refused."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in UNSUPPORTED_PARTS:
            raise APIError(
                400,
                f"'{where}.{j}' is an {kind} part; this model is text-only and accepts only text parts",
                param=f"{where}.{j}.type",
                code="unsupported_content",
            )
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if kind not in (*TEXT_PARTS, "refusal"):
            raise APIError(
                400, f"'{where}.{j}.type' {kind!r} is not a known content part type", param=f"{where}.{j}.type"
            )
        if not isinstance(text, str):
            raise APIError(400, f"'{where}.{j}.text' must be a string", param=f"{where}.{j}.text", code="invalid_value")
        texts.append(text)
    return "\n".join(texts)
