"""OpenAI Responses request bodies, and their input items turned into chat messages."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from atom_anyio.api.errors import APIError, from_validation_error
from atom_anyio.api.openai_schemas import Lenient, _parse_arguments, thinking_enabled
from atom_anyio.api.structured import forced_tools, only_one, response_format
from atom_anyio.parse import ParserSpec
from atom_anyio.sampling_params import StructuredOutputs

MAX_METADATA_PAIRS = 16
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file")

M = TypeVar("M", bound=BaseModel)


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]

    def flatten(self, where: str) -> None:
        self.content = text_of(self.content, f"{where}.content")


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str

    def flatten(self, where: str) -> None:
        pass


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]

    def flatten(self, where: str) -> None:
        self.output = text_of(self.output, f"{where}.output")


class ReasoningItem(Lenient):
    """Reasoning passed back: its content text, else its summary text, becomes ``reasoning_content``."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None

    def flatten(self, where: str) -> None:
        field = "content" if self.content else "summary"
        text = text_of(getattr(self, field), f"{where}.{field}")
        self.content, self.summary = [{"type": "reasoning_text", "text": text}], []

    @property
    def text(self) -> str:
        return self.content[0]["text"] if self.content else ""


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        """The chat-completions shape chat templates expect."""
        return {"type": "function", "function": self.model_dump(exclude={"type", "strict"}, exclude_none=True)}


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
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None  # vLLM's extension (extra_body): the same request, the same tokens
    truncation: Literal["disabled", "auto"] = "disabled"
    reasoning: ReasoningConfig | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
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

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(
                    400,
                    f"'tools.{i}.type' {tool.get('type')!r} is not supported; this server runs function tools only",
                    param=f"tools.{i}.type",
                    code="unsupported_tool",
                )
            tools.append(validated(FunctionTool, tool, f"tools.{i}"))
        self._check_tool_choice({t.name for t in tools})
        return tools

    def _check_tool_choice(self, names: set[str]) -> None:
        choice = self.tool_choice
        if isinstance(choice, str):
            return
        if choice.get("type") != "function":
            raise APIError(
                400,
                f"'tool_choice.type' {choice.get('type')!r} is not supported; use none, auto, required or a function",
                param="tool_choice.type",
                code="invalid_value",
            )
        if not isinstance(choice.get("name"), str) or choice["name"] not in names:
            raise APIError(
                400,
                f"'tool_choice.name' {choice.get('name')!r} is not one of the request's function tools",
                param="tool_choice.name",
                code="invalid_value",
            )

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def structured(self, spec: ParserSpec, tools: list[FunctionTool]) -> StructuredOutputs | None:
        """``text.format``, or the call ``tool_choice`` forces; not both."""
        choice = self.tool_choice
        forced = None if not tools or choice in ("none", "auto") else choice if choice == "required" else choice["name"]
        calls = forced_tools(spec, [t.chat() for t in tools], forced, parallel=self.parallel_tool_calls)
        return only_one(response_format(self.text.format, "text.format"), calls)

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None:
        """reasoning.effort onto the template's thinking switch; absent: the template's default."""
        if self.reasoning is None or self.reasoning.effort is None:
            return None
        return {"enable_thinking": thinking_enabled(self.reasoning.effort)}

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return parse_items(self.input, "input")


def parse_items(raw: list[dict[str, Any]], where: str) -> list[InputItem]:
    """Input items, each validated against its type; other item types are refused."""
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(
                400,
                f"'{where}.{i}.type' {kind!r} is not supported; items may be message, function_call, "
                "function_call_output or reasoning",
                param=f"{where}.{i}.type",
                code="unsupported_item",
            )
        parsed = validated(model, item, f"{where}.{i}")
        parsed.flatten(f"{where}.{i}")
        items.append(parsed)
    return items


def validated(model: type[M], value: dict[str, Any], where: str) -> M:
    """``model`` validated from ``value``; a 400 naming the field under ``where`` otherwise."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        inner = from_validation_error(exc)
        param = f"{where}.{inner.param}" if inner.param else where
        reason = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{param}': {reason}", param=param, code="invalid_value") from None


def to_messages(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages for the template (items already flattened by ``parse_items``). One
    assistant turn gathers its reasoning, text and function calls; a call's output becomes
    a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    turn: dict[str, Any] | None = None
    for item in items:
        if isinstance(item, FunctionCallOutputItem):
            name = names.get(item.call_id, "")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": name, "content": item.output})
            turn = None
        elif isinstance(item, MessageItem) and item.role != "assistant":
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.content})
            turn = None
        else:
            turn = _add_to_turn(messages, turn, item)
            if isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
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
        assert isinstance(item, FunctionCallItem)
        turn = turn or _new_turn(messages)
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        turn.setdefault("tool_calls", []).append(_parse_arguments(call))
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
