"""Shared helpers for the cache tests: a manual clock and a caller that inserts like an engine."""

from __future__ import annotations

import numpy as np

from radixserve.cache import RadixCache


class ManualClock:
    """A clock that moves only when told to, so access-time orderings are exact."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float = 1.0) -> float:
        self.now += dt
        return self.now


def tokens(seq) -> np.ndarray:
    """Token ids as int32: strings map one character to one token."""
    if isinstance(seq, str):
        return np.array([ord(ch) for ch in seq], dtype=np.int32)
    return np.asarray(seq, dtype=np.int32)


def cache_sequence(cache: RadixCache, seq, priority: float = 0, extra_key=None) -> int:
    """Allocate slots for `seq`, insert it, and free what the tree did not take, as an engine does.

    Returns insert()'s result: the number of tokens that were already cached.
    """
    key = tokens(seq)
    page = cache.allocator.page_size
    need = -(-len(key) // page) * page
    slots = cache.allocator.alloc(need)
    if slots is None:
        cache.evict(need - cache.allocator.available_size())
        slots = cache.allocator.alloc(need)
    assert slots is not None, "pool too small for the test"
    cached = cache.insert(key, slots[: len(key)], priority=priority, extra_key=extra_key)
    aligned = len(key) - len(key) % cache.page_size
    leftovers = np.concatenate([slots[:cached], slots[aligned:]])
    if leftovers.size:
        cache.allocator.free(leftovers)
    return cached
