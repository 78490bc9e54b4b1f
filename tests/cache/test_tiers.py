"""The storage tier: a finished prefix goes to storage page by page, and a later tree (another
process, after a restart) loads it back as an ordinary cached prefix, all of it or none, with
no slot leaked whatever happens in between."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache import PagedTokenToKVPoolAllocator, RadixCache, TokenToKVPoolAllocator
from radixserve.cache.hashing import hash_pages
from radixserve.cache.storage import StorageIdentity, open_storage
from radixserve.cache.tiers import StorageTier
from radixserve.errors import InvalidArgumentError

PAGE = 4
IDENTITY = StorageIdentity("tiny", "float32", "width=3", PAGE)


class ArrayCopier:
    """A KV pool stand-in: one row of floats per slot."""

    def __init__(self, slots: int) -> None:
        self.pool = np.zeros((slots + 1, 3), dtype=np.float32)

    def export(self, slots) -> bytes:
        return self.pool[slots].tobytes()

    def load(self, slots, payload: bytes) -> None:
        self.pool[slots] = np.frombuffer(payload, dtype=np.float32).reshape(len(slots), 3)


def make(tmp_path, slots: int = 64):
    cache = RadixCache(TokenToKVPoolAllocator(slots))
    copier = ArrayCopier(slots)
    storage = open_storage(f"file:{tmp_path}", IDENTITY)
    return cache, copier, StorageTier(cache, storage, copier, PAGE)


def compute(cache: RadixCache, copier: ArrayCopier, key, extra_key=None) -> None:
    """What a request does: KV for every token (here its id), then the tree takes the pages."""
    slots = cache.allocator.alloc(len(key))
    copier.pool[slots] = np.asarray(key, dtype=np.float32)[:, None]
    before = cache.insert(np.asarray(key, dtype=np.int32), slots, extra_key=extra_key)
    cache.allocator.free(slots[:before])


def write(tmp_path, key, extra_key=None) -> None:
    """What one process leaves in storage: `key`'s pages, computed and written through."""
    cache, copier, tier = make(tmp_path)
    compute(cache, copier, key, extra_key)
    tier.store(tier.plan_store(key, extra_key))


def check(cache: RadixCache) -> None:
    cache.check_invariants()
    allocator = cache.allocator
    assert allocator.available_size() + cache.total_size() == allocator.size


def kv_of(cache: RadixCache, copier: ArrayCopier, key, extra_key=None) -> np.ndarray:
    match = cache.match_prefix(np.asarray(key, dtype=np.int32), extra_key)
    return copier.pool[match.indices, 0]


def round_trip(tier: StorageTier, key, extra_key=None) -> int:
    plan = tier.plan_load(key, extra_key)
    return 0 if plan is None else tier.admit(plan, tier.fetch(plan))


def test_a_prefix_written_by_one_tree_loads_into_another(tmp_path):
    key = list(range(10, 24))  # 3 whole pages and 2 tokens
    cache, copier, tier = make(tmp_path)
    compute(cache, copier, key)
    assert tier.store(tier.plan_store(key)) == 3
    assert tier.store(tier.plan_store(key)) == 0  # already stored: nothing copied out again
    fresh, fresh_copier, fresh_tier = make(tmp_path)  # a restart
    assert round_trip(fresh_tier, [*key, 99]) == 12
    assert list(kv_of(fresh, fresh_copier, key)) == key[:12]
    check(fresh)
    assert round_trip(fresh_tier, key) == 0  # the tree holds it now: no plan worth reading


def test_only_the_pages_past_the_trees_prefix_are_loaded(tmp_path):
    key = list(range(40, 56))
    write(tmp_path, key)
    fresh, fresh_copier, fresh_tier = make(tmp_path)
    compute(fresh, fresh_copier, key[:5])  # a page and a bit of its own
    plan = fresh_tier.plan_load(key)
    assert plan.first == 1
    assert fresh_tier.admit(plan, fresh_tier.fetch(plan)) == 11  # token 5 was there
    assert list(kv_of(fresh, fresh_copier, key)) == key
    check(fresh)


def test_tenants_load_only_their_own_pages(tmp_path):
    key = list(range(100, 112))
    write(tmp_path, key, "tenant-a")
    fresh, _, fresh_tier = make(tmp_path)
    assert round_trip(fresh_tier, key, "tenant-b") == 0
    assert round_trip(fresh_tier, key) == 0
    assert round_trip(fresh_tier, key, "tenant-a") == 12
    check(fresh)


