"""Shadow caches: what other eviction policies would have hit, estimated on a sample of pages.

Spatial sampling after SHARDS (Waldspurger et al., FAST 2015) and miniature simulations
(Waldspurger et al., USENIX ATC 2017): a page is sampled when the hash of its whole prefix
falls below a threshold, so every reference to a sampled page is seen and no other page is. A
cache of `rate` x the real capacity, fed only the sampled pages, then hits about the share that
the full-size cache would. Under LRU a radix tree evicts exactly what per-page LRU evicts (a
parent is always used at least as recently as its children), so the LRU shadow is unbiased;
the LFU and GreedyDual shadows treat pages as independent objects, an approximation that the
adaptive policy corrects by comparing them with the real tree while it follows them.

`PrefixHasher` names the units sampled, blocks of a fixed number of tokens, by checksums of
every token up to the block's end, continued along a tree edge from where the edge starts.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from radixserve.cache.hashing import TOKEN_BYTES, namespace_seed

if TYPE_CHECKING:
    from radixserve.cache.radix import TreeNode

# A prefix's state: its CRC-32, its Adler-32, and how many of its bytes are past its last
# block end.
HashState = tuple[int, int, int]


class PrefixHasher:
    """Names of token-sequence prefixes at block ends, and which blocks are sampled.

    A block ends every `block_tokens` tokens from the start of a sequence. Its name is the
    CRC-32 and the Adler-32 (zlib's, both continued across calls, so any cut of a sequence into
    edges gives the same names) of the namespace seed and every token up to its end, as one
    64-bit integer. A block is sampled when its prefix's CRC-32 is below `rate` x 2**32.
    Hashing costs one pair of C calls per block end, and none per token.
    """

    def __init__(self, block_tokens: int | None, rate: float, page_tokens: int = 1) -> None:
        # No blocks (None): only first pages are named.
        self.block_bytes = TOKEN_BYTES * block_tokens if block_tokens else 1 << 62
        self.page_bytes = TOKEN_BYTES * page_tokens
        self.rate = rate
        self.threshold = min(2**32, int(rate * 2.0**32))

    def seed(self, seed: bytes) -> HashState:
        """The state before the first token of a sequence in the namespace named by `seed`."""
        return zlib.crc32(seed), zlib.adler32(seed), 0

    def end_and_samples(self, start: HashState, key: bytes) -> tuple[HashState, int, list[int]]:
        """(state at the end of `key`, the name at its first page's end, its sampled blocks'
        names) for `key` (int32 LE tokens) continuing from `start`."""
        crc, adler, into = start
        data = memoryview(key)
        n = len(data)
        head = data[: self.page_bytes]
        first = zlib.crc32(head, crc) << 32 | zlib.adler32(head, adler)
        sampled = []
        threshold, block, crc32 = self.threshold, self.block_bytes, zlib.crc32
        done = 0
        cut = block - into
        while cut <= n:
            crc = crc32(data[done:cut], crc)
            if crc < threshold:  # the Adler-32 only where a name is kept
                sampled.append(crc << 32 | zlib.adler32(data[:cut], adler))
            done, cut = cut, cut + block
        if done < n:
            crc = crc32(data[done:], crc)
        return (crc, zlib.adler32(data, adler), (into + n) % block), first, sampled


# What PrefixRecords keeps of a node: (edge bytes when recorded, the hash state at its end,
# its first page's name, the names of the sampled blocks that end in it).
Record = tuple[int, HashState, int, list[int]]


class PrefixRecords:
    """`PrefixHasher`'s names for the nodes of one radix tree, computed once per node.

    A node's record is kept until `forget`; one whose edge was shortened by a split is
    recomputed from the nearest ancestor with a valid record, so names never depend on where
    edges were cut. Memory: one record per node, about 200 bytes.
    """

    def __init__(self, hasher: PrefixHasher) -> None:
        self.hasher = hasher
        self._records: dict[TreeNode, Record] = {}

    def __len__(self) -> int:
        return len(self._records)

    def record(self, node: TreeNode) -> Record:
        """`node`'s record, computing it and those of ancestors without a valid one."""
        records = self._records
        record = records.get(node)
        if record is not None and record[0] == len(node.key):
            return record
        stale = [node]
        above = node.parent
        while above.parent is not None:
            record = records.get(above)
            if record is not None and record[0] == len(above.key):
                break
            stale.append(above)
            above = above.parent
        if above.parent is not None:
            start = record[1]
        else:  # the same in every process
            start = self.hasher.seed(b"radixserve" + namespace_seed(above.extra_key))
        for todo in reversed(stale):
            end, first, sampled = self.hasher.end_and_samples(start, todo.key)
            record = records[todo] = (len(todo.key), end, first, sampled)
            start = end
        return record

    def path(self, node: TreeNode) -> list[Record]:
        """The valid records of `node` and of its ancestors below the root, deepest first."""
        records = self._records
        out = []
        while node.parent is not None:
            record = records.get(node)
            if record is None or record[0] != len(node.key):
                record = self.record(node)
            out.append(record)
            node = node.parent
        return out

    def identity(self, node: TreeNode) -> int:
        """A name for where `node` starts (its first page's), equal for a later node cached at
        the same place."""
        return self.record(node)[2]

    def forget(self, node: TreeNode) -> None:
        self._records.pop(node, None)


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
        if len(hits) < len(pages):
            self._admit([page for page in pages if page not in present])
        return len(hits)

    def _admit(self, misses: list[int]) -> None:
        """Make room for a request's `misses` (its hits already renewed), then insert them."""
        present = self._present
        for _ in range(min(len(present), len(present) + len(misses) - self.capacity)):
            self._evict()
        for page in misses:
            self._insert(page)
        while len(present) > self.capacity:
            self._evict()

    def reference_all(self, requests: list[list[int]]) -> int:
        """`reference` for each of `requests` in order; returns the hits."""
        reference = self.reference
        return sum([reference(pages) for pages in requests])

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
        return self.reference_all([pages])

    def reference_all(self, requests: list[list[int]]) -> int:
        # The base class's steps, written out on one OrderedDict without a call per page.
        cached, capacity = self._pages, self.capacity
        renew, evict = cached.move_to_end, cached.popitem
        total = 0
        for pages in requests:
            hits = [page for page in pages if page in cached]
            total += len(hits)
            misses = len(pages) - len(hits)
            if misses:
                for page in hits:  # renewed before room is made, as a locked path is
                    renew(page)
                for _ in range(min(len(cached), len(cached) + misses - capacity)):
                    evict(last=False)
                for page in pages:
                    if page not in cached:
                        cached[page] = None
                while len(cached) > capacity:
                    evict(last=False)
                for page in hits:  # the hits end newest: the new pages are deeper
                    if page in cached:  # not evicted by a request larger than the shadow
                        renew(page)
            else:
                for page in hits:
                    renew(page)
        return total


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

    def reference(self, pages: list[int]) -> int:
        return self.reference_all([pages])

    def reference_all(self, requests: list[list[int]]) -> int:
        # The base class's steps, with the hits written out on the buckets.
        count, buckets = self._count, self._buckets
        total = 0
        for pages in requests:
            misses = []
            for page in pages:
                n = count.get(page)
                if n is None:
                    misses.append(page)
                    continue
                total += 1
                bucket = buckets[n]
                del bucket[page]
                if not bucket:
                    del buckets[n]
                    if self._min == n:
                        self._min = n + 1
                count[page] = n + 1
                above = buckets.get(n + 1)
                if above is None:
                    above = buckets[n + 1] = OrderedDict()
                above[page] = None
            if misses:
                self._admit(misses)
        return total

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


