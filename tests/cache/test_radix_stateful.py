"""A hypothesis state machine drives RadixCache against a naive reference model.

The reference is the set of cached whole-page prefixes (per namespace), each mapped to the slots
of its last page. Insert adds every page-aligned prefix of the key; eviction must remove only
unlocked prefixes, leave a prefix-closed set, free what it reports, and free at least what was
asked unless nothing unlocked is left. After every step the cache's invariants hold, every slot
is in the tree or free, and the sizes equal the reference's.
"""

from __future__ import annotations

import numpy as np
from cache_helpers import ManualClock
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import (
    PagedTokenToKVPoolAllocator,
    RadixCache,
    TokenToKVPoolAllocator,
    available_eviction_policies,
    pool_check,
)

NAMESPACES = (None, "ns")
POOL_PAGES = 14


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        page = self.page_size
        # Chunks share whole pages and also diverge inside the last token of a page.
        self.chunks = [[c] * page for c in (1, 2, 3)] + [[c] * (page - 1) + [9] for c in (1, 2)]
        allocator = (
            TokenToKVPoolAllocator(POOL_PAGES)
            if page == 1
            else PagedTokenToKVPoolAllocator(POOL_PAGES * page, page)
        )
        self.clock = ManualClock()
        self.cache = RadixCache(
            allocator, page_size=page, eviction_policy=self.policy, clock=self.clock
        )
        self.ref: dict[tuple, np.ndarray] = {}  # (namespace, prefix tokens) -> last page's slots
        self.locks: list[tuple] = []  # (node, namespace, prefix tokens)

    # -- reference helpers -----------------------------------------------------------------

    def build_key(self, choice: list[int], tail: list[int]) -> list[int]:
        key = [t for i in choice for t in self.chunks[i]]
        return key + tail[: self.page_size - 1]

    def ref_match(self, ns, key) -> tuple[int, list[np.ndarray]]:
        page, n, slots = self.page_size, 0, []
        while n + page <= len(key) and (ns, tuple(key[: n + page])) in self.ref:
            n += page
            slots.append(self.ref[(ns, tuple(key[:n]))])
        return n, slots

    def locked_prefixes(self) -> set[tuple]:
        held = set()
        for _, ns, prefix in self.locks:
            for n in range(self.page_size, len(prefix) + 1, self.page_size):
                held.add((ns, prefix[:n]))
        return held

    def evict(self, num_tokens: int) -> int:
        before = set(self.ref)
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(num_tokens)
        for ns, prefix in before:
            if self.cache.peek_prefix(list(prefix), extra_key=ns) < len(prefix):
                del self.ref[(ns, prefix)]
        removed = before - set(self.ref)
        assert freed == self.page_size * len(removed)
        assert not removed & self.locked_prefixes(), "a locked prefix was evicted"
        for ns, prefix in self.ref:
            if len(prefix) > self.page_size:
                assert (ns, prefix[: -self.page_size]) in self.ref, "not prefix-closed"
        if num_tokens > 0:
            assert freed >= min(num_tokens, evictable) or self.cache.evictable_size() == 0
            if freed < num_tokens:
                assert self.cache.evictable_size() == 0
        return freed

    # -- rules -----------------------------------------------------------------------------

    keys = st.lists(st.integers(0, 4), max_size=5)
    tails = st.lists(st.integers(1, 5), max_size=15)

    @rule(choice=keys, tail=tails, ns=st.sampled_from(NAMESPACES), priority=st.integers(0, 3))
    def insert(self, choice, tail, ns, priority):
        key = self.build_key(choice, tail)
        page = self.cache.allocator.page_size
        need = -(-len(key) // page) * page
        short = need - self.cache.allocator.available_size()
        if short > 0:
            self.evict(short)
        slots = self.cache.allocator.alloc(need)
        if slots is None:
            return
        expected, _ = self.ref_match(ns, key)
        cached = self.cache.insert(
            np.array(key, dtype=np.int32), slots[: len(key)], priority=priority, extra_key=ns
        )
        assert cached == expected
        aligned = len(key) - len(key) % self.page_size
        for n in range(cached + self.page_size, aligned + 1, self.page_size):
            self.ref[(ns, tuple(key[:n]))] = slots[n - self.page_size : n].copy()
        leftovers = np.concatenate([slots[:cached], slots[aligned:]])
        if leftovers.size:
            self.cache.allocator.free(leftovers)

    @rule(choice=keys, tail=tails, ns=st.sampled_from(NAMESPACES), lock=st.booleans())
    def match(self, choice, tail, ns, lock):
        key = self.build_key(choice, tail)
        expected, slots = self.ref_match(ns, key)
        assert self.cache.peek_prefix(key, extra_key=ns) == expected
        result = self.cache.match_prefix(key, extra_key=ns)
        assert result.prefix_len == expected
        want = np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)
        np.testing.assert_array_equal(result.indices, want)
        if lock and expected:
            protected = self.cache.protected_size()
            delta = self.cache.inc_lock_ref(result.last_node)
            assert self.cache.protected_size() == protected - delta
            self.locks.append((result.last_node, ns, tuple(key[:expected])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        evictable = self.cache.evictable_size()
        delta = self.cache.dec_lock_ref(node)
        assert self.cache.evictable_size() == evictable + delta

    @rule(num_tokens=st.integers(-1, 3 * POOL_PAGES))
    def evict_some(self, num_tokens):
        self.evict(num_tokens * self.page_size)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0]))
    def tick(self, dt):
        self.clock.advance(dt)

    @precondition(lambda self: self.policy == "adaptive")
    @rule(expert=st.sampled_from(["wgd", "lfu", "lru"]), plain=st.booleans())
    def follow(self, expert, plain):
        # adaptive switches by itself only after thousands of references: here, by hand, with
        # its base expert's floor (plain recency) on or off, so every ranking meets every rule.
        policy = self.cache.policy
        if plain != policy.plain:
            policy._set_plain(plain)
        policy.follow(expert)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.ref.clear()

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def bookkeeping_is_exact(self):
        self.cache.check_invariants()
        pool_check(self.cache)
        assert self.cache.total_size() == self.page_size * len(self.ref)
        assert self.cache.protected_size() == self.page_size * len(self.locked_prefixes())


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

for _page in (1, 2, 16):
    for _policy in available_eviction_policies():
        _name = f"CacheMachine_{_policy}_page{_page}"
        _machine = type(_name, (CacheMachine,), {"page_size": _page, "policy": _policy})
        _machine.TestCase.settings = SETTINGS
        globals()[f"Test{_name}"] = _machine.TestCase
