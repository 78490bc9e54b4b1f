"""The waiting queue: requests not yet admitted, in arrival order, one bucket per priority.

Costs do not grow with the queue's length where the scheduler runs every step:
- adding a request is O(1) (a retracted request, which goes back to its arrival position, is a
  binary search and a C-level move);
- removing one is O(1) (it is forgotten at once, and its slot is skipped and compacted later);
- iterating from the head costs O(requests yielded), plus skipped slots, amortised O(1) each;
- the starving requests are read from the head of each bucket, in O(starving + 1) per bucket,
  since a request's queue time grows with its arrival except after a retraction.

Without priority scheduling every request goes into one bucket, so arrival order is kept
whatever the priorities say.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from radixserve.sched.request import Req


class _Bucket:
    """Entries (arrival_index, ticket, request) of one priority, in order; an entry whose ticket
    is no longer its request's is a hole, skipped and compacted away later."""

    __slots__ = ("head", "holes", "order")

    def __init__(self) -> None:
        self.order: list[tuple[int, int, Req]] = []
        self.head = 0  # order[:head] are all holes
        self.holes = 0

    def add(self, entry: tuple[int, int, Req]) -> None:
        order = self.order
        if not order or order[-1] < entry:
            order.append(entry)
        else:  # a retracted request goes back to its arrival position
            bisect.insort(order, entry, lo=self.head)


class WaitingQueue:
    """Requests waiting for admission, by priority (when enabled), then arrival order."""

    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self._buckets: dict[int, _Bucket] = {}
        self._levels: list[int] = []  # bucket keys, highest priority first
        self._tickets: dict[int, int] = {}  # id(req) -> the ticket of its live entry
        self._next_ticket = 0

    def __len__(self) -> int:
        return len(self._tickets)

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __contains__(self, req: object) -> bool:
        return id(req) in self._tickets

    def add(self, req: Req) -> None:
        """Queue `req` at its arrival position (`req.arrival_index`)."""
        if id(req) in self._tickets:
            raise ValueError(f"request {req.rid!r} is already queued")
        level = req.priority if self.by_priority else 0
        bucket = self._buckets.get(level)
        if bucket is None:
            bucket = self._buckets[level] = _Bucket()
            bisect.insort(self._levels, -level)
        self._next_ticket += 1
        self._tickets[id(req)] = self._next_ticket
        bucket.add((req.arrival_index, self._next_ticket, req))

    def remove(self, req: Req) -> None:
        """Take `req` out of the queue; raises `KeyError` if it is not in it."""
        del self._tickets[id(req)]
        bucket = self._buckets[req.priority if self.by_priority else 0]
        bucket.holes += 1
        if bucket.holes > 64 and bucket.holes > len(bucket.order) // 2:
            bucket.order = [e for e in bucket.order[bucket.head :] if self._is_live(e)]
            bucket.head = bucket.holes = 0

    def _is_live(self, entry: tuple[int, int, Req]) -> bool:
        return self._tickets.get(id(entry[2])) == entry[1]

    def _live(self, bucket: _Bucket) -> Iterator[Req]:
        order = bucket.order
        while bucket.head < len(order) and not self._is_live(order[bucket.head]):
            bucket.head += 1
            bucket.holes -= 1
        for i in range(bucket.head, len(order)):
            entry = order[i]
            if self._is_live(entry):
                yield entry[2]

    def levels(self) -> list[Iterator[Req]]:
        """One iterator per priority bucket, highest first, each in arrival order."""
        return [self._live(self._buckets[-level]) for level in self._levels]

    def __iter__(self) -> Iterator[Req]:
        """Every waiting request: bucket by bucket, highest priority first, arrival order."""
        for level in self.levels():
            yield from level

    def starving(self, now: float, max_wait: float) -> list[Req]:
        """Requests queued for `max_wait` seconds or more, oldest queue time first."""
        out = []
        for level in self.levels():
            for req in level:
                if now - req.queued_time >= max_wait:
                    out.append(req)
                elif not req.num_retractions:
                    break  # every later arrival was queued later still
        out.sort(key=lambda r: r.queued_time)
        return out
