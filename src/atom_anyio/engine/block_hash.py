"""The chained block hash shared by prompt preparation and the prefix cache."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash. Hits are verified
    against the stored tokens, so a collision can never serve wrong KV."""
    return hash((parent, *token_ids))


def block_hash_chain(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of ``token_ids``, each chained on the last."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def salted_root(cache_salt: str | None) -> int:
    """The chain's root for a tenant's ``cache_salt`` (vLLM's): hashed into the first block, it keeps
    one tenant's prefix hits from another's. A stable digest (KV events carry the hashes)."""
    if not cache_salt:
        return ROOT_HASH
    digest = int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")
    return hash_block(ROOT_HASH, (digest,))
