"""Stored responses for ``GET /v1/responses/{id}`` and ``previous_response_id``."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atom_anyio.api.responses_schemas import InputItem


@dataclass(frozen=True)
class StoredResponse:
    input_items: list[InputItem]  # the whole conversation before the output: previous turns + this input
    response: dict[str, Any]  # the Response object as returned; never mutated once stored


class ResponseStore:
    """Bounded by entry count (least recently used out first) and by idle time.

    An entry expires ``ttl_s`` after it was last stored or read, so access order is
    also expiry order and both bounds are kept from the front of one ordered dict::

        oldest access / soonest expiry  [a][b][c]...[z]  newest access
        ^ popped when over max_items or expired         ^ put / get move here

    Every operation is O(1) (amortized for the expiry sweep)."""

    def __init__(self, max_items: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if max_items < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_items >= 1 and ttl_s > 0")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._expire()
        self._entries[response_id] = (self.clock() + self.ttl_s, entry)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_items:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        hit = self._entries.get(response_id)
        if hit is None:
            return None
        self._entries[response_id] = (self.clock() + self.ttl_s, hit[1])
        self._entries.move_to_end(response_id)
        return hit[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            expires_at, _ = next(iter(self._entries.values()))
            if expires_at > now:
                return
            self._entries.popitem(last=False)
