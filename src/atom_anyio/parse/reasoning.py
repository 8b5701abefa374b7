"""The reasoning channel: ``<think>...</think>``-style text, split off as it streams."""

from __future__ import annotations

THINK_TAGS = ("<think>", "</think>")
REASONING_PARSERS: dict[str, tuple[str, str]] = {"think": THINK_TAGS, "qwen3": THINK_TAGS, "deepseek_r1": THINK_TAGS}


def opens_reasoning(prompt_text: str | None, tags: tuple[str, str] | None) -> bool:
    """Whether the prompt ends inside an open reasoning block (after its last end tag)."""
    if not prompt_text or tags is None:
        return False
    start, end = tags
    return prompt_text.rfind(start) > prompt_text.rfind(end)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``tag`` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """One reasoning block, at the start of the output (or open from the prompt), then content.

    The tags never reach either channel, even split across deltas; whitespace around the
    reasoning and at the start of the content after it is dropped, as the templates add it.
    """

    def __init__(self, tags: tuple[str, str], *, in_reasoning: bool = False):
        self.start_tag, self.end_tag = tags
        self._state = "reasoning" if in_reasoning else "start"  # start -> reasoning -> content, or start -> content
        self._strip = in_reasoning  # drop the whitespace the channel just entered starts with
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) newly known from ``text``; reasoning comes first in the output."""
        self._buf += text
        return self._run(is_final=False)

    def finish(self) -> tuple[str, str]:
        """Release what is held back; an unclosed block ends as reasoning."""
        return self._run(is_final=True)

    def _run(self, *, is_final: bool) -> tuple[str, str]:
        if self._state == "start":
            self._start(is_final)
        reasoning = self._reasoning(is_final) if self._state == "reasoning" else ""
        content = self._content() if self._state == "content" else ""
        return reasoning, content

    def _start(self, is_final: bool) -> None:
        text = self._buf.lstrip()
        if text.startswith(self.start_tag):
            self._buf, self._state, self._strip = text[len(self.start_tag) :], "reasoning", True
        elif is_final or not self.start_tag.startswith(text):
            self._state = "content"

    def _reasoning(self, is_final: bool) -> str:
        buf = self._buf
        end = buf.find(self.end_tag)
        if end >= 0:
            piece = self._emit(buf[:end].rstrip())
            self._buf, self._state, self._strip = buf[end + len(self.end_tag) :], "content", True
            return piece
        if not is_final:
            buf = buf[: len(buf) - partial_tag_len(buf, self.end_tag)]
        body = buf.rstrip()  # trailing whitespace waits: it may precede the end tag
        self._buf = "" if is_final else self._buf[len(body) :]
        return self._emit(body)

    def _content(self) -> str:
        piece, self._buf = self._buf, ""
        return self._emit(piece)

    def _emit(self, piece: str) -> str:
        if self._strip:
            piece = piece.lstrip()
            self._strip = not piece
        return piece
