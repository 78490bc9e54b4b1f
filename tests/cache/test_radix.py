"""RadixCache: the rules of match_prefix, insert, evict, locking, namespaces and invariants."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from cache_helpers import ManualClock, cache_sequence, tokens

from radixserve.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PagedTokenToKVPoolAllocator,
    RadixCache,
    TokenToKVPoolAllocator,
    pool_check,
)
from radixserve.errors import CacheInvariantError, InvalidArgumentError, LockError


def make_cache(size=1024, page_size=1, **kwargs) -> RadixCache:
    allocator = (
        TokenToKVPoolAllocator(size)
        if page_size == 1
        else PagedTokenToKVPoolAllocator(size, page_size)
    )
    kwargs.setdefault("clock", ManualClock())
    return RadixCache(allocator, page_size=page_size, **kwargs)


def check(cache: RadixCache) -> None:
    cache.check_invariants()
    pool_check(cache)


# -- match and insert -----------------------------------------------------------------------


def test_hello_example_matches_only_the_shared_characters():
    cache = make_cache()
    assert cache_sequence(cache, "Hello_L.A.!") == 0
    assert cache_sequence(cache, "Hello_L.A.!world") == len("Hello_L.A.!")
    result = cache.match_prefix(tokens("Hello_world"))
    assert result.prefix_len == 6
    assert len(result.indices) == 6
    assert cache.total_size() == len("Hello_L.A.!world")
    check(cache)


def test_mid_edge_match_splits_and_returns_the_first_sequence_values():
    cache = make_cache()
    first = np.arange(1, 9, dtype=np.int32)
    slots_first = cache.allocator.alloc(8)
    assert cache.insert(first, slots_first) == 0
    slots_second = cache.allocator.alloc(4)
    assert cache.insert([1, 2, 9, 10], slots_second) == 2
    cache.allocator.free(slots_second[:2])
    assert cache.total_size() == 10
    nodes_before = len(cache._nodes())
    result = cache.match_prefix([1, 2, 3, 4, 999, 1000])
    assert result.prefix_len == 4
    np.testing.assert_array_equal(result.indices, slots_first[:4])
    assert cache.total_size() == 10
    assert len(cache._nodes()) == nodes_before + 1
    assert len(result.last_node) == 2, "last_node ends exactly at the match"
    check(cache)


def test_split_upper_node_inherits_lock_priority_hits_and_hashes():
    cache = make_cache(page_size=1, enable_kv_events=True)
    cache_sequence(cache, [5, 6, 7, 8], priority=3)
    node = cache.match_prefix([5, 6, 7, 8]).last_node
    cache.inc_lock_ref(node)
    hashes_before = list(cache.page_hashes(node))
    hits_before = node.hit_count
    result = cache.match_prefix([5, 6, 0])
    upper = result.last_node
    assert upper is node.parent and len(upper) == 2 and len(node) == 2
    assert upper.lock_ref == node.lock_ref == 1
    assert upper.priority == 3
    assert upper.hit_count == hits_before + 1, "inherits, then counts this hit"
    assert node.hit_count == hits_before, "the part below the match was not reached"
    assert cache.page_hashes(upper) + cache.page_hashes(node) == hashes_before
    cache.dec_lock_ref(node)
    check(cache)


def test_match_reads_the_clock_once_and_refreshes_the_whole_path():
    calls = []
    clock = ManualClock()

    def counting_clock():
        calls.append(1)
        return clock()

    cache = make_cache(clock=counting_clock)
    cache_sequence(cache, "abcdef")
    cache_sequence(cache, "abcxyz")
    cache_sequence(cache, "abcxyz12")
    clock.advance(10)
    calls.clear()
    result = cache.match_prefix(tokens("abcxyz12"))
    assert len(calls) == 1
    node, path = result.last_node, []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    assert len(path) == 3
    assert all(n.last_access_time == 10 for n in path)
    assert cache.match_prefix(tokens("abcdef")).last_node.last_access_time == 10


def test_hit_count_counts_every_node_reached():
    cache = make_cache()
    cache_sequence(cache, "aaaa")
    cache_sequence(cache, "aaaabb")
    deep = cache.match_prefix(tokens("aaaabb")).last_node
    top = deep.parent
    assert (top.hit_count, deep.hit_count) == (1, 1)
    cache.match_prefix(tokens("aaaazz"))
    assert (top.hit_count, deep.hit_count) == (2, 1)
    cache.match_prefix(tokens("zzz"))
    assert (top.hit_count, deep.hit_count) == (2, 1)


def test_match_without_count_hit_refreshes_but_does_not_count():
    clock = ManualClock()
    cache = make_cache(clock=clock)
    cache_sequence(cache, "abcd")
    clock.advance()
    node = cache.match_prefix(tokens("abcd"), count_hit=False).last_node
    assert (node.hit_count, node.last_access_time) == (0, clock.now)
    check(cache)


def test_peek_prefix_changes_nothing():
    clock = ManualClock()
    cache = make_cache(clock=clock)
    cache_sequence(cache, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    clock.advance(5)
    before = (len(cache._nodes()), node.hit_count, node.last_access_time, list(cache._heap))
    assert cache.peek_prefix([1, 2, 3, 9]) == 3
    assert cache.peek_prefix([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.peek_prefix([7]) == 0
    after = (len(cache._nodes()), node.hit_count, node.last_access_time, list(cache._heap))
    assert before == after


def test_insert_returns_cached_prefix_and_max_propagates_priority():
    cache = make_cache()
    assert cache_sequence(cache, [1, 2, 3], priority=1) == 0
    assert cache_sequence(cache, [1, 2, 3, 4], priority=5) == 3
    assert cache_sequence(cache, [1, 2, 7], priority=2) == 2
    leaf4 = cache.match_prefix([1, 2, 3, 4]).last_node
    leaf7 = cache.match_prefix([1, 2, 7]).last_node
    node3 = leaf4.parent
    node12 = node3.parent
    assert (node12.priority, node3.priority, leaf4.priority, leaf7.priority) == (5, 5, 5, 2)
    assert cache_sequence(cache, [1, 2, 3, 4]) == 4
    assert leaf4.priority == 5, "max-propagation never lowers a priority"
    check(cache)


def test_new_nodes_join_the_evictable_set():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3])
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    cache_sequence(cache, [1, 2, 3, 4, 5])
    assert cache.evictable_size() == 5
    check(cache)


def test_short_key_matches_nothing_and_inserts_nothing():
    cache = make_cache(page_size=4, size=64)
    assert cache_sequence(cache, [1, 2, 3]) == 0
    assert cache.total_size() == 0
    cache_sequence(cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    assert cache.peek_prefix([1, 2, 3]) == 0
    check(cache)


@pytest.mark.parametrize("page_size", [2, 4])
def test_paged_matches_and_inserts_are_page_aligned(page_size):
    cache = make_cache(size=256, page_size=page_size)
    seq = list(range(1, 12))
    cache_sequence(cache, seq)
    aligned = 11 - 11 % page_size
    assert cache.total_size() == aligned
    for n in range(len(seq) + 1):
        result = cache.match_prefix(seq[:n])
        assert result.prefix_len == n - n % page_size
        assert len(result.indices) == result.prefix_len
        assert cache.peek_prefix(seq[:n]) == result.prefix_len
    # A divergence inside a page matches only the pages before it.
    diverged = seq[: page_size + 1] + [99] * 8
    assert cache.match_prefix(diverged).prefix_len == page_size
    assert cache_sequence(cache, diverged) == page_size
    assert all(len(node) % page_size == 0 for node in cache._nodes())
    # Slot pages line up with token pages.
    indices = cache.match_prefix(seq).indices
    assert np.all(indices[::page_size] % page_size == 0)
    check(cache)


def test_values_are_read_only_and_not_the_callers_array():
    cache = make_cache()
    slots = cache.allocator.alloc(3)
    cache.insert([1, 2, 3], slots)
    slots[:] = 0
    result = cache.match_prefix([1, 2, 3])
    assert result.indices.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        result.indices[0] = 7


# -- eviction -------------------------------------------------------------------------------


def test_evict_frees_at_least_the_request_and_returns_slots():
    cache = make_cache(size=64)
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 5, 6])
    free_before = cache.allocator.available_size()
    freed = cache.evict(1)
    assert freed == 2
    assert cache.allocator.available_size() == free_before + 2
    assert cache.total_size() == 4
    check(cache)


def test_parent_left_as_unlocked_leaf_becomes_a_candidate():
    cache = make_cache(size=64)
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 5, 6])
    assert cache.evict(6) == 6
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert cache.allocator.available_size() == 64
    check(cache)


def test_heap_compaction_during_evict_keeps_the_index_exact():
    """Regression: compaction inside evict() once rebound the heap that evict was popping from,
    so leaves evicted from the old list stayed listed in the new one."""
    clock = ManualClock()
    cache = make_cache(size=4096, clock=clock, eviction_policy="mru")
    for i in range(300):  # a parent [i] with two leaves
        cache_sequence(cache, [i, 1000])
        cache_sequence(cache, [i, 1001])
    i = 0
    while len(cache._heap) < 2 * cache._num_evictable_leaves + 1024 - 300:
        clock.advance()  # under MRU a stale entry sorts after the live ones
        cache.match_prefix(tokens([i % 300, 1001]))
        i += 1
    clock.advance()
    for i in range(300):
        cache.match_prefix(tokens([i, 1000]))  # the newest: MRU evicts these first
    # Evicting the 300 [i, 1000] leaves halves the live count without a push; the next pop
    # uncovers a parent, whose push compacts the heap in the middle of evict().
    cache.evict(cache.evictable_size())
    assert cache.total_size() == 0
    check(cache)


def test_evict_with_everything_locked_frees_nothing():
    cache = make_cache(size=64)
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 5, 6])
    a = cache.match_prefix([1, 2, 3, 4]).last_node
    b = cache.match_prefix([1, 2, 5, 6]).last_node
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    assert cache.evict(100) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 6, 6)
    check(cache)


def test_evict_spares_locked_paths_and_takes_the_rest():
    cache = make_cache(size=64)
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 5, 6])
    keep = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(keep)
    assert cache.evict(100) == 2
    assert cache.peek_prefix([1, 2, 3, 4]) == 4
    assert cache.peek_prefix([1, 2, 5, 6]) == 2
    check(cache)


def test_evict_rejects_non_integers_and_ignores_non_positive():
    cache = make_cache()
    cache_sequence(cache, [1, 2])
    assert cache.evict(0) == 0 and cache.evict(-5) == 0
    with pytest.raises(InvalidArgumentError):
        cache.evict(1.5)
    assert cache.total_size() == 2


# -- locking --------------------------------------------------------------------------------


def test_lock_then_unlock_moves_exactly_the_path():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 3, 4, 5, 6])
    cache_sequence(cache, [1, 2, 9])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    total = cache.total_size()
    assert cache.inc_lock_ref(node) == -6
    assert (cache.evictable_size(), cache.protected_size()) == (total - 6, 6)
    check(cache)
    assert cache.inc_lock_ref(node) == 0, "a second lock moves nothing"
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 6
    assert (cache.evictable_size(), cache.protected_size()) == (total, 0)
    check(cache)


def test_unlock_at_zero_raises_and_changes_nothing():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    with pytest.raises(LockError):
        cache.dec_lock_ref(node)
    assert cache.evictable_size() == 3
    check(cache)


def test_locking_root_is_a_no_op_and_an_evicted_node_refuses():
    cache = make_cache()
    assert cache.inc_lock_ref(cache.root_node) == 0
    assert cache.dec_lock_ref(cache.root_node) == 0
    cache_sequence(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.evict(3)
    assert node.evicted
    with pytest.raises(LockError):
        cache.inc_lock_ref(node)
    with pytest.raises(LockError):
        cache.dec_lock_ref(node)
    check(cache)


# -- namespaces, disable, reset -------------------------------------------------------------


def test_namespaces_are_isolated():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3, 4], extra_key="lora-a")
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 4], extra_key="lora-b").prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 4], extra_key="lora-a").prefix_len == 4
    assert cache_sequence(cache, [1, 2, 3, 4]) == 0
    assert cache_sequence(cache, [1, 2, 3, 4], extra_key="lora-b") == 0
    a = cache.match_prefix([1, 2, 3, 4], extra_key="lora-a")
    b = cache.match_prefix([1, 2, 3, 4], extra_key="lora-b")
    assert not set(a.indices.tolist()) & set(b.indices.tolist())
    assert cache.total_size() == 12
    check(cache)
    assert cache.evict(12) == 12
    assert list(cache._roots) == [None], "empty namespaces are dropped"
    check(cache)


def test_disabled_cache_matches_nothing_and_takes_nothing():
    cache = make_cache(disable=True)
    slots = cache.allocator.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 4
    cache.allocator.free(slots)
    result = cache.match_prefix([1, 2, 3, 4])
    assert result.prefix_len == 0 and result.indices.size == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0
    check(cache)


def test_reset_returns_every_slot_and_refuses_while_locked():
    cache = make_cache(size=64, enable_kv_events=True)
    cache_sequence(cache, [1, 2, 3])
    cache_sequence(cache, [4, 5])
    node = cache.match_prefix([4, 5]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(LockError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.take_events()
    cache.reset()
    assert cache.total_size() == 0 and cache.allocator.available_size() == 64
    assert cache.take_events() == [AllBlocksCleared()]
    check(cache)


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [np.array([1.0, 2.0]), np.zeros((2, 2), dtype=np.int32), "abc", [1, "x"], [2**40]],
)
def test_bad_keys_raise_value_error(key):
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.match_prefix(key)
    with pytest.raises(ValueError):
        cache.insert(key, [1, 2])


def test_value_length_must_match_key():
    cache = make_cache()
    with pytest.raises(InvalidArgumentError, match="3 tokens"):
        cache.insert([1, 2, 3], [1, 2])
    with pytest.raises(InvalidArgumentError):
        cache.insert([1, 2], [1.0, 2.0])


def test_constructor_validates_its_arguments():
    allocator = PagedTokenToKVPoolAllocator(64, page_size=4)
    with pytest.raises(InvalidArgumentError, match="multiple"):
        RadixCache(allocator, page_size=2)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        RadixCache(allocator, page_size=0)
    with pytest.raises(InvalidArgumentError, match="eviction_policy"):
        RadixCache(allocator, page_size=4, eviction_policy="nope")
    RadixCache(TokenToKVPoolAllocator(64), page_size=8)


def test_key_dtypes_are_equivalent():
    cache = make_cache()
    cache_sequence(cache, [3, 4, 5])
    as_arrays = [np.array([3, 4, 5], dtype) for dtype in (np.int64, np.uint16)]
    for key in ([3, 4, 5], (3, 4, 5), *as_arrays):
        assert cache.peek_prefix(key) == 3
    assert cache.match_prefix([]).prefix_len == 0
    assert cache.match_prefix(np.array([], dtype=np.float64)).prefix_len == 0


# -- invariant check catches corruption -----------------------------------------------------


def _two_branch_cache() -> RadixCache:
    cache = make_cache(size=64)
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 5, 6])
    return cache


def test_invariants_catch_size_drift():
    cache = _two_branch_cache()
    cache._evictable_size += 1
    with pytest.raises(CacheInvariantError, match="sizes"):
        cache.check_invariants()


def test_invariants_catch_a_slot_owned_twice():
    cache = _two_branch_cache()
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    other = cache.match_prefix([1, 2, 5, 6]).last_node
    leaf.value = other.value.copy()
    with pytest.raises(CacheInvariantError, match="owned by two nodes"):
        cache.check_invariants()


def test_invariants_catch_a_tree_slot_on_the_free_list():
    cache = _two_branch_cache()
    cache.allocator.free(cache.match_prefix([1, 2, 3, 4]).last_node.value)
    with pytest.raises(CacheInvariantError, match="free"):
        cache.check_invariants()


def test_invariants_catch_lock_inversion_and_negative_locks():
    cache = _two_branch_cache()
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    leaf.lock_ref = 1
    with pytest.raises(CacheInvariantError, match="exceeds its parent"):
        cache.check_invariants()
    leaf.lock_ref = -1
    with pytest.raises(CacheInvariantError, match="< 0"):
        cache.check_invariants()


def test_invariants_catch_a_stale_heap_key_and_a_missing_leaf():
    cache = _two_branch_cache()
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    leaf.last_access_time += 100
    with pytest.raises(CacheInvariantError, match="heap key"):
        cache.check_invariants()
    leaf.last_access_time -= 100
    cache._unlist(leaf)
    with pytest.raises(CacheInvariantError, match="evictable leaf"):
        cache.check_invariants()


def test_invariants_catch_siblings_sharing_a_first_page():
    cache = _two_branch_cache()
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    parent = leaf.parent
    del parent.children[leaf.key[:4]]
    parent.children[tokens([5]).tobytes()] = leaf
    with pytest.raises(CacheInvariantError, match="first page"):
        cache.check_invariants()


def test_pool_check_catches_a_leaked_slot():
    cache = _two_branch_cache()
    cache.allocator.alloc(1)
    with pytest.raises(CacheInvariantError, match="pool accounting"):
        pool_check(cache)


# -- page hashes and KV events --------------------------------------------------------------


def _reference_chain(token_ids, page_size, seed=b""):
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    out, prev = [], seed
    for start in range(0, len(data) - 4 * page_size + 1, 4 * page_size):
        prev = hashlib.sha256(prev + data[start : start + 4 * page_size]).digest()
        out.append(prev)
    return out


def test_kv_events_come_in_order_with_chained_hashes():
    cache = make_cache(size=64, page_size=2, enable_kv_events=True)
    cache_sequence(cache, [7, 7, 7, 7, 7, 7])
    cache_sequence(cache, [7, 7, 7, 7, 1, 2])
    events = cache.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    expected = _reference_chain([7] * 6, 2)
    assert list(first.block_hashes) == expected
    assert len(set(first.block_hashes)) == 3, "repeated pages still hash apart"
    assert first.parent_block_hash is None and first.token_ids == (7,) * 6
    assert second.parent_block_hash == expected[1]
    assert list(second.block_hashes) == _reference_chain([7, 7, 7, 7, 1, 2], 2)[2:]
    assert second.token_ids == (1, 2) and second.block_size == 2
    assert cache.take_events() == []
    cache.evict(2)
    removed = cache.take_events()
    assert len(removed) == 1 and isinstance(removed[0], BlockRemoved)
    assert removed[0].block_hashes in (first.block_hashes[2:], second.block_hashes)


def test_lazy_page_hashes_equal_eager_ones_and_namespaces_hash_apart():
    eager = make_cache(enable_kv_events=True)
    lazy = make_cache()
    for cache in (eager, lazy):
        cache_sequence(cache, [1, 2, 3, 4])
        cache_sequence(cache, [1, 2, 9])
    for seq in ([1, 2, 3, 4], [1, 2, 9]):
        chain_e, chain_l = [], []
        for cache, chain in ((eager, chain_e), (lazy, chain_l)):
            node = cache.match_prefix(seq).last_node
            while node.parent is not None:
                chain[:0] = cache.page_hashes(node)
                node = node.parent
        assert chain_e == chain_l == _reference_chain(seq, 1)
    cache_sequence(lazy, [1, 2, 3, 4], extra_key="salt")
    node = lazy.match_prefix([1], extra_key="salt").last_node
    assert lazy.page_hashes(node)[0] != _reference_chain([1], 1)[0]


# -- long inputs ----------------------------------------------------------------------------


def test_hundred_thousand_token_keys():
    cache = make_cache(size=250_000)
    rng = np.random.default_rng(0)
    long_key = rng.integers(0, 50_000, 100_000, dtype=np.int32)
    cache_sequence(cache, long_key)
    variant = long_key.copy()
    variant[77_777] = -1
    assert cache_sequence(cache, variant) == 77_777
    assert cache.match_prefix(long_key).prefix_len == 100_000
    assert cache.match_prefix(variant[:90_000]).prefix_len == 90_000
    check(cache)


def test_chain_thousands_of_nodes_deep():
    depth = 5000
    cache = make_cache(size=2 * depth + 8)
    seq = np.arange(1, depth + 1, dtype=np.int32)
    for n in range(1, depth + 1):
        assert cache_sequence(cache, seq[:n]) == n - 1
    assert len(cache._nodes()) == depth
    result = cache.match_prefix(seq)
    assert result.prefix_len == depth
    assert cache.inc_lock_ref(result.last_node) == -depth
    check(cache)
    assert cache.dec_lock_ref(result.last_node) == depth
    assert len(cache.page_hashes(result.last_node)) == 1
    assert cache.evict(depth) == depth
    check(cache)
    for n in range(1, depth + 1, 7):
        cache_sequence(cache, seq[:n])
    cache.reset()
    check(cache)


def test_peek_node_names_the_deepest_fully_matched_node():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3, 4])
    cache_sequence(cache, [1, 2, 3, 4, 5, 6])
    leaf = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    nodes = len(cache._nodes())
    assert cache.peek_node([1, 2, 3, 4, 5, 6, 7]) == (leaf, 6)
    assert cache.peek_node([1, 2, 3, 4, 5, 9]) == (leaf.parent, 5)
    assert cache.peek_node([1, 2, 9]) == (cache.root_node, 2)
    assert cache.peek_node([1, 2], extra_key="other") == (cache.root_node, 0)
    assert len(cache._nodes()) == nodes, "peeking never splits"
