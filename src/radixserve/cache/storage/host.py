"""The host tier's store: pages in this process's memory, in a radix tree of page runs that
an eviction policy of the device tree orders.

Pages are stored in runs of consecutive pages of a chain. A run that starts at page j hangs
from the hash of page j-1 (its namespace in the tree; the first page's run from none), so a
write-back stores only what the device evicted, not the pages before it that the device
still holds, and a later write of those pages joins up with it: a chain is read across runs.
Within a run, eviction takes the last pages first (the tree's leaves), in the order the
policy gives (`lru`, `lfu`, `fifo`, `slru`, any name `make_eviction_policy` knows), so what
stays of a run still loads behind its head. The tree is an ordinary `RadixCache` whose
"tokens" are page ids (each page hash's first 8 bytes, two int32 tokens a page), so
everything the device tree guarantees holds here too, `check_invariants` included. A page
read back is checked against its full hash, so two hashes that share 8 bytes read as a miss,
never as the other's KV.

It sits behind the batch interface of the persistent backends, so the tier code that loads
storage pages into device slots loads host pages the same way. Nothing is framed: the bytes
never leave the process. Its clock counts operations, so a replay of the same requests
evicts the same pages. Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import numpy as np

from radixserve.cache.allocator import PagedTokenToKVPoolAllocator
from radixserve.cache.evict import EvictionPolicy, make_eviction_policy
from radixserve.cache.radix import RadixCache, TreeNode
from radixserve.cache.storage import StorageBackend, StorageIdentity
from radixserve.errors import CacheInvariantError, InvalidArgumentError

_ID_TOKENS = 2  # int32 tokens of a page id


def page_ids(chain: Sequence[bytes]) -> np.ndarray:
    """The host tree's key for a chain of page hashes."""
    return np.frombuffer(b"".join(h[:8] for h in chain), dtype="<i4")


def _namespace(chain: Sequence[bytes], first: int) -> bytes | None:
    """The tree namespace of a run that starts at page `first`."""
    return chain[first - 1] if first else None


