"""Shared helpers for the cache tests: a manual clock and a caller that inserts like an engine."""

from __future__ import annotations

import numpy as np

from radixserve.cache import RadixCache
from radixserve.sim.traces import TraceRequest
from radixserve.sim.workloads import make_workload


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


def serve_random_prompt(cache: RadixCache, rng: np.random.Generator, i: int) -> None:
    """One request of a churn over shared and random prefixes: evict for it, match it, cache
    it, and check the tree's invariants."""
    base = [7, 7, 7] if rng.random() < 0.5 else [int(rng.integers(1, 50))]
    prompt = [*base, *rng.integers(0, 40, int(rng.integers(1, 12))), i % 7]
    short = len(prompt) - cache.allocator.available_size()
    if short > 0:
        cache.evict(short)
    cache.match_prefix(tokens(prompt))
    cache_sequence(cache, prompt)
    cache.check_invariants()


def trace_of(prompts) -> list[TraceRequest]:
    """One trace request per prompt, in order, with no answer."""
    return [
        TraceRequest(f"r{i}", float(i), np.asarray(p, dtype=np.int32), 0)
        for i, p in enumerate(prompts)
    ]


def hot_and_scan(n: int = 3_000, seed: int = 0) -> list[TraceRequest]:
    """Ten hot prompts reused all the time, between one-off prompts: frequency pays, LRU loses."""
    rng = np.random.default_rng(seed)
    hot = [rng.integers(0, 30_000, 64) for _ in range(10)]
    prompts = []
    for i in range(n):
        if rng.random() < 0.4:
            prompts.append(hot[rng.integers(10)])
        else:
            prompts.append(rng.integers(30_000, 2**30, 64) + i)
    return trace_of(prompts)


def chat_sessions(n_sessions: int = 300, seed: int = 0) -> list[TraceRequest]:
    """Sessions that come back soon and then end: recency pays, frequency does not."""
    return make_workload(
        "multi-turn-random", num_sessions=n_sessions, turns=6, system_len=64, seed=seed
    )
