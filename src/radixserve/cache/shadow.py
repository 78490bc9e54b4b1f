"""Shadow caches: what other eviction policies would have hit, estimated on a sample of pages.

Spatial sampling after SHARDS (Waldspurger et al., FAST 2015) and miniature simulations
(Waldspurger et al., USENIX ATC 2017): a page is sampled when the hash of its whole prefix
falls below a threshold, so every reference to a sampled page is seen and no other page is. A
cache of `rate` x the real capacity, fed only the sampled pages, then hits about the share that
the full-size cache would. Under LRU a radix tree evicts exactly what per-page LRU evicts (a
parent is always used at least as recently as its children), so the LRU shadow is unbiased;
the LFU and GreedyDual shadows treat pages as independent objects, an approximation that the
adaptive policy corrects by comparing them with the real tree while it follows them.

`PrefixHasher` names pages by a polynomial hash of every token up to the page's end, computed
incrementally along a tree edge from the hash where the edge starts.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

import numpy as np

_MULT = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_MASK = 2**64 - 1


class PrefixHasher:
    """Hashes of token-sequence prefixes at page ends, and which pages are sampled.

    The hash of a prefix t_0..t_i continuing from `start` is
    start * B**(i+1) + sum_j t_j * B**(i-j) modulo 2**64, for an odd B; a page is sampled
    when that hash is below `rate` x 2**64, so its high bits decide.
    """

    def __init__(self, page_size: int, rate: float) -> None:
        self.page_size = page_size
        self.rate = rate
        self.threshold = np.uint64(min(_MASK, int(rate * 2.0**64)))
        self._powers = np.ones(1, dtype=np.uint64)
        self._inverses = np.ones(1, dtype=np.uint64)

    def _grow(self, n: int) -> None:
        size = max(n, 2 * len(self._powers))
        old = len(self._powers)
        powers = np.empty(size, dtype=np.uint64)
        inverses = np.empty(size, dtype=np.uint64)
        powers[:old], inverses[:old] = self._powers, self._inverses
        p, q = int(self._powers[-1]), int(self._inverses[-1])
        step, back = _MULT, pow(_MULT, -1, 2**64)
        for i in range(old, size):
            p, q = p * step & _MASK, q * back & _MASK
            powers[i], inverses[i] = p, q
        self._powers, self._inverses = powers, inverses

    def page_hashes(self, start: int, key: bytes) -> np.ndarray:
        """The hash at each page end of `key` (int32 LE tokens), continuing from `start`."""
        tokens = np.frombuffer(key, dtype=np.uint32)
        n = len(tokens)
        if n >= len(self._powers):
            self._grow(n + 1)
        x = tokens * self._inverses[:n]  # uint64, wrapping
        x[0] += np.uint64(start * _MULT & _MASK)
        x.cumsum(out=x)
        x *= self._powers[:n]
        if self.page_size > 1:
            x = x[self.page_size - 1 :: self.page_size]
        return x

    def end_and_samples(self, start: int, key: bytes) -> tuple[int, int, list[int]]:
        """(hash at the end of `key`, hash at its first page's end, sampled pages' hashes)."""
        hashes = self.page_hashes(start, key)
        sampled = hashes[hashes < self.threshold].tolist() if self.threshold else []
        return int(hashes[-1]), int(hashes[0]), sampled


class _Shadow:
    """A cache of page names under some policy: `_hit`, `_insert` and `_evict` define it."""

    capacity: int
    _present: dict  # page name -> the policy's state of it

    def reference(self, pages: list[int]) -> int:
        """One request uses `pages` (its path's sampled pages, deepest first); returns the hits.

        As in the tree, where a request's path is locked while room is made for its new pages:
        its hits are renewed first, room is made for all of its misses, then they are admitted.
        """
        present = self._present
        hits = [page for page in pages if page in present]
        for page in hits:
            self._hit(page)
        if len(hits) == len(pages):
            return len(hits)
        misses = [page for page in pages if page not in present]
        for _ in range(min(len(present), len(present) + len(misses) - self.capacity)):
            self._evict()
        for page in misses:
            self._insert(page)
        while len(present) > self.capacity:
            self._evict()
        return len(hits)

    def access(self, page: int) -> bool:
        """One use of one page; True if it was cached."""
        return bool(self.reference([page]))


class LRUShadow(_Shadow):
    """Least recently used, over page names; a request's root-most page is its most recent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def reference(self, pages: list[int]) -> int:
        # The base class's steps, written out on one OrderedDict without a call per page.
        cached = self._pages
        hits = [page for page in pages if page in cached]
        misses = len(pages) - len(hits)
        if misses:
            for page in hits:  # renewed before room is made, as a locked path is
                cached.move_to_end(page)
            for _ in range(min(len(cached), len(cached) + misses - self.capacity)):
                cached.popitem(last=False)
            for page in pages:
                if page not in cached:
                    cached[page] = None
            while len(cached) > self.capacity:
                cached.popitem(last=False)
        for page in hits:  # the hits end newest: the new pages are deeper
            cached.move_to_end(page)
        return len(hits)


class LFUShadow(_Shadow):
    """Least frequently used, then least recently used (SGLang's LFU), over page names.

    Pages sit in one LRU-ordered bucket per hit count, so every operation is O(1).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._count: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._min = 0
        self._present = self._count

    def __len__(self) -> int:
        return len(self._count)

    def _hit(self, page: int) -> None:
        count = self._count[page]
        buckets = self._buckets
        bucket = buckets[count]
        del bucket[page]
        if not bucket:
            del buckets[count]
            if self._min == count:
                self._min = count + 1
        self._count[page] = count + 1
        buckets.setdefault(count + 1, OrderedDict())[page] = None

    def _insert(self, page: int) -> None:
        self._count[page] = 0
        self._buckets.setdefault(0, OrderedDict())[page] = None
        self._min = 0

    def _evict(self) -> None:
        while self._min not in self._buckets:  # only after a bucket emptied by a hit
            self._min += 1
        bucket = self._buckets[self._min]
        victim, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[self._min]
        del self._count[victim]


class GreedyDualShadow(_Shadow):
    """The `wgd` policy's segments and priorities over page names (see `cache.evict`)."""

    def __init__(self, capacity: int, window: float, ghost: float) -> None:
        self.capacity = capacity
        self.clock = 0
        self._keys: dict[int, tuple] = {}
        self._heap: list[tuple] = []
        self._window_limit = max(1, int(window * capacity))
        self._ghost_limit = int(ghost * capacity)
        self._window: deque[int] = deque()
        self._in_window: set[int] = set()
        self._hits: dict[int, int] = {}
        self._ghosts: OrderedDict[int, None] = OrderedDict()
        self._level = 0.0
        self._demotions = 0
        self._present = self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def _set(self, page: int, key: tuple) -> None:
        self._keys[page] = key
        heapq.heappush(self._heap, (key, page))
        if len(self._heap) > 2 * len(self._keys) + 1024:
            self._heap = [(k, p) for p, k in self._keys.items()]
            heapq.heapify(self._heap)

    def _hit(self, page: int) -> None:
        self.clock += 1
        count = self._hits[page] + 1
        self._hits[page] = count
        self._in_window.discard(page)
        self._set(page, (self._level + math.log2(2 + count), 1, self.clock))

    def _insert(self, page: int) -> None:
        self.clock += 1
        level = self._level
        self._hits[page] = 0
        self._set(page, (level + 1.0, 1, self.clock))
        if page in self._ghosts:  # came back soon after eviction: protected
            del self._ghosts[page]
            return
        self._in_window.add(page)
        self._window.append(page)
        while len(self._in_window) > self._window_limit:
            old = self._window.popleft()
            if old in self._in_window:
                self._in_window.discard(old)
                if not self._hits[old]:
                    self._demotions += 1
                    self._set(old, (level, 0, -self._demotions))

    def _evict(self) -> None:
        while True:
            key, victim = heapq.heappop(self._heap)
            if self._keys.get(victim) == key:
                break
        del self._keys[victim]
        self._level = max(self._level, key[0])
        self._in_window.discard(victim)
        if key[1] == 0 and self._ghost_limit:
            self._ghosts[victim] = None
            if len(self._ghosts) > self._ghost_limit:
                self._ghosts.popitem(last=False)
        del self._hits[victim]