def test_no_room_loads_nothing_and_leaks_nothing(tmp_path):
    key = list(range(200, 216))
    write(tmp_path, key)
    small, small_copier, small_tier = make(tmp_path, slots=16)
    held = list(range(500, 516))
    compute(small, small_copier, held)
    node = small.match_prefix(np.asarray(held, dtype=np.int32)).last_node
    small.inc_lock_ref(node)  # a running request holds the whole pool
    assert round_trip(small_tier, key) == 0
    check(small)
    small.dec_lock_ref(node)
    assert round_trip(small_tier, key) == 16  # the unlocked prefix is evicted to make room
    check(small)


def test_pages_the_tree_gained_meanwhile_are_not_leaked(tmp_path):
    key = list(range(300, 312))
    write(tmp_path, key)
    fresh, fresh_copier, fresh_tier = make(tmp_path)
    plan = fresh_tier.plan_load(key)
    payloads = fresh_tier.fetch(plan)
    compute(fresh, fresh_copier, key[:8])  # a request computed two pages during the read
    assert fresh_tier.admit(plan, payloads) == 4
    check(fresh)
    assert list(kv_of(fresh, fresh_copier, key)) == key


def test_a_damaged_page_ends_the_load_there(tmp_path):
    key = list(range(400, 416))
    write(tmp_path, key)
    pages = hash_pages(np.asarray(key), PAGE)
    [third] = [p for p in tmp_path.rglob("*.kv") if p.stem == pages[2].hex()]
    third.write_bytes(b"junk")
    fresh, _, fresh_tier = make(tmp_path)
    assert round_trip(fresh_tier, key) == 8  # the two intact pages before it
    check(fresh)


def test_a_tiered_match_reports_each_tiers_length(tmp_path):
    from radixserve.cache.storage.host import HostStorage
    from radixserve.cache.tiers import TieredCache

    key = list(range(1, 41))  # ten pages
    write(tmp_path, key)
    cache, copier, storage = make(tmp_path)
    host = StorageTier(cache, HostStorage(IDENTITY, max_bytes=1 << 20), copier, PAGE)
    tiers = TieredCache(cache, host, storage)
    compute(cache, copier, key[:10])  # the device: two whole pages and two tokens
    assert tiers.match_prefix(key) == (10, 0, 0)  # storage unknown to this process
    assert tiers.match_prefix(key, probe_storage=True) == (10, 0, 30)  # to a page's end
    compute(cache, copier, key[:24])
    host.store(host.plan_store(key[:24]))
    cache.evict(cache.total_size())
    compute(cache, copier, key[:8])
    match = tiers.match_prefix(key, probe_storage=True)
    assert match == (8, 16, 16) and match.total == 40
    assert tiers.match_prefix(key, extra_key="tenant", probe_storage=True) == (0, 0, 0)
    check(cache)


def test_the_storage_page_must_be_a_multiple_of_the_trees(tmp_path):
    cache = RadixCache(PagedTokenToKVPoolAllocator(16, page_size=4), page_size=4)
    storage = open_storage(f"file:{tmp_path}", IDENTITY)
    with pytest.raises(InvalidArgumentError, match="multiple"):
        StorageTier(cache, storage, ArrayCopier(16), 6)


def test_writing_without_probing_storage_skips_what_it_knows(tmp_path):
    key = list(range(600, 612))
    cache, copier, tier = make(tmp_path)
    compute(cache, copier, key)
    assert tier.store(tier.plan_store(key, probe=False)) == 3
    assert tier.plan_store(key, probe=False).hashes == []  # known: nothing copied out
    other, other_copier, other_tier = make(tmp_path)  # another process: it knows nothing yet
    compute(other, other_copier, key)
    plan = other_tier.plan_store(key, probe=False)
    assert len(plan.hashes) == 3
    written = other_tier.storage.stats.stored
    assert other_tier.store(plan) == 3 and other_tier.storage.stats.stored == written
    assert other_tier.plan_store(key, probe=False).hashes == []


def test_after_a_clear_the_tier_writes_its_pages_again(tmp_path):
    """Regression: a cleared store left the pages in the tier's memory of what it stored, so
    writes that skip probing storage never wrote them again."""
    key = list(range(700, 712))
    cache, copier, tier = make(tmp_path)
    compute(cache, copier, key)
    assert tier.store(tier.plan_store(key, probe=False)) == 3
    assert tier.clear() == 3
    assert tier.storage.exists(hash_pages(key, PAGE)) == 0
    assert tier.store(tier.plan_store(key, probe=False)) == 3
    assert tier.storage.exists(hash_pages(key, PAGE)) == 3
