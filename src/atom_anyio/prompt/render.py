"""Render chat templates as transformers' ``apply_chat_template(..., tokenize=False)`` does.

Same Jinja environment (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``, ``{% generation %}``), same message normalization, but each
template is compiled once and rendered directly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
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


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template for ``source``; compiled once per distinct string."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
