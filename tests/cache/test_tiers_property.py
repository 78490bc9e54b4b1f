"""Property test of the device and host tiers together: whatever sequence of requests,
evictions, write-throughs, write-backs and loads happens, every device slot is free or in the
tree exactly once, the host tier's sizes add up and stay under its cap, and every cached
token's KV, on either tier, is that token's own (the stand-in KV of a token is its id)."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.cache.hashing import hash_pages
from radixserve.cache.storage import StorageIdentity
from radixserve.cache.storage.host import HostStorage
from radixserve.cache.tiers import StorageTier

PAGE, SLOTS = 4, 32
IDENTITY = StorageIdentity("tiny", "float32", "width=1", PAGE)


class TokenCopier:
    def __init__(self) -> None:
        self.pool = np.full(SLOTS + 1, -1.0, dtype=np.float64)

    def export(self, slots) -> bytes:
        return self.pool[slots].tobytes()

    def load(self, slots, payload: bytes) -> None:
        self.pool[slots] = np.frombuffer(payload, dtype=np.float64)


# Shared prefixes (three bases, cut anywhere) with their own tails: deep paths whose pages
# all differ, so a page copied from the wrong depth shows.
BASES = [[(7 * i + 3 * b) % 9 + 1 for i in range(20)] for b in range(3)]
prompts = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, 2),
    st.integers(0, 20),
    st.lists(st.integers(1, 9), max_size=6),
).filter(bool)


class Tiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(TokenToKVPoolAllocator(SLOTS))
        self.copier = TokenCopier()
        self.host = HostStorage(IDENTITY, max_bytes=12 * PAGE * 8)  # 12 pages
        self.tier = StorageTier(self.cache, self.host, self.copier, PAGE)
        self.write_back = False
        self.page_tokens: dict[bytes, np.ndarray] = {}  # every page hash seen -> its tokens

    @initialize(policy=st.sampled_from(["lru", "lfu", "fifo", "mru", "slru", "wgd", "adaptive"]))
    def host_policy(self, policy):
        self.host = HostStorage(IDENTITY, max_bytes=12 * PAGE * 8, eviction_policy=policy)
        self.tier = StorageTier(self.cache, self.host, self.copier, PAGE)

    @rule(write_back=st.booleans())
    def policy(self, write_back):
        self.write_back = write_back
        tier = self.tier
        self.cache.evict_listener = (
            (lambda node: tier.store(tier.plan_evicted(node))) if write_back else None
        )

    @rule(key=prompts)
    def request(self, key):
        """Load what the host holds, compute the rest, give it to the tree, write through."""
        ids = np.asarray(key, dtype=np.int32)
        for k, h in enumerate(hash_pages(ids[: len(ids) - len(ids) % PAGE], PAGE)):
            self.page_tokens[h] = ids[k * PAGE : (k + 1) * PAGE]
        plan = self.tier.plan_load(ids)
        if plan is not None:
            self.tier.admit(plan, self.tier.fetch(plan))
        match = self.cache.match_prefix(ids)
        self.cache.inc_lock_ref(match.last_node)
        need = len(ids) - match.prefix_len
        short = need - self.cache.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
        slots = self.cache.allocator.alloc(need) if need else np.empty(0, dtype=np.int64)
        if slots is None:
            self.cache.dec_lock_ref(match.last_node)
            return  # the pool is too small for this one: it would wait
        self.copier.pool[slots] = ids[match.prefix_len :]
        value = np.concatenate([match.indices, slots])
        before = self.cache.insert(ids, value)
        self.cache.dec_lock_ref(match.last_node)
        if before > match.prefix_len:
            self.cache.allocator.free(value[match.prefix_len : before])
        if not self.write_back:
            self.tier.store(self.tier.plan_store(ids))

    @rule(tokens=st.integers(1, SLOTS))
    def evict(self, tokens):
        self.cache.evict(tokens)

    @invariant()
    def slots_are_free_or_in_the_tree_once(self):
        self.cache.check_invariants()
        allocator = self.cache.allocator
        assert allocator.available_size() + self.cache.total_size() == allocator.size

    @invariant()
    def host_sizes_add_up_under_the_cap(self):
        self.host.check_invariants()
        assert self.host.size_bytes() == sum(len(p) for _, p in self.host.items())
        assert self.host.size_bytes() <= self.host.max_bytes

    @invariant()
    def every_cached_token_holds_its_own_kv(self):
        for node in self.cache._nodes():
            if node.parent is not None:
                assert np.array_equal(self.copier.pool[node.value], node.token_ids)
        for h, payload in self.host.items():
            assert np.array_equal(np.frombuffer(payload, dtype=np.float64), self.page_tokens[h])


Tiers.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestTiers = Tiers.TestCase