class HostStorage(StorageBackend):
    """At most `max_bytes` of pages in RAM, evicted by `eviction_policy` (see the module doc).

    The plain `exists`, `get` and `set` take chains from their first page; the tier's
    `chain_*` calls name the head a chain hangs from.
    """

    def __init__(
        self,
        identity: StorageIdentity,
        max_bytes: int,
        eviction_policy: str | EvictionPolicy = "lru",
    ) -> None:
        super().__init__(identity)
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidArgumentError(f"the host tier needs a size > 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.policy = make_eviction_policy(eviction_policy)
        # Built at the first write, when a page's size is known.
        self._tree: RadixCache | None = None
        self._page_len = 0
        self._pages: dict[int, tuple[bytes, bytes]] = {}  # host page -> (hash, payload)
        self._lock = threading.Lock()

    # -- sizes ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._tree.total_size() // _ID_TOKENS if self._tree is not None else 0

    def size_bytes(self) -> int:
        return len(self) * self._page_len

    def items(self) -> list[tuple[bytes, bytes]]:
        """(hash, payload) of every stored page."""
        with self._lock:
            return list(self._pages.values())

    # -- the batch interface ----------------------------------------------------------------

    def exists(self, pages: Sequence[bytes]) -> int:
        return self.chain_exists(pages, 0)

    def get(self, pages: Sequence[bytes]) -> list[bytes]:
        return self.chain_get(pages, 0)

    def set(self, pages: Sequence[bytes], payloads: Sequence[bytes]) -> int:
        return self.chain_set(pages, 0, payloads)

    def chain_exists(self, chain: Sequence[bytes], start: int = 0) -> int:
        with self._lock:
            if self._tree is None:
                return 0
            held = self._held(chain, start)
            return held[-1][1] - start if held else 0

    def chain_get(self, chain: Sequence[bytes], start: int = 0) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            if self._tree is not None:
                pos = start
                for first, end in self._held(chain, start):
                    ids = page_ids(chain[first:end])
                    match = self._tree.match_prefix(ids, _namespace(chain, first))
                    pages = match.indices[::_ID_TOKENS] // _ID_TOKENS
                    for k in range(pos, end):
                        digest, payload = self._pages[int(pages[k - first])]
                        if digest != chain[k]:
                            break  # two hashes sharing an id: the other's KV is not ours
                        out.append(payload)
                        pos += 1
                    if pos < end:
                        break
            if len(out) < len(chain) - start:
                self.stats.misses += 1
        self.stats.hits += len(out)
        self.stats.bytes_read += sum(len(p) for p in out)
        return out

    def chain_set(self, chain: Sequence[bytes], start: int, payloads: Sequence[bytes]) -> int:
        """Store `payloads` as chain[start:], whether or not chain[:start] is stored (the
        device may hold it); pages already stored are kept. When the cap leaves no room for
        all, the leading ones that fit are stored. Returns how many of chain[start:] are
        stored afterwards."""
        if len(chain) - start != len(payloads) or start < 0:
            raise InvalidArgumentError("set needs one payload per page past the chain's head")
        if not payloads:
            return 0
        size = len(payloads[0])
        if any(len(p) != size for p in payloads) or (self._page_len and size != self._page_len):
            raise InvalidArgumentError("every page of a host tier has the same size")
        with self._lock:
            if self._tree is None:
                if size > self.max_bytes:
                    return 0
                self._tree = self._new_tree(self.max_bytes // size)
                self._page_len = size
            return self._insert(chain, start, payloads)

    def _held(self, chain: Sequence[bytes], start: int) -> list[tuple[int, int]]:
        """The stored runs (first page, end page) that hold chain[start:end] without a gap,
        in order; empty when chain[start] is not stored.

        Pages are stored in runs: a run that starts at page j hangs from the hash of page j-1
        (its namespace in the tree), so a write-back stores only what the device evicted,
        not the pages before it that the device still holds. A chain may span several runs.
        """
        tree, runs, pos = self._tree, [], start
        ids = page_ids(chain)
        while pos < len(chain):
            best = None
            for first in range(pos, -1, -1):
                namespace = _namespace(chain, first)
                if not tree.has_namespace(namespace):
                    continue
                end = first + tree.peek_prefix(ids[first * _ID_TOKENS :], namespace) // _ID_TOKENS
                if end > pos and (best is None or end > best[1]):
                    best = (first, end)
            if best is None:
                break
            runs.append(best)
            pos = best[1]
        return runs

    def _insert(self, chain: Sequence[bytes], start: int, payloads: Sequence[bytes]) -> int:
        tree = self._tree
        held = self._held(chain, max(0, start - 1))  # a run that ends at chain[start] grows
        first, end = held[-1] if held else (start, start)  # the run the new pages extend
        namespace = _namespace(chain, first)
        ids = page_ids(chain[first:])
        match = tree.match_prefix(ids[: (end - first) * _ID_TOKENS], namespace, count_hit=False)
        new = len(chain) - end
        tree.inc_lock_ref(match.last_node)  # making room must not evict the run we extend
        try:
            short = new * _ID_TOKENS - tree.allocator.available_size()
            if short > 0:
                tree.evict(short)
            new = min(new, tree.allocator.available_size() // _ID_TOKENS)
            slots = tree.allocator.alloc(new * _ID_TOKENS)
            for k, page in zip(
                range(end, end + new), slots[::_ID_TOKENS] // _ID_TOKENS, strict=True
            ):
                self._pages[int(page)] = (chain[k], payloads[k - start])
            value = np.concatenate([match.indices, slots])
            tree.insert(ids[: len(value)], value, extra_key=namespace)
        finally:
            tree.dec_lock_ref(match.last_node)
        self.stats.stored += new
        self.stats.bytes_written += new * self._page_len
        return end + new - start

    def _new_tree(self, pages: int) -> RadixCache:
        allocator = PagedTokenToKVPoolAllocator(max(1, pages) * _ID_TOKENS, _ID_TOKENS)
        clock = itertools.count().__next__
        tree = RadixCache(allocator, _ID_TOKENS, self.policy, clock=clock)
        tree.evict_listener = self._dropped
        return tree

    def _dropped(self, node: TreeNode) -> None:
        for page in node.value[::_ID_TOKENS] // _ID_TOKENS:
            del self._pages[int(page)]
        self.stats.evicted += len(node.value) // _ID_TOKENS

    def clear(self) -> int:
        with self._lock:
            n = len(self)
            if self._tree is not None:
                self._tree.reset()
                self._pages.clear()
        return n

    def check_invariants(self) -> None:
        """Raise `CacheInvariantError` unless the tree's bookkeeping is exact, every stored
        page has its payload and hash and no free page has, and the size is under the cap."""
        with self._lock:
            if self._tree is None:
                return
            self._tree.check_invariants()
            held = {int(p) // _ID_TOKENS for n in self._tree._nodes() for p in n.value}
            stored = self._pages.keys()
            if held != stored:
                raise CacheInvariantError(
                    f"host pages in the tree without a payload: {sorted(held - stored)[:5]}; "
                    f"with a payload, not in the tree: {sorted(stored - held)[:5]}"
                )
            if self.size_bytes() > self.max_bytes:
                raise CacheInvariantError(
                    f"the host tier holds {self.size_bytes()} bytes over its cap {self.max_bytes}"
                )
