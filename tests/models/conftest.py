"""Fixtures the tests of tests/models share."""

from __future__ import annotations

import pytest
from support_gguf import QTYPES, Q, tiny_chat_ggufs


@pytest.fixture(scope="module")
def tiny_chat_gguf(tmp_path_factory) -> dict:
    """A seeded tiny Llama with the byte-level ChatML tokenizer, one GGUF per type: those with a
    CPU GEMV and Q5_0, which has none."""
    return tiny_chat_ggufs(tmp_path_factory.mktemp("quant"), [*QTYPES, Q.Q5_0])
