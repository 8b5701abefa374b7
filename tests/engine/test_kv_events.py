"""KV-cache events: a real ZMQ subscriber decodes what a serving app publishes,
by vLLM's documented schema (vllm/distributed/kv_events.py), independently of
the server's own structs: multipart (topic, 8-byte big-endian seq, msgpack
``[ts, events]``), each event a map tagged ``"type"``."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from support_servers import free_port, serving_app

from atom_anyio.config import Config
from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.engine.kv_events import KVEventPublisher, KVEventsConfig, block_removed
from atom_anyio.engine.worker import kv_bytes_per_token

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

pytestmark = pytest.mark.anyio

BLOCK = 16
U64 = (1 << 64) - 1
STORED_KEYS = {
    *("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    *("group_idx", "kv_cache_spec_kind"),
}
REMOVED_KEYS = {"type", "block_hashes", "medium", "group_idx"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def events_config(port: int, replay_port: int | None = None, **extra: Any) -> str:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv", **extra}
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return json.dumps(cfg)


def decode(frames: list[bytes]) -> tuple[int, list[dict]]:
    topic, seq, payload = frames
    assert topic == b"kv" and len(seq) == 8
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and isinstance(batch[0], float)  # array_like: [ts, events]
    for event in batch[1]:
        keys = {"BlockStored": STORED_KEYS, "BlockRemoved": REMOVED_KEYS, "AllBlocksCleared": {"type"}}[event["type"]]
        assert set(event) == keys, event
    return int.from_bytes(seq, "big"), batch[1]


class Subscriber:
    def __init__(self, port: int):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.subscribe(b"kv")
        self.received: list[tuple[int, list[dict]]] = []

    def receive(self, timeout_ms: int = 5000) -> tuple[int, list[dict]] | None:
        if not self.sock.poll(timeout_ms):
            return None
        self.received.append(decode(self.sock.recv_multipart()))
        return self.received[-1]

    def drain(self) -> list[dict]:
        events = []
        while (got := self.receive(timeout_ms=200)) is not None:
            events += got[1]
        return events


async def complete(client, prompt: list[int], max_tokens: int = 1) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200
    return await r.get_json()


async def subscribed(client, sub: Subscriber) -> None:
    """PUB drops what it sends before a subscription arrives: send unique one-block probes until one is seen."""
    for i in range(50):
        await complete(client, [7000 + i] * (BLOCK + 1))
        if sub.receive(timeout_ms=200) is not None:
            sub.drain()
            return
    raise AssertionError("no KV event reached the subscriber")


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 40000 + 100 for i in range(n)]


def stored(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored"]


@pytest.fixture(scope="module")
async def served(tiny_model):
    """One app (with a replay socket) and a subscriber for the tests that need no small pool."""
    port, replay_port = free_port(), free_port()
    async with serving_app(tiny_model, kv_events_config=events_config(port, replay_port)) as atom:
        sub = Subscriber(port)
        await subscribed(atom.quart.test_client(), sub)
        yield atom, sub, replay_port
        sub.sock.close(linger=0)


async def test_block_stored_events_are_the_prompts_full_blocks_in_order_with_chained_parents(served):
    atom, sub, _ = served
    client = atom.quart.test_client()
    first = prompt_of(3 * BLOCK + 5, seed=1)
    await complete(client, first)
    events = stored(sub.drain())
    assert [t for e in events for t in e["token_ids"]] == first[: 3 * BLOCK]
    hashes = [h for e in events for h in e["block_hashes"]]
    assert hashes == [h & U64 for h in block_hash_chain(first, BLOCK)]  # the prefix cache's own hashes
    assert events[0]["parent_block_hash"] is None
    for before, after in zip(events, events[1:], strict=False):
        assert after["parent_block_hash"] == before["block_hashes"][-1]
    for e in events:
        assert (e["block_size"], e["medium"], e["lora_id"], e["group_idx"]) == (BLOCK, "GPU", None, 0)
        assert e["kv_cache_spec_kind"] == "full_attention"

    # the next turn resends the history: only its new blocks are stored, chained on the cached ones
    second = first + prompt_of(2 * BLOCK, seed=2)
    await complete(client, second)
    more = stored(sub.drain())
    assert [t for e in more for t in e["token_ids"]] == second[3 * BLOCK : 5 * BLOCK]
    assert more[0]["parent_block_hash"] == hashes[-1]
    assert [h for e in more for h in e["block_hashes"]] == [h & U64 for h in block_hash_chain(second, BLOCK)[3:]]

    # generated tokens that fill a block are stored too
    out = await complete(client, prompt_of(BLOCK - 4, seed=3), max_tokens=8)
    assert out["usage"]["completion_tokens"] == 8
    grown = stored(sub.drain())
    assert len(grown) == 1 and grown[0]["token_ids"][: BLOCK - 4] == prompt_of(BLOCK - 4, seed=3)
    assert grown[0]["parent_block_hash"] is None
    seqs = [seq for seq, _ in sub.received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: nothing lost or reordered


async def test_evicting_a_cached_block_publishes_its_removal(tiny_model):
    per_block = kv_bytes_per_token(tiny_model.model, next(tiny_model.model.parameters()).dtype) * BLOCK
    port = free_port()
    gib = 10 * per_block / 2**30  # a 10-block pool
    async with serving_app(tiny_model, kv_events_config=events_config(port), kv_cache_gib=gib) as atom:
        assert atom.runtime.engine.block_manager.num_blocks == 10
        client = atom.quart.test_client()
        sub = Subscriber(port)
        await subscribed(client, sub)
        first = prompt_of(4 * BLOCK + 1, seed=4)
        await complete(client, first)
        first_hashes = [h for e in stored(sub.drain()) for h in e["block_hashes"]]
        assert len(first_hashes) == 4
        await complete(client, prompt_of(9 * BLOCK + 1, seed=5))  # needs every block: the LRU evicts the rest
        events = sub.drain()
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert set(first_hashes) <= set(removed)
        # a removal is published before the block's reuse is stored: a router never sees both live
        kinds = [e["type"] for e in events]
        assert kinds.index("BlockRemoved") < kinds.index("BlockStored")
        sub.sock.close(linger=0)


async def test_replay_resends_the_buffered_batches_from_a_sequence_number(served):
    atom, sub, replay_port = served
    client = atom.quart.test_client()
    await complete(client, prompt_of(2 * BLOCK + 1, seed=6))
    sub.drain()
    live = dict(sub.received)
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # one request, many replies
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = {}
    while True:
        assert dealer.poll(5000)
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed[int.from_bytes(seq, "big")] = msgspec.msgpack.decode(payload)[1]
    dealer.close(linger=0)
    assert min(replayed) == 0  # from the start: the AllBlocksCleared of the engine's start
    assert replayed[0][0] == {"type": "AllBlocksCleared"}
    for seq, events in live.items():
        assert replayed[seq] == events


def test_kv_events_config_is_vllms_json_and_a_bad_key_or_value_is_named():
    cfg = Config.of(kv_events_config=events_config(5557, buffer_steps=4)).engine.kv_events
    assert cfg == KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557", topic="kv", buffer_steps=4
    )
    assert Config.of(kv_events_config='{"enable_kv_cache_events": false}').engine.kv_events is None
    assert Config.of().engine.kv_events is None
    with pytest.raises(ValueError, match="unknown key 'endpointt'"):
        Config.of(kv_events_config='{"enable_kv_cache_events": true, "endpointt": "tcp://*:1"}')
    with pytest.raises(ValueError, match="hwm must be int"):
        Config.of(kv_events_config='{"enable_kv_cache_events": true, "hwm": "many"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        Config.of(kv_events_config="{enable")
    with pytest.raises(ValueError, match="publisher must be 'zmq' or 'null'"):
        Config.of(kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')


async def test_a_full_queue_drops_a_batch_and_counts_it_instead_of_blocking():
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, max_queue_size=2))
    with anyio.fail_after(1):  # the publisher thread is not running: nothing drains the queue
        for h in range(5):
            publisher.publish([block_removed(h)])
    assert publisher.num_dropped == 3
