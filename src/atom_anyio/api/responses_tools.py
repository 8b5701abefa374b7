"""A Responses request's tools: what the model is offered, under which names, and its calls mapped back.

Function tools are offered as they are. A ``namespace`` groups function and custom tools: each is
offered as ``<namespace>__<name>`` (``call_name``: Codex's ``mcp__server__tool`` spelling) and a call
of it comes back as ``{"type": "function_call", "namespace", "name"}``. A ``custom`` (freeform) tool is offered
as a function with one string argument, ``input``, its grammar in the description; its call comes
back as a ``custom_tool_call`` with that ``input``. OpenAI's hosted tools (web search, file search,
code interpreter, ...) and the built-in ones only its models call (``local_shell``, ``shell``,
``apply_patch``, with their own call items) are accepted, not offered, and named in one log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import structlog
from pydantic import Field

from atom_anyio.api.errors import APIError
from atom_anyio.api.openai_schemas import Lenient
from atom_anyio.api.responses_schemas import call_name, validated

log = structlog.get_logger("atom_anyio.api")

HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def echo(self) -> dict[str, Any]:
        return self.model_dump()  # every key, null where not given (the spec requires them)


class CustomTool(Lenient):
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    format: dict[str, Any] | None = None  # {"type": "text"} or {"type": "grammar", "syntax", "definition"}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    @property
    def input_description(self) -> str:
        fmt = self.format or {}
        if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
            return f"The input, in this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
        return "The input, as free text."


class NamespaceTool(Lenient):
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str = ""
    tools: list[dict[str, Any]] = Field(min_length=1)


@dataclass(frozen=True)
class OfferedTool:
    """One tool as the model sees it (``chat``, named ``offered_name``) and as the client named it."""

    name: str
    namespace: str | None
    is_custom: bool
    chat: dict[str, Any]  # the chat-completions shape chat templates render

    @property
    def offered_name(self) -> str:
        return call_name(self.namespace, self.name)


@dataclass(frozen=True)
class ToolSet:
    offered: list[OfferedTool]
    echo: list[dict[str, Any]]  # the Response's ``tools``: what was offered, as the client wrote it

    def chat(self) -> list[dict[str, Any]]:
        return [t.chat for t in self.offered]

    def called(self, name: str) -> OfferedTool | None:
        """The tool a call of ``name`` is for (None: the model called a tool it was not offered)."""
        return next((t for t in self.offered if t.offered_name == name), None)


def parse_tools(raw: list[dict[str, Any]]) -> ToolSet:
    """The request's ``tools``, each validated (a 400 naming the field otherwise)."""
    offered: list[OfferedTool] = []
    echo: list[dict[str, Any]] = []
    hosted: list[str] = []
    for i, tool in enumerate(raw):
        kind = tool.get("type")
        if kind == "namespace":
            ns = validated(NamespaceTool, tool, f"tools.{i}")
            members = [_member(ns, t, f"tools.{i}.tools.{j}") for j, t in enumerate(ns.tools)]
            offered += [offered_tool for offered_tool, _ in members]
            echo.append({**ns.model_dump(exclude={"tools"}), "tools": [e for _, e in members]})
        elif kind in ("function", "custom"):
            offered_tool, echoed = _member(None, tool, f"tools.{i}")
            offered.append(offered_tool)
            echo.append(echoed)
        elif isinstance(kind, str) and kind in HOSTED_TOOLS:
            hosted.append(kind)
        else:
            raise APIError(
                400,
                f"'tools.{i}.type' {kind!r} is not supported; tools may be function, custom or namespace "
                f"(hosted tools, not run here, are accepted and skipped: {', '.join(sorted(HOSTED_TOOLS))})",
                param=f"tools.{i}.type",
                code="unsupported_tool",
            )
    if hosted:
        log.info("responses.hosted_tools_skipped", tool_types=hosted)
    _check_unique(offered)
    return ToolSet(offered, echo)


def _member(namespace: NamespaceTool | None, tool: dict[str, Any], where: str) -> tuple[OfferedTool, dict[str, Any]]:
    prefix = namespace.description if namespace and namespace.description else ""
    ns = namespace.name if namespace else None
    if tool.get("type") == "custom":
        custom = validated(CustomTool, tool, where)
        description = "\n\n".join(d for d in (prefix, custom.description) if d)
        schema = {"type": "string", "description": custom.input_description}
        chat = _chat(call_name(ns, custom.name), description, _one_string("input", schema))
        return OfferedTool(custom.name, ns, True, chat), custom.echo()
    if tool.get("type") != "function":
        raise APIError(
            400,
            f"'{where}.type' {tool.get('type')!r} is not supported in a namespace; use function or custom",
            param=f"{where}.type",
            code="unsupported_tool",
        )
    fn = validated(FunctionTool, tool, where)
    description = "\n\n".join(d for d in (prefix, fn.description) if d)
    chat = _chat(call_name(ns, fn.name), description, fn.parameters)
    return OfferedTool(fn.name, ns, False, chat), fn.echo()


def _chat(name: str, description: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _one_string(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {name: schema}, "required": [name], "additionalProperties": False}


def _check_unique(offered: list[OfferedTool]) -> None:
    seen: set[str] = set()
    for tool in offered:
        if tool.offered_name in seen:
            raise APIError(
                400,
                f"Invalid value for 'tools': two tools are offered to the model as {tool.offered_name!r}",
                param="tools",
                code="invalid_value",
            )
        seen.add(tool.offered_name)


def forced_tool(choice: str | dict[str, Any], tools: ToolSet) -> str | None:
    """What ``tool_choice`` forces: None (auto, none, or no tools), "required" (some call), or the
    offered name of the one tool it names (a 400 naming the field if it names none)."""
    if isinstance(choice, str):
        return "required" if choice == "required" and tools.offered else None
    kind = choice.get("type")
    if kind not in ("function", "custom"):
        raise APIError(
            400,
            f"'tool_choice.type' {kind!r} is not supported; use none, auto, required, a function or a custom tool",
            param="tool_choice.type",
            code="invalid_value",
        )
    name, namespace = choice.get("name"), choice.get("namespace")
    named = isinstance(name, str) and (namespace is None or isinstance(namespace, str))
    tool = tools.called(call_name(namespace, name)) if named else None
    if tool is None or tool.is_custom != (kind == "custom"):
        raise APIError(
            400,
            f"'tool_choice.name' {name!r} is not one of the request's {kind} tools",
            param="tool_choice.name",
            code="invalid_value",
        )
    return tool.offered_name
