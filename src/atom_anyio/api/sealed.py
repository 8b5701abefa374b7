"""Opaque, self-contained ``encrypted_content``: what a Responses item carries back to this server.

A sealed value is ``base64url(zlib(json) || HMAC-SHA256(key, kind || zlib(json)))``: the payload is
compressed and authenticated, not hidden (it is the model's own reasoning or summary, which the
client is shown anyway). The key is per server; a value sealed under another key, of another kind,
or altered in any byte does not open.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import zlib
from typing import Any

TAG_BYTES = 32
MAX_OPENED_BYTES = 16 << 20  # a sealed value never inflates past this (zlib bombs)


class SealError(ValueError):
    """A sealed value that does not open: malformed, tampered with, or sealed by another server."""


class Sealer:
    """Seals and opens values of a ``kind`` ("reasoning", "compaction") under one key."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("a sealing key needs at least 16 bytes")
        self._key = key

    @classmethod
    def random(cls) -> Sealer:
        """A key for this process: sealed values do not survive a restart."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def of(cls, secret: str | None) -> Sealer:
        """The key derived from ``secret`` (the ``responses_seal_key`` setting), or a random one."""
        return cls.random() if not secret else cls(hashlib.sha256(b"atom_anyio.sealed\0" + secret.encode()).digest())

    def seal(self, kind: str, value: dict[str, Any]) -> str:
        body = zlib.compress(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
        return base64.urlsafe_b64encode(body + self._tag(kind, body)).decode().rstrip("=")

    def open(self, kind: str, sealed: str) -> dict[str, Any]:
        """The value ``seal(kind, value)`` sealed; ``SealError`` for anything else."""
        try:
            raw = base64.urlsafe_b64decode(sealed + "=" * (-len(sealed) % 4))
        except (binascii.Error, ValueError):
            raise SealError("it is not valid base64url") from None
        body, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
        if len(raw) <= TAG_BYTES or not hmac.compare_digest(tag, self._tag(kind, body)):
            raise SealError(f"it is not {kind} content sealed by this server (tampered, or from before a restart)")
        inflater = zlib.decompressobj()
        value = json.loads(inflater.decompress(body, MAX_OPENED_BYTES))
        assert isinstance(value, dict) and not inflater.unconsumed_tail, "this server sealed a JSON object"
        return value

    def _tag(self, kind: str, body: bytes) -> bytes:
        return hmac.new(self._key, kind.encode() + b"\0" + body, hashlib.sha256).digest()
