"""Routing state shared by the HTTP router (`router.app`) and the Ray Serve request router
(`router.ray_serve`): backends' load, liveness and KV event freshness around a policy."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.sched.routing import Precise, ReplicaLoad, RouteRequest, make_routing_policy

log = logging.getLogger(__name__)


@dataclass
class Backend:
    url: str
    in_flight: dict[int, tuple[float, int]] = field(default_factory=dict)  # id -> (t0, tokens)
    down_until: float = 0.0
    routed: int = 0
    last_events: float = 0.0  # when its last KV event batch arrived
    events_expired: bool = False
    reported_running: int = 0  # requests the backend last said it was decoding

    def load(self, now: float) -> ReplicaLoad:
        """Its in-flight requests, of which as many as it last reported running count as
        running (the rest as queued), their prompt tokens, and the oldest one's wait."""
        tokens = sum(t for _, t in self.in_flight.values())
        oldest = min((t0 for t0, _ in self.in_flight.values()), default=now)
        running = min(self.reported_running, len(self.in_flight))
        return ReplicaLoad(len(self.in_flight) - running, tokens, running, now - oldest)


class Router:
    """Per-backend load, liveness and KV event freshness around a routing policy, shared by
    the request handlers and the event threads (thread-safe).

    Load as the router sees it: the requests and prompt tokens it has in flight per backend,
    and how long the oldest has waited for its answer. A backend marked down is tried last
    for `retry_after` seconds and `precise` forgets its pages; a backend whose KV events stop
    (no batch, not even the publisher's heartbeat, for `events_timeout` seconds) has its pages
    forgotten too, until its events resume.
    """

    def __init__(
        self,
        backends: Sequence[str],
        policy: str,
        page_size: int = 1,
        retry_after: float = 5.0,
        events_timeout: float = 10.0,
        clock=time.monotonic,
    ) -> None:
        self.clock = clock
        self.backends = [Backend(url.rstrip("/"), last_events=clock()) for url in backends]
        self.policy = make_routing_policy(policy, len(self.backends), page_size=page_size)
        self.retry_after = retry_after
        self.events_timeout = events_timeout
        self.lock = threading.Lock()
        self._ids = 0

    def order(self, ids: list[int], session: str | None) -> list[int]:
        """Backends to try, the policy's choice first, then the rest by load; down ones last."""
        now = self.clock()
        with self.lock:
            self._expire_silent(now)
            loads = [b.load(now) for b in self.backends]
            first = self.policy.choose(RouteRequest(ids, session=session), loads)
        rest = sorted(
            (i for i in range(len(self.backends)) if i != first),
            key=lambda i: (loads[i].queued_requests, i),
        )
        up = [i for i in [first, *rest] if self.backends[i].down_until <= now]
        return up + [i for i in [first, *rest] if i not in up]

    def start(self, k: int, tokens: int) -> int:
        with self.lock:
            self._ids += 1
            self.backends[k].in_flight[self._ids] = (self.clock(), tokens)
            self.backends[k].routed += 1
            return self._ids

    def end(self, k: int, request_id: int) -> None:
        with self.lock:
            self.backends[k].in_flight.pop(request_id, None)

    def mark_down(self, k: int) -> None:
        with self.lock:
            self.backends[k].down_until = self.clock() + self.retry_after
            self.policy.forget(k)

    def report(self, k: int, running: int) -> None:
        """Backend k says it is running this many requests (its own, possibly stale, count)."""
        with self.lock:
            self.backends[k].reported_running = max(0, int(running))

    def replace(self, k: int, name: str) -> None:
        """Slot k now holds a new backend (a restarted replica): nothing of the old one's
        load, liveness or pages carries over."""
        with self.lock:
            self.backends[k] = Backend(name, last_events=self.clock())
            self.policy.forget(k)

    def on_events(self, k: int, events) -> None:
        """Backend k's next event batch (an empty one is a heartbeat)."""
        with self.lock:
            backend = self.backends[k]
            backend.last_events = self.clock()
            if backend.events_expired:
                backend.events_expired = False
                log.info("backend %d (%s): KV events resumed", k, backend.url)
            self.policy.on_events(k, events)

    def _expire_silent(self, now: float) -> None:
        if not isinstance(self.policy, Precise):
            return
        for k, backend in enumerate(self.backends):
            silent = now - backend.last_events
            if silent > self.events_timeout and not backend.events_expired:
                backend.events_expired = True
                self.policy.forget(k)
                log.warning(
                    "backend %d (%s): no KV events for %.0f s; its pages are forgotten",
                    k,
                    backend.url,
                    silent,
                )


def follow_events(router: Router, k: int, endpoint: str, stop: threading.Event) -> None:
    """Feed backend k's published KV events to the policy until `stop`."""
    import zmq

    from radixserve.server.kv_events import decode_batch, from_wire

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        while not stop.is_set():
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            try:
                batch = decode_batch(frames[-1])
            except Exception:  # a malformed batch must not end the subscription
                log.warning("backend %d: undecodable KV event batch", k)
                continue
            if stop.is_set():  # the slot may hold another backend by now
                break
            router.on_events(k, [from_wire(e) for e in batch.events])
    finally:
        sub.close(linger=0)
