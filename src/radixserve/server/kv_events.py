"""Publishing the radix tree's KV events over ZMQ, in the wire layout of vLLM and SGLang.

Each engine step's events go out as one `KVEventBatch` (msgpack via msgspec, array-like,
tagged events `BlockStored`, `BlockRemoved`, `AllBlocksCleared`) on a PUB socket, as the
multipart message [topic, sequence number (8 bytes, big-endian), payload]. A subscriber that
missed messages asks the replay socket (ROUTER) for everything from a sequence number on: it
sends [b"", start (8 bytes)] (a REQ socket adds the empty frame itself) and gets one
[b"", seq, payload] per buffered batch, then [b"", -1 (8 bytes, signed), b""].

Block hashes are radixserve's chained SHA-256 page digests (bytes); `medium` is the device
the pool lives on; `namespace` is the tree's `extra_key` as text, omitted when there is none.

When nothing was published for `heartbeat` seconds, the publisher sends a batch with no events
(numbered and replayable like any other), so that a subscriber can tell a quiet engine from
one that stopped publishing: `radixserve router` forgets a backend's pages when no batch has
come for its `--kv-events-timeout`.

Needs the `events` extra (pyzmq, msgspec).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from radixserve.cache import events as tree_events

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The tagged base of the three events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    namespace: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    namespace: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def to_wire(event: tree_events.KVCacheEvent, medium: str) -> KVCacheEvent:
    """The wire form of one of the tree's events."""
    if isinstance(event, tree_events.BlockStored):
        return BlockStored(
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,
            medium,
            _namespace(event.extra_key),
        )
    if isinstance(event, tree_events.BlockRemoved):
        return BlockRemoved(list(event.block_hashes), medium, _namespace(event.extra_key))
    return AllBlocksCleared()


def from_wire(event: KVCacheEvent) -> tree_events.KVCacheEvent:
    """The tree's form of a decoded wire event (the namespace comes back as text)."""
    if isinstance(event, BlockStored):
        return tree_events.BlockStored(
            tuple(event.block_hashes),
            event.parent_block_hash,
            tuple(event.token_ids),
            event.block_size,
            event.namespace,
        )
    if isinstance(event, BlockRemoved):
        return tree_events.BlockRemoved(tuple(event.block_hashes), event.namespace)
    return tree_events.AllBlocksCleared()


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published payload, decoded; raises `msgspec.DecodeError` on anything else."""
    return _DECODER.decode(payload)


def _namespace(extra_key) -> str | None:
    return None if extra_key is None else str(extra_key)


class KVEventPublisher:
    """Ships event batches from any thread; a thread of its own owns the sockets.

    `publish(events)` never blocks. The last `buffer_batches` batches stay available for
    replay. `close()` stops the thread and the sockets. An endpoint may leave the port to the
    system (`tcp://HOST:*`); `endpoint` then names the one bound.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        medium: str = "CPU",
        buffer_batches: int = 10_000,
        heartbeat: float = 1.0,
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.heartbeat = heartbeat
        self.topic = topic.encode()
        self.medium = medium
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def publish(self, events: Sequence[tree_events.KVCacheEvent]) -> None:
        """Queue one step's events as one batch (nothing is sent for an empty list)."""
        if events:
            self._queue.put((time.time(), list(events)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        context = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        replay = context.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves a "*" port
            if replay is not None:
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = ValueError(f"cannot bind the KV events socket: {exc}")
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        last_sent = time.monotonic()
        try:
            while not self._stop.is_set():
                if replay is not None and poller.poll(10):
                    self._serve_replay(replay)
                elif replay is None:
                    time.sleep(0.01)
                while True:
                    try:
                        ts, events = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    self._send(pub, KVEventBatch(ts, [to_wire(e, self.medium) for e in events]))
                    last_sent = time.monotonic()
                if time.monotonic() - last_sent >= self.heartbeat:
                    self._send(pub, KVEventBatch(time.time(), []))
                    last_sent = time.monotonic()
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _send(self, pub, batch: KVEventBatch) -> None:
        payload = self._encoder.encode(batch)
        self._buffer.append((self._seq, payload))
        pub.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def _serve_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        identity, start = frames[0], frames[-1]
        if len(start) != 8:
            log.warning("KV events replay: a request of %d bytes, not 8", len(start))
            replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
            return
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
