"""One request's output, split into reasoning, visible content and tool calls as it streams.

``OutputParser`` runs the reasoning parser first (``<think>...</think>``, seeded from the prompt
text the engine runs), then the tool-call parser on the visible content; GPT-OSS's harmony
output has one parser for all three (``parse.harmony``). Feeding the output in any split gives
the same joined result as feeding it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from atom_anyio.parse.harmony import HarmonyParser
from atom_anyio.parse.reasoning import REASONING_PARSERS, ReasoningParser
from atom_anyio.parse.tool_calls import (
    DEFAULT_TOOL_FORMAT,
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    detect_tool_format,
)

HARMONY = "harmony"  # GPT-OSS: reasoning, content and calls in one format (vLLM: openai_gptoss / openai)
HARMONY_NAMES = {"reasoning_parser": (HARMONY, "openai_gptoss"), "tool_call_parser": (HARMONY, "openai")}

__all__ = ["OutputParser", "ParsedDelta", "ParserSpec", "ToolCall", "ToolCallDelta"]


@dataclass
class ParsedDelta:
    """Newly classified output; at most one entry per call index. From ``feed``, reasoning comes
    before content and content before the calls in the text (text after a call waits for the
    next feed); ``finish`` returns whatever is left."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(
            self.reasoning + other.reasoning,
            self.content + other.content,
            merge_deltas(self.tool_calls + other.tool_calls),
        )


@dataclass(frozen=True)
class ParserSpec:
    """Which parsers a server runs; built once at startup from the chat template and the flags."""

    reasoning_tags: tuple[str, str] | None = None  # e.g. ("<think>", "</think>")
    tool_format: str | None = None  # one of TOOL_CALL_PARSERS, or HARMONY
    is_harmony: bool = False  # harmony messages: no reasoning tags; tool_format HARMONY or None (no calls)

    def __post_init__(self) -> None:
        formats = [HARMONY] if self.is_harmony else sorted(TOOL_CALL_PARSERS)
        if self.tool_format is not None and self.tool_format not in formats:
            raise ValueError(f"tool_format must be one of {formats}, got {self.tool_format!r}")
        if self.is_harmony and self.reasoning_tags is not None:
            raise ValueError("harmony output has no reasoning tags")

    @classmethod
    def detect(
        cls,
        chat_template: str | Mapping[str, str] | None,
        *,
        reasoning_parser: str = "auto",
        tool_call_parser: str = "auto",
        renders_default_tools: bool = False,
    ) -> ParserSpec:
        """``"auto"``: detect from the template text; ``"none"``: off; a name forces that parser.
        An unknown name is a ValueError listing the choices. ``renders_default_tools``: the template
        reads no ``tools``, so the prompt layer renders them in ``DEFAULT_TOOL_FORMAT``
        (``prompt.render.default_tools``), which ``auto`` then parses."""
        if isinstance(chat_template, Mapping):
            chat_template = "\n".join(chat_template.values())
        template = chat_template or ""
        is_harmony = "<|channel|>" in template
        detected_tools = detect_tool_format(template)
        if detected_tools is None and renders_default_tools:
            detected_tools = DEFAULT_TOOL_FORMAT
        reasoning = _choose(
            "reasoning_parser",
            reasoning_parser,
            REASONING_PARSERS,
            HARMONY if is_harmony else _detect_reasoning(template),
        )
        tools = _choose(
            "tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS, HARMONY if is_harmony else detected_tools
        )
        if HARMONY not in (reasoning, tools):
            return cls(reasoning_tags=REASONING_PARSERS[reasoning] if reasoning else None, tool_format=tools)
        if tools not in (None, HARMONY) and tool_call_parser != "auto":
            raise ValueError(f"tool_call_parser {tool_call_parser!r} cannot read harmony output; use harmony or none")
        return cls(tool_format=None if tools is None else HARMONY, is_harmony=True)

    @property
    def keeps_special_tokens(self) -> bool:
        """Mistral's ``[TOOL_CALLS]`` is a special token: tool parsing needs it in the output text."""
        return self.tool_format == "mistral"

    def decodes_special_tokens(self, *, parse_tools: bool) -> bool:
        """Whether a request's output text must keep special tokens: harmony's tags always, the
        tool-call format's (``keeps_special_tokens``) while tools are parsed."""
        return self.is_harmony or (parse_tools and self.keeps_special_tokens)