class LearnedLRUShadow(_Shadow):
    """`learned-lru` over page names: a page falls due at its last use plus the tolerance of
    its hit class (`min(hits, classes - 1)`), read from `source.tolerance` at each eviction;
    the page that falls due first is evicted. With all tolerances equal it is `LRUShadow`.

    Pages sit in one list per hit class in order of last use, so an eviction compares the
    classes' oldest pages only. References carry the time they happen at (the tree's clock,
    the tolerances' unit).
    """

    def __init__(self, capacity: int, source, classes: int) -> None:
        self.capacity = capacity
        self.source = source  # anything with a `tolerance` list of `classes` ages
        self._top = classes - 1
        self._lists: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(classes)]
        self._hits: dict[int, int] = {}
        self._present = self._hits
        self._now = 0.0

    def __len__(self) -> int:
        return len(self._hits)

    def _hit(self, page: int) -> None:
        count = self._hits[page]
        del self._lists[min(count, self._top)][page]
        self._hits[page] = count + 1
        self._lists[min(count + 1, self._top)][page] = self._now

    def _insert(self, page: int) -> None:
        self._hits[page] = 0
        self._lists[0][page] = self._now

    def _evict(self) -> None:
        due, victim_list = math.inf, None
        for pages, tolerated in zip(self._lists, self.source.tolerance, strict=True):
            if pages:
                when = next(iter(pages.values())) + tolerated
                if victim_list is None or when < due:
                    due, victim_list = when, pages
        victim, _ = victim_list.popitem(last=False)
        del self._hits[victim]

    def reference(self, pages: list[int], now: float | None = None) -> int:
        """One request uses `pages` at time `now` (default: the previous reference's), as
        `_Shadow.reference`; returns the hits."""
        return self.reference_all([pages], [self._now if now is None else now])

    def reference_all(self, requests: list[list[int]], times: list[float]) -> int:
        """`reference` for each of `requests` at its time in `times`; returns the hits."""
        # The base class's steps, with the hits written out on the lists.
        hits_of, lists, top = self._hits, self._lists, self._top
        total = 0
        for pages, now in zip(requests, times, strict=True):
            misses = []
            for page in pages:
                count = hits_of.get(page)
                if count is None:
                    misses.append(page)
                    continue
                total += 1
                hits_of[page] = count + 1
                if count < top:
                    del lists[count][page]
                    lists[count + 1][page] = now
                else:
                    at_top = lists[top]
                    at_top[page] = now
                    at_top.move_to_end(page)
            if misses:
                self._now = now
                self._admit(misses)
        if times:
            self._now = times[-1]
        return total


