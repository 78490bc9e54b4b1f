"""The host tier's store: whole page chains in RAM, evicted by the device tree's policies,
last pages first, so that what stays is always reachable from a chain's head."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.cache.hashing import hash_pages
from radixserve.cache.storage import StorageIdentity
from radixserve.cache.storage.host import HostStorage
from radixserve.cache.tiers import StorageTier
from radixserve.errors import InvalidArgumentError

PAGE = 4
IDENTITY = StorageIdentity("tiny", "float32", "width=1", PAGE)
PAGE_BYTES = 8


def chain(seed: int, pages: int) -> list[bytes]:
    return hash_pages(np.arange(pages * PAGE) + 1000 * seed, PAGE)


def payloads(hashes) -> list[bytes]:
    return [h[:PAGE_BYTES] for h in hashes]


def host(pages: int, policy: str = "lru") -> HostStorage:
    return HostStorage(IDENTITY, max_bytes=pages * PAGE_BYTES, eviction_policy=policy)


def test_pages_round_trip_and_sizes_add_up():
    store = host(8)
    a = chain(1, 5)
    assert store.set(a, payloads(a)) == 5
    assert store.exists(a) == 5 and store.get(a) == payloads(a)
    assert store.chain_exists(a, 2) == 3 and store.chain_get(a, 2) == payloads(a)[2:]
    assert len(store) == 5 and store.size_bytes() == 5 * PAGE_BYTES
    store.check_invariants()
    assert store.clear() == 5 and store.exists(a) == 0
    store.check_invariants()


def test_eviction_takes_the_last_pages_of_a_chain_first():
    """A flat LRU of pages drops a chain's head first (it was written first), which leaves
    its tail stored but unreachable. The tree drops leaves (whole, as they were stored), so
    what stays still loads."""
    store = host(6)
    a, b = chain(1, 4), chain(2, 4)
    store.set(a[:2], payloads(a)[:2])
    store.chain_set(a, 2, payloads(a)[2:])
    store.set(b, payloads(b))
    assert store.exists(b) == 4
    assert store.exists(a) == 2 and store.get(a) == payloads(a)[:2]
    assert len(store) == 6 and store.stats.evicted == 2
    store.check_invariants()


@pytest.mark.parametrize(("policy", "kept"), [("lru", 0), ("lfu", 2), ("fifo", 0)])
def test_each_policy_orders_the_host_tier(policy, kept):
    """A chain read three times, then two newer chains: LFU keeps it, LRU and FIFO do not."""
    store = host(4, policy)
    hot = chain(0, 2)
    store.set(hot, payloads(hot))
    for _ in range(3):
        assert store.get(hot) == payloads(hot)
    for seed in (1, 2):
        c = chain(seed, 2)
        store.set(c, payloads(c))
    assert store.exists(hot) == kept
    store.check_invariants()


def test_a_run_stored_without_its_head_joins_up_when_the_head_comes():
    """The device may still hold a chain's head: its tail is stored alone, found behind
    that head, and read as one chain once the head is stored too."""
    store = host(8)
    a = chain(1, 4)
    assert store.chain_set(a, 2, payloads(a)[2:]) == 2
    assert store.exists(a) == 0 and store.chain_exists(a, 2) == 2
    assert store.chain_get(a, 2) == payloads(a)[2:]
    store.set(a[:2], payloads(a)[:2])
    assert store.exists(a) == 4 and store.get(a) == payloads(a)
    assert store.chain_exists(a, 1) == 3 and store.chain_get(a, 1) == payloads(a)[1:]
    b = chain(2, 3)
    store.set(b[:1], payloads(b)[:1])
    assert store.chain_set(b, 2, payloads(b)[2:]) == 1  # a gap at page 1
    assert store.exists(b) == 1 and store.chain_exists(b, 2) == 1
    store.check_invariants()


def test_a_chain_longer_than_the_cap_keeps_its_leading_pages():
    store = host(3)
    a = chain(1, 5)
    assert store.set(a, payloads(a)) == 3
    assert store.exists(a) == 3
    store.check_invariants()


def test_two_hashes_sharing_an_id_read_as_a_miss_not_as_each_other():
    store = host(4)
    mine = hashlib.sha256(b"mine").digest()
    twin = mine[:8] + hashlib.sha256(b"twin").digest()[8:]
    store.set([mine], [b"m" * PAGE_BYTES])
    assert store.get([twin]) == []
    assert store.get([mine]) == [b"m" * PAGE_BYTES]


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError, match="eviction_policy must be one of"):
        host(4, "no-such-policy")
    with pytest.raises(InvalidArgumentError, match="size"):
        HostStorage(IDENTITY, max_bytes=0)
    store = host(4)
    a = chain(1, 2)
    with pytest.raises(InvalidArgumentError, match="one payload per page"):
        store.set(a, payloads(a)[:1])
    store.set(a[:1], [b"x" * PAGE_BYTES])
    with pytest.raises(InvalidArgumentError, match="same size"):
        store.chain_set(a, 1, [b"short"])


def test_write_back_stores_only_what_the_device_evicted_and_the_runs_join():
    """A leaf evicted before its parent: only its pages go to the host (the device still
    holds the parent's); when the parent is evicted too, the whole prefix loads back."""

    class Copier:
        def __init__(self) -> None:
            self.pool = np.zeros(65)

        def export(self, slots) -> bytes:
            return self.pool[slots].tobytes()

        def load(self, slots, payload: bytes) -> None:
            self.pool[slots] = np.frombuffer(payload)

    cache = RadixCache(TokenToKVPoolAllocator(64))
    copier = Copier()
    store = HostStorage(IDENTITY, max_bytes=32 * PAGE * 8)
    tier = StorageTier(cache, store, copier, PAGE)
    cache.evict_listener = lambda node: tier.store(tier.plan_evicted(node))
    shared, tail = np.arange(1, 9), np.arange(100, 108)
    for key in (shared, np.concatenate([shared, tail])):
        match = cache.match_prefix(key)
        slots = cache.allocator.alloc(len(key) - match.prefix_len)
        copier.pool[slots] = key[match.prefix_len :]
        cache.insert(key, np.concatenate([match.indices, slots]))
    cache.evict(8)  # only the tail leaves the device
    full = np.concatenate([shared, tail])
    hashes = hash_pages(full, PAGE)
    assert store.exists(hashes) == 0 and store.chain_exists(hashes, 2) == 2 and len(store) == 2
    plan = tier.plan_load(full)
    assert tier.admit(plan, tier.fetch(plan)) == 8  # behind the device's head
    cache.evict(16)
    assert store.exists(hashes) == 4 and len(store) == 4
    assert cache.total_size() == 0
    plan = tier.plan_load(full)
    assert tier.admit(plan, tier.fetch(plan)) == 16
    assert np.array_equal(copier.pool[cache.match_prefix(full).indices], full)
    cache.check_invariants()
    store.check_invariants()
