"""Render chat templates as transformers' ``apply_chat_template(..., tokenize=False)`` does.

Same Jinja environment (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``, ``{% generation %}``), same message normalization, but each
template is compiled once and rendered directly.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Template variables the renderer owns; template kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# Names a message's reasoning arrives under; templates read ``reasoning_content`` (gpt-oss reads ``thinking``).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markup for training) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template for ``source``; compiled once per distinct string."""
    return _environment().from_string(source)


@functools.lru_cache(maxsize=16)
def reads_tools(source: str) -> bool:
    """Whether the template reads the ``tools`` variable. One that does not (SmolLM2's, for
    example) gets tools, tool calls and tool results in the default format (``default_tools``)."""
    return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(source))


def render_chat(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The rendered conversation. Raises ``jinja2.TemplateError`` (the template rejected the
    input), ``ValueError`` or ``TypeError`` for input the template cannot render."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    messages = normalize_messages(messages)
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with text content")
        messages[-1]["content"] += _CONTINUE_TAG
    text = template.render(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    if continue_final_message:
        # the template may strip the tag's trailing space; then strip what the message ended with
        tag_at = text.rfind(_CONTINUE_TAG.strip())
        if tag_at < 0:
            raise ValueError("the chat template drops the final message, so it cannot be continued")
        text = text[:tag_at] if text.startswith(_CONTINUE_TAG, tag_at) else text[:tag_at].rstrip()
    return text


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: keys whose value is None dropped (``content: null``
    renders as "None" in many templates), reasoning under every name templates read."""
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"each message must be an object, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


_TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. "
    "The functions are listed as JSON schemas within <tools></tools> tags:\n<tools>\n"
)
_TOOLS_CALL_FORMAT = (
    "\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> tags, "
    "one block per call:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
)


def default_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
    """``messages`` as a template that reads no tools can render them, in the default Hermes
    format: ``tools`` listed in a system block (after the first system or developer message's
    text, else as a new first system message), assistant ``tool_calls`` as ``<tool_call>`` text
    and ``tool`` results as ``<tool_response>`` text in a user turn."""
    out: list[dict] = []
    is_after_tool = False
    for message in messages:
        is_tool = message.get("role") == "tool"
        if is_tool:
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if is_after_tool:  # consecutive results share one user turn
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append(_calls_as_text(message))
        is_after_tool = is_tool
    if tools:
        listing = _TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_CALL_FORMAT
        if out and out[0].get("role") in ("system", "developer"):
            system = _text(out[0].get("content")).rstrip()
            out[0] = {**out[0], "content": f"{system}\n\n{listing}" if system else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _calls_as_text(message: Mapping[str, Any]) -> dict:
    message = dict(message)
    calls = [tool_call_text(call) for call in message.pop("tool_calls", None) or ()]
    if calls:
        text = _text(message.get("content")).rstrip()
        message["content"] = "\n".join([text, *calls] if text else calls)
    return message


def tool_call_text(call: Mapping[str, Any]) -> str:
    """One chat-shaped tool call as the default format writes it (what a forced call's grammar emits)."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else rendered as the string the client sent
            arguments = json.loads(arguments)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _text(content: Any) -> str:
    return "" if content is None else content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