class GreedyDualShadow(_Shadow):
    """The `wgd` policy's segments and priorities over page names (see `cache.evict`)."""

    def __init__(self, capacity: int, window: float, ghost: float) -> None:
        self.capacity = capacity
        self.clock = 0
        # page -> its key as a heap entry (priority, segment, stamp, page). A hit only raises
        # a page's key (in `_unheaped` until its entry is pushed): an older, lower entry of the
        # page stays in the heap, and when it comes to the top the current one is pushed. So
        # the heap holds, for every page, an entry no higher than its key, its top is the
        # least key when current, and a hit costs no heap operation.
        self._keys: dict[int, tuple] = {}
        self._unheaped: set[int] = set()
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

    def _set(self, page: int, priority: float, segment: int, stamp: int) -> None:
        """Give `page` a key that may be lower than its last: its entry goes in the heap."""
        entry = self._keys[page] = (priority, segment, stamp, page)
        self._unheaped.discard(page)
        heap = self._heap
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._keys) + 1024:
            heap[:] = self._keys.values()  # in place: reference_all holds this list
            heapq.heapify(heap)
            self._unheaped.clear()

    def reference(self, pages: list[int]) -> int:
        return self.reference_all([pages])

    def reference_all(self, requests: list[list[int]]) -> int:
        # The base class's steps, with the hits (`_hit`) written out on local state.
        keys, hits_of, in_window, unheaped = self._keys, self._hits, self._in_window, self._unheaped
        log2 = math.log2
        clock, level = self.clock, self._level
        total = 0
        for pages in requests:
            misses = []
            for page in pages:
                if page not in keys:
                    misses.append(page)
                    continue
                clock += 1
                count = hits_of[page] + 1
                hits_of[page] = count
                in_window.discard(page)
                keys[page] = (level + log2(2 + count), 1, clock, page)
                unheaped.add(page)
            total += len(pages) - len(misses)
            if misses:
                self.clock, self._level = clock, level
                self._admit(misses)
                clock, level = self.clock, self._level
        self.clock, self._level = clock, level
        return total

    def _hit(self, page: int) -> None:
        self.clock += 1
        count = self._hits[page] + 1
        self._hits[page] = count
        self._in_window.discard(page)
        self._keys[page] = (self._level + math.log2(2 + count), 1, self.clock, page)
        self._unheaped.add(page)  # a higher key than the page's entry in the heap

    def _insert(self, page: int) -> None:
        self.clock += 1
        level = self._level
        self._hits[page] = 0
        self._set(page, level + 1.0, 1, self.clock)
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
                    self._set(old, level, 0, -self._demotions)

    def _pop_least(self) -> tuple:
        """The entry of the page with the least key, out of the heap."""
        keys, unheaped, heap = self._keys, self._unheaped, self._heap
        while True:
            entry = heapq.heappop(heap)
            page = entry[3]
            current = keys.get(page)
            if current is entry:
                return entry
            if page in unheaped:  # the page's key was raised since: it takes its place
                unheaped.discard(page)
                heapq.heappush(heap, current)

    def _evict(self) -> None:
        entry = self._pop_least()
        victim = entry[3]
        del self._keys[victim]
        self._level = max(self._level, entry[0])
        self._in_window.discard(victim)
        if entry[1] == 0 and self._ghost_limit:
            self._ghosts[victim] = None
            if len(self._ghosts) > self._ghost_limit:
                self._ghosts.popitem(last=False)
        del self._hits[victim]
