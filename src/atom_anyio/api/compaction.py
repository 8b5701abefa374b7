"""Compaction: the model summarises the conversation so far, and the summary travels sealed.

Asked two ways, as Codex asks: a ``compaction_trigger`` as the last input item of a normal
``POST /v1/responses`` (answered with exactly one ``compaction`` output item), or
``POST /v1/responses/compact`` (answered with a ``response.compaction`` object: the user messages,
then that item). Either way one generation runs through the usual prepare path: the conversation,
then ``SUMMARY_INSTRUCTION`` as the last user message, the oldest turns dropped until it fits, at
most ``MAX_SUMMARY_TOKENS`` generated. A later request carrying the item gets the summary in place
of everything before it (``responses_schemas.compacted``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from atom_anyio.api.http import new_id
from atom_anyio.api.responses_encoder import Event, ResponseEncoder
from atom_anyio.api.responses_schemas import InputItem, MessageItem, compacted
from atom_anyio.parse import ParsedDelta

MAX_SUMMARY_TOKENS = 512
SUMMARY_INSTRUCTION = (
    "Pause the conversation here. Write a summary of it that lets you continue the work later "
    "from the summary alone: the user's goals and requests, the decisions made and why, the facts, "
    "names and values established, what has been done (files, commands, results) and what is left "
    "to do. Be concise and specific. Write only the summary."
)


def summary_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary request: the conversation's chat messages, then the instruction."""
    return [*messages, {"role": "user", "content": SUMMARY_INSTRUCTION}]


class CompactionEncoder(ResponseEncoder):
    """The summary generation as a Response whose output is exactly one ``compaction`` item; its
    text is never streamed (the summary goes only into the item's ``encrypted_content``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.summary = ""
        self.reasoning = ""  # the summary, where a thinking model wrote nothing outside its reasoning

    def _parsed(self, pd: ParsedDelta) -> Iterator[Event]:
        self.summary += pd.content
        self.reasoning += pd.reasoning
        yield from ()

    def _end_output(self) -> Iterator[Event]:
        self.status = "completed"  # a summary cut at its token budget is still the summary
        summary = (self.summary.strip() or self.reasoning).strip()
        item = {
            "id": new_id("cmp_"),
            "type": "compaction",
            "encrypted_content": self.turn.sealer.seal("compaction", {"text": summary}),
        }
        self.output_index[item["id"]] = 0
        self.output.append(item)
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event("response.output_item.done", output_index=0, item=item)


def compact_resource(response: dict[str, Any], conversation: list[InputItem]) -> dict[str, Any]:
    """``POST /v1/responses/compact``'s answer: the compacted window's user messages, then the item."""
    users = [item for item in compacted(conversation) if isinstance(item, MessageItem) and item.role == "user"]
    kept = [
        {
            "id": new_id("msg_"),
            "type": "message",
            "status": "completed",
            "role": "user",
            "content": [{"type": "input_text", "text": item.content}],
        }
        for item in users
    ]
    return {
        "id": response["id"],
        "object": "response.compaction",
        "created_at": response["created_at"],
        "output": kept + response["output"],
        "usage": response["usage"],
    }
