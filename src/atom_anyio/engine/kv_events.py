"""KV-cache events in vLLM's wire format, for KV-aware routers (vllm-router
``--policy kv_aware``, Dynamo, llm-d).

    block manager --(events of one step)--> publish(): put_nowait on a bounded queue
        publisher thread: msgpack-encode, PUB multipart (topic, seq, payload), keep for replay

The wire is vLLM's (vllm/distributed/kv_events.py): an ``EventBatch`` is the
msgpack array ``[ts, events]``; each event a map tagged ``"type"``
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``); ``seq`` is an
8-byte big-endian frame. A replay ROUTER socket answers a request for
``start_seq`` with every buffered ``(seq, payload)`` from it, then
``(-1, b"")``. A step never waits on the publisher: a full queue drops the
batch and counts it (``atom_kv_events_dropped_total``).

Block hashes are the prefix cache's own chained hashes (engine/block_hash.py)
as unsigned 64-bit ints, the same in every replica that serves the same model.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import anyio

from atom_anyio.settings import json_object

try:
    import msgspec
    import zmq
except ImportError:  # the optional extra: checked when events are configured
    msgspec = zmq = None

MEDIUM = "GPU"  # vLLM's name for the primary KV tier (routers credit other media as offloaded tiers)
SPEC_KIND = "full_attention"  # the one KV-cache group (group_idx 0), as vLLM labels it for routers
END_SEQ = (-1).to_bytes(8, "big", signed=True)
U64 = (1 << 64) - 1


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``, key for key."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when enabled
    endpoint: str = "tcp://*:5557"  # bound when it has "*", "::", ipc:// or inproc://, else connected
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def from_json(cls, text: str | None) -> KVEventsConfig | None:
        """The publishing config, or None when events are off. Raises ValueError naming a bad key or value."""
        if not text:
            return None
        try:
            raw = json_object(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config: {exc}") from None
        known = {f.name: f for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"kv_events_config: unknown key {key!r} (known: {', '.join(known)})")
            if not _fits(value, str(known[key].type)):
                raise ValueError(f"kv_events_config: {key} must be {known[key].type}, got {value!r}")
        cfg = cls(**raw)
        publisher = cfg.publisher or ("zmq" if cfg.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {publisher!r}")
        if min(cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) < 1:
            raise ValueError("kv_events_config: buffer_steps, hwm and max_queue_size must be at least 1")
        if not cfg.enable_kv_cache_events or publisher == "null":
            return None
        if zmq is None:
            raise ValueError("kv_events_config needs pyzmq and msgspec: pip install 'atom-anyio[kv-events]'")
        return cfg


def _fits(value: Any, kind: str) -> bool:
    if value is None:
        return "None" in kind
    if kind.startswith("bool"):
        return isinstance(value, bool)
    if kind.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str)


if msgspec is not None:

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_stored(
    hashes: list[int], parent: int | None, token_ids: list[int], block_size: int, medium: str = MEDIUM
) -> BlockStored:
    """Consecutive full blocks of one sequence, ``parent`` the hash before the first (None: the prompt's start).
    Hashes go out as vLLM's integer form carries them: unsigned 64-bit."""
    return BlockStored(
        block_hashes=[h & U64 for h in hashes],
        parent_block_hash=None if parent is None else parent & U64,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind=SPEC_KIND,
    )


def block_removed(h: int, medium: str = MEDIUM) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h & U64], medium=medium, group_idx=0)


def all_blocks_cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


class KVEventPublisher:
    """ZMQ PUB of event batches from a thread; ``publish`` never blocks.
    An async context manager: sockets bound and the thread started on entry, both gone on exit."""

    def __init__(self, cfg: KVEventsConfig):
        self.cfg = cfg
        self.num_dropped = 0
        self._queue: queue.Queue[EventBatch] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def publish(self, events: list) -> None:
        try:
            self._queue.put_nowait(EventBatch(ts=time.time(), events=events))
        except queue.Full:
            self.num_dropped += 1

    async def __aenter__(self) -> KVEventPublisher:
        self._open()
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        with anyio.CancelScope(shield=True):  # the engine's exit is a cancellation: still join
            await anyio.to_thread.run_sync(self._thread.join)

    def _open(self) -> None:
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.cfg.hwm)
        endpoint = self.cfg.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if self.cfg.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.bind(self.cfg.replay_endpoint)

    def _run(self) -> None:
        """The only user of the sockets once started; sends what is queued before it stops."""
        encoder, topic = msgspec.msgpack.Encoder(), self.cfg.topic.encode()
        seq = 0
        try:
            while not (self._stop.is_set() and self._queue.empty()):
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                payload = encoder.encode(batch)
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
