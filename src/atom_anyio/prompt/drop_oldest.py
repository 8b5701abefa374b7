"""Cut a chat that does not fit the context: drop whole oldest messages until it does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from atom_anyio.prompt.segment_cache import Tokenized

# what a prompt past the context gets (the context_overflow setting): an error, or its oldest
# messages dropped (here); defined here, away from the prompt's heavier modules, for the settings
CONTEXT_OVERFLOW_POLICIES = ("error", "drop_oldest")

_SYSTEM_ROLES = frozenset({"system", "developer"})
_ANCHOR_CHARS = 256


def drop_oldest(
    render: Callable[[list], tuple[str, Tokenized]],
    messages: list[dict],
    text: str,
    tokens: Tokenized,
    cap: int,
) -> tuple[str, Tokenized, int]:
    """Drop whole oldest units (see ``_droppable_units``) until the chat fits in ``cap`` tokens.

    Each round estimates every kept message's tokens from the segment spans, drops as many
    units as cover the excess in one go, then re-renders (the kept pieces are cache hits)."""
    units = _droppable_units(messages)
    num_units_dropped = 0
    dropped: set[int] = set()
    while len(tokens.token_ids) > cap and num_units_dropped < len(units):
        kept = [i for i in range(len(messages)) if i not in dropped]
        sizes = dict(zip(kept, _message_token_counts(text, tokens, [messages[i] for i in kept]), strict=True))
        excess = len(tokens.token_ids) - cap
        while excess > 0 and num_units_dropped < len(units):
            excess -= sum(sizes[i] for i in units[num_units_dropped])
            dropped.update(units[num_units_dropped])
            num_units_dropped += 1
        text, tokens = render([m for i, m in enumerate(messages) if i not in dropped])
    return text, tokens, len(dropped)


def _droppable_units(messages: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Indices of the messages that may be dropped, oldest first, in units dropped together:
    a tool result stays with the message that called it. System messages and the latest turn
    (the last unit: the last message, back to its tool call) are never dropped."""
    units: list[list[int]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in _SYSTEM_ROLES:
            continue
        if role == "tool" and units:
            units[-1].append(i)
        else:
            units.append([i])
    return units[:-1]


def _message_token_counts(text: str, tokens: Tokenized, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Estimated tokens of each message in the rendered ``text``: from where its content
    starts to where the next found message's starts. An estimate; the caller re-renders."""
    starts: list[int | None] = []
    at = 0
    for message in messages:
        anchor = _anchor(message)
        found = text.find(anchor, at) if anchor else -1
        starts.append(tokens.token_offset(found) if found >= 0 else None)
        at = found + len(anchor) if found >= 0 else at
    counts = [0] * len(messages)
    end = len(tokens.token_ids)
    for i in reversed(range(len(messages))):
        if starts[i] is not None:
            counts[i], end = end - starts[i], starts[i]
    return counts


def _anchor(message: Mapping[str, Any]) -> str:
    """A piece of the message likely to appear verbatim in the rendered chat."""
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        return content.strip()[:_ANCHOR_CHARS]
    for call in message.get("tool_calls") or ():
        name = (call.get("function") or {}).get("name") if isinstance(call, Mapping) else None
        if isinstance(name, str) and name:
            return name
    return ""