def _choose(flag: str, value: str, choices: Mapping[str, object], detected: str | None) -> str | None:
    if value == "auto":
        return detected
    if value == "none":
        return None
    if value in HARMONY_NAMES[flag]:
        return HARMONY
    if value not in choices:
        raise ValueError(f"{flag} must be one of {['auto', 'none', *choices, *HARMONY_NAMES[flag]]}, got {value!r}")
    return value


def _detect_reasoning(template: str) -> str | None:
    return "think" if "<think>" in template or "</think>" in template else None


class OutputParser:
    """One choice's output parser. ``in_reasoning``: the prompt ends inside an open reasoning block
    (``opens_reasoning``, found once per prompt), so the output starts in the reasoning channel;
    ``parse_tools`` False leaves tool syntax as content."""

    def __init__(self, spec: ParserSpec, in_reasoning: bool, *, parse_tools: bool):
        tags = spec.reasoning_tags
        self._reasoning = ReasoningParser(tags, in_reasoning=in_reasoning) if tags else None
        is_parsing_tools = parse_tools and spec.tool_format is not None
        self._harmony = HarmonyParser(parse_tools=is_parsing_tools) if spec.is_harmony else None
        self._tools = ToolParser.for_format(spec.tool_format) if is_parsing_tools and not spec.is_harmony else None

    def feed(self, text: str) -> ParsedDelta:
        """One engine text delta in; the newly classified text out."""
        return joined_deltas(self.feed_pieces(text))

    def finish(self, *, is_cut: bool = False) -> ParsedDelta:
        """End of output: release held-back text; an unfinished or malformed call comes back as
        content, unless ``is_cut`` (the output ran out of tokens): then the call it was in is a
        call cut short (``ToolCall.is_cut``), its markup never content."""
        return joined_deltas(self.finish_pieces(is_cut=is_cut))

    def feed_pieces(self, text: str) -> list[ParsedDelta]:
        """``feed`` in the text's order, for outputs that build blocks or items in turn (Anthropic's,
        the Responses API's): pieces each with its reasoning, then content, then calls. A call that
        proves malformed comes back as text after the deltas that announced it, and a piece puts
        content before calls, so that text is the next piece's."""
        if self._harmony is not None:
            reasoning, content, calls = self._harmony.feed(text)
            return [ParsedDelta(reasoning, content, merge_deltas(calls))]
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        if self._tools is None:
            return [ParsedDelta(reasoning, content)]
        return self._with_calls(reasoning, self._tools.feed_pieces(content))

    def finish_pieces(self, *, is_cut: bool = False) -> list[ParsedDelta]:
        """``finish`` in the text's order (``feed_pieces``)."""
        if self._harmony is not None:
            reasoning, content, calls = self._harmony.finish()
            return [ParsedDelta(reasoning, content, merge_deltas(calls))]
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        if self._tools is None:
            return [ParsedDelta(reasoning, content)]
        pieces = self._tools.feed_pieces(content) + self._tools.finish_pieces(is_cut=is_cut)
        return self._with_calls(reasoning, pieces)

    @staticmethod
    def _with_calls(reasoning: str, pieces: list[tuple[str, list[ToolCallDelta]]]) -> list[ParsedDelta]:
        out = [ParsedDelta(reasoning)] if reasoning else []
        out += [ParsedDelta("", content, merge_deltas(calls)) for content, calls in pieces]
        return out or [ParsedDelta()]

    def parse_all(self, text: str, *, is_cut: bool = False) -> ParsedDelta:
        """A whole output at once (non-streaming responses): ``feed(text) + finish(is_cut=is_cut)``."""
        return self.feed(text) + self.finish(is_cut=is_cut)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The well-formed calls so far; after ``finish(is_cut=True)``, the cut call last."""
        calls = self._harmony or self._tools
        return list(calls.calls) if calls else []


def joined_deltas(pieces: list[ParsedDelta]) -> ParsedDelta:
    """Ordered pieces as one delta: its reasoning, its content and its calls, each joined."""
    return sum(pieces, ParsedDelta())


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call joined into one."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1]
            out[-1] = ToolCallDelta(last.index, last.id or d.id, last.name or d.name, last.arguments + d.arguments)
        else:
            out.append(d)
    return out
