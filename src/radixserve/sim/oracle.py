"""Bounds for the policy lab: the infinite-cache hit rate and an offline Belady oracle.

The infinite-cache bound is the token hit rate of a cache that never evicts, serving the
trace in arrival order: 1 - (tokens on the edges of the prefix tree of everything served) /
(total prompt tokens). Where a trace carries answers (`output_ids`) they enter the tree after
their request, as they do in the server, so a later prompt quoting them counts as a hit.

`BeladyPolicy` is an eviction policy for `RadixCache` that reads the trace's future: it evicts
the leaf whose next use is furthest away, deepest first on ties, where a use of a node is the
admission of a request whose prompt runs through the node's first page. Leaves of running
requests are locked, so they stay pinned. It needs the scheduler's `on_admit` hook to learn
which uses have happened.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from radixserve.cache.allocator import TokenToKVPoolAllocator
from radixserve.cache.hashing import hash_pages
from radixserve.cache.radix import RadixCache, TreeNode
from radixserve.sched.request import Req
from radixserve.sim.traces import TraceRequest


def served_sequence(r: TraceRequest) -> np.ndarray:
    """The tokens a request leaves in the cache: its prompt, then its answer when known."""
    if r.output_ids is None or not len(r.output_ids):
        return r.input_ids
    return np.concatenate([r.input_ids, r.output_ids])


def unique_tokens(trace: Sequence[TraceRequest]) -> int:
    """Tokens on the edges of the prefix tree of everything the trace serves."""
    return infinite_cache(trace)[1]


def infinite_cache_bound(trace: Sequence[TraceRequest], page_size: int = 1) -> float:
    """The token hit rate of a cache that never evicts, in arrival order."""
    return infinite_cache(trace, page_size)[0]


def infinite_cache(trace: Sequence[TraceRequest], page_size: int = 1) -> tuple[float, int]:
    """(hit rate, unique tokens) of an infinite cache serving `trace` in arrival order."""
    allocator = TokenToKVPoolAllocator(sum(len(served_sequence(r)) for r in trace) + 1)
    cache = RadixCache(allocator, page_size)
    hits = prompt_tokens = 0
    for r in trace:
        hits += cache.peek_prefix(r.input_ids)
        prompt_tokens += len(r.input_ids)
        seq = served_sequence(r)
        slots = allocator.alloc(len(seq))
        cached = cache.insert(seq, slots)
        aligned = len(seq) - len(seq) % page_size
        allocator.free(np.concatenate([slots[:cached], slots[aligned:]]))
    return (hits / prompt_tokens if prompt_tokens else 0.0), cache.total_size()


class BeladyPolicy:
    """Evict the leaf whose next use is furthest in the future (offline; reads the trace)."""

    name = "belady"
    tracks_access = True

    def __init__(
        self, trace: Sequence[TraceRequest], page_size: int = 1, *, whole_prompt: bool = False
    ) -> None:
        self.page_size = page_size
        self._index = {r.rid: i for i, r in enumerate(trace)}
        self._uses: dict[bytes, list[int]] = {}
        # The scheduler matches all but the last token, so only those pages can be reached;
        # a pure cache simulation reuses whole prompts.
        cut = 0 if whole_prompt else 1
        for i, r in enumerate(trace):
            for digest in hash_pages(r.input_ids[: len(r.input_ids) - cut], page_size):
                self._uses.setdefault(digest, []).append(i)
        self._cursor: dict[bytes, int] = {}
        self._used = np.zeros(len(trace), dtype=bool)
        self.cache: RadixCache | None = None

    def bind(self, cache: RadixCache) -> None:
        """Attach the cache whose nodes this policy ranks (before anything is inserted)."""
        self.cache = cache

    def on_admit(self, req: Req) -> None:
        """The scheduler admitted `req`: its use of the nodes on its path has happened."""
        index = self._index.get(req.rid)
        if index is None or self._used[index]:
            return
        self._used[index] = True
        if req.last_node is not None:
            self.cache.refresh_eviction_key(req.last_node)

    def next_use(self, digest: bytes) -> float:
        uses = self._uses.get(digest)
        if uses is None:
            return math.inf
        at = self._cursor.get(digest, 0)
        while at < len(uses) and self._used[uses[at]]:
            at += 1
        self._cursor[digest] = at
        return uses[at] if at < len(uses) else math.inf

    def key(self, node: TreeNode) -> tuple[float, int]:
        depth, walker = 0, node
        while walker.parent is not None:
            depth += len(walker)
            walker = walker.parent
        return (-self.next_use(self.cache.page_hashes(node)[0]), -depth)
