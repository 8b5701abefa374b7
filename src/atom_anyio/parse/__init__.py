"""Output parsing: the reasoning channel and tool calls, streamed."""

from atom_anyio.parse.output import OutputParser, ParsedDelta, ParserSpec, ToolCall, ToolCallDelta

__all__ = ["OutputParser", "ParsedDelta", "ParserSpec", "ToolCall", "ToolCallDelta"]
