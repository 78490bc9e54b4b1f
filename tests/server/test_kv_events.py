"""KV events over ZMQ: a plain subscriber rebuilds the tree's page set from what it receives,
a node split removes nothing, missed batches are replayed, and a live server publishes."""

from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import pytest
from conftest import LiveServer

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.engine import Engine

zmq = pytest.importorskip("zmq", reason="KV events need the events extra (pyzmq)")
msgspec = pytest.importorskip("msgspec", reason="KV events need the events extra (msgspec)")

from radixserve.server.kv_events import END_OF_REPLAY, KVEventPublisher  # noqa: E402


def _endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _subscriber(endpoint: str):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher
    return sub


def _receive(sub, timeout_ms: int = 2000) -> list[tuple[int, list]]:
    """(sequence, events) of every batch with events that arrives until only heartbeats
    (empty batches, at most one a second) or nothing come for a while."""
    out = []
    deadline = time.monotonic() + timeout_ms / 1000
    while sub.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        ts, events = msgspec.msgpack.decode(payload)[:2]  # a plain decode: the wire layout
        assert isinstance(ts, float)
        if events:
            out.append((int.from_bytes(seq, "big"), events))
            deadline = time.monotonic() + 0.3
    return out


def _apply(pages: set[bytes], events: list) -> None:
    for event in events:
        kind = event[0]
        if kind == "BlockStored":
            hashes, parent, tokens, block_size, _lora, medium = event[1:7]
            assert len(tokens) == block_size * len(hashes) and medium == "CPU"
            assert parent is None or parent in pages  # a chain continues a stored page
            pages.update(hashes)
        elif kind == "BlockRemoved":
            assert set(event[1]) <= pages
            pages.difference_update(event[1])
        else:
            assert kind == "AllBlocksCleared"
            pages.clear()


def _tree_pages(cache: RadixCache) -> set[bytes]:
    return {h for node in cache._nodes() for h in cache.page_hashes(node)}


def test_a_subscriber_rebuilds_the_trees_pages_from_the_events():
    endpoint = _endpoint()
    publisher = KVEventPublisher(endpoint)
    sub = _subscriber(endpoint)
    try:
        rng = np.random.default_rng(0)
        cache = RadixCache(TokenToKVPoolAllocator(600), page_size=2, enable_kv_events=True)
        prefixes = [rng.integers(0, 50, 20, dtype=np.int32) for _ in range(4)]
        for step in range(120):
            key = np.concatenate([prefixes[step % 4], rng.integers(0, 50, 10, dtype=np.int32)])
            key = key[: len(key) - len(key) % 2]
            match = cache.match_prefix(key)
            need = len(key) - len(match.indices)
            if need > cache.allocator.available_size():
                cache.evict(need)
            if step == 80:
                cache.reset()
                continue
            slots = cache.allocator.alloc(len(key) - len(match.indices))
            inserted = cache.insert(key, np.concatenate([match.indices, slots]))
            cache.allocator.free(
                np.concatenate([match.indices, slots])[len(match.indices) : inserted]
            )
            publisher.publish(cache.take_events())
            cache.check_invariants()
        publisher.publish(cache.take_events())
        batches = _receive(sub)
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        pages: set[bytes] = set()
        for _, events in batches:
            _apply(pages, events)
        assert pages == _tree_pages(cache)
        assert any(e[0] == "BlockRemoved" for _, ev in batches for e in ev), "evictions happened"
    finally:
        publisher.close()
        sub.close(linger=0)


def test_a_node_split_publishes_no_removal():
    cache = RadixCache(TokenToKVPoolAllocator(100), enable_kv_events=True)
    first = np.arange(1, 9, dtype=np.int32)
    cache.insert(first, cache.allocator.alloc(8))
    second = np.array([1, 2, 3, 4, 90, 91], dtype=np.int32)
    match = cache.match_prefix(second)
    cache.insert(second, np.concatenate([match.indices, cache.allocator.alloc(2)]))
    kinds = [type(e).__name__ for e in cache.take_events()]
    assert kinds == ["BlockStored", "BlockStored"]


def test_missed_batches_are_replayed_then_the_end_marker():
    endpoint, replay_endpoint = _endpoint(), _endpoint()
    publisher = KVEventPublisher(endpoint, replay_endpoint, heartbeat=600)
    try:
        cache = RadixCache(TokenToKVPoolAllocator(100), enable_kv_events=True)
        for i in range(5):
            cache.insert(np.array([i, i + 1, i + 2], dtype=np.int32), cache.allocator.alloc(3))
            publisher.publish(cache.take_events())
        time.sleep(0.3)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        seqs = []
        while dealer.poll(2000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                assert payload == b""
                break
            seqs.append(int.from_bytes(seq, "big"))
            assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"
        assert seqs == [2, 3, 4]
        dealer.close(linger=0)
    finally:
        publisher.close()


def test_a_quiet_publisher_sends_numbered_heartbeats():
    endpoint = _endpoint()
    sub = _subscriber(endpoint)
    publisher = KVEventPublisher(endpoint, heartbeat=0.2)
    try:
        seqs = []
        deadline = time.monotonic() + 10
        while len(seqs) < 3 and time.monotonic() < deadline:
            if sub.poll(500):
                _, seq, payload = sub.recv_multipart()
                ts, events = msgspec.msgpack.decode(payload)
                assert events == [] and ts > 0
                seqs.append(int.from_bytes(seq, "big"))
        assert len(seqs) == 3 and seqs == sorted(seqs) and len(set(seqs)) == 3
    finally:
        publisher.close()
        sub.close(linger=0)


def test_a_live_server_publishes_what_its_requests_store(tiny_model_dir):
    endpoint = _endpoint()
    engine = Engine(str(tiny_model_dir), enable_kv_events=True)
    server = LiveServer(engine, kv_events_endpoint=endpoint)
    sub = _subscriber(endpoint)
    try:
        prompt = "t5 t9 t13 t17 t21 t3 t7"
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        pages: set[bytes] = set()
        stored_tokens = []
        for _, events in _receive(sub):
            _apply(pages, events)
            stored_tokens += [t for e in events if e[0] == "BlockStored" for t in e[3]]
        assert stored_tokens[:7] == engine.tokenizer.encode(prompt)
        server.idle_check()
        assert pages == _tree_pages(engine.cache)
        assert httpx.post(f"{server.url}/flush_cache").status_code == 200
        assert [e[0] for _, ev in _receive(sub) for e in ev] == ["AllBlocksCleared"]
    finally:
        sub.close(linger=0)
        server.stop()
