"""Slot allocators and the request-to-token table."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.cache import PagedTokenToKVPoolAllocator, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.errors import InvalidArgumentError, SlotAllocationError


def test_token_allocator_hands_out_each_slot_once_and_never_slot_zero():
    alloc = TokenToKVPoolAllocator(10)
    assert alloc.num_slots == 11
    got = alloc.alloc(10)
    assert sorted(got.tolist()) == list(range(1, 11))
    assert got.dtype == np.int64
    assert alloc.available_size() == 0
    assert alloc.alloc(1) is None
    assert alloc.alloc(0).size == 0


def test_token_allocator_returns_none_when_short_and_changes_nothing():
    alloc = TokenToKVPoolAllocator(8)
    alloc.alloc(5)
    assert alloc.alloc(4) is None
    assert alloc.available_size() == 3


def test_freed_slots_are_reused():
    alloc = TokenToKVPoolAllocator(4)
    first = alloc.alloc(4)
    alloc.free(first[:2])
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == sorted(first[:2].tolist())


@pytest.mark.parametrize("bad", [[0], [11], [-1], [3, 3]])
def test_bad_frees_raise_and_leave_the_allocator_unchanged(bad):
    alloc = TokenToKVPoolAllocator(10)
    alloc.alloc(10)
    alloc.free([5])
    before = alloc.free_slots().tolist()
    if bad == [3, 3]:
        with pytest.raises(SlotAllocationError, match="twice"):
            alloc.free(bad)
    else:
        with pytest.raises(SlotAllocationError, match="outside"):
            alloc.free(bad)
    assert alloc.free_slots().tolist() == before


def test_double_free_across_calls_raises():
    alloc = TokenToKVPoolAllocator(10)
    got = alloc.alloc(3)
    alloc.free(got)
    with pytest.raises(SlotAllocationError, match="double free"):
        alloc.free(got[1:2])
    assert alloc.available_size() == 10


def test_free_rejects_non_integer_and_multi_dimensional_input():
    alloc = TokenToKVPoolAllocator(10)
    alloc.alloc(4)
    with pytest.raises(InvalidArgumentError):
        alloc.free(np.array([1.0]))
    with pytest.raises(InvalidArgumentError):
        alloc.free(np.array([[1, 2]]))
    alloc.free([])


def test_paged_allocator_hands_out_whole_aligned_pages():
    alloc = PagedTokenToKVPoolAllocator(32, page_size=4)
    assert alloc.num_pages == 8 and alloc.num_slots == 36
    got = alloc.alloc(8)
    assert got.size == 8
    pages = got.reshape(-1, 4)
    assert np.all(pages[:, 0] % 4 == 0)
    assert np.all(np.diff(pages, axis=1) == 1)
    assert np.all(pages[:, 0] >= 4), "page 0 is the padding page"
    assert alloc.available_size() == 24
    with pytest.raises(InvalidArgumentError, match="multiple"):
        alloc.alloc(3)


def test_paged_free_releases_the_pages_its_slots_lie_in():
    alloc = PagedTokenToKVPoolAllocator(32, page_size=4)
    got = alloc.alloc(8)
    alloc.free(got[5:6])
    assert alloc.available_size() == 28
    assert alloc.is_free(got).tolist() == [False] * 4 + [True] * 4
    with pytest.raises(SlotAllocationError, match="double free"):
        alloc.free(got[4:8])
    with pytest.raises(SlotAllocationError, match="outside"):
        alloc.free([2])


def test_allocator_constructor_validates():
    with pytest.raises(InvalidArgumentError):
        PagedTokenToKVPoolAllocator(10, page_size=4)
    with pytest.raises(InvalidArgumentError):
        PagedTokenToKVPoolAllocator(0, page_size=1)
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(-1)


def test_reset_frees_everything():
    alloc = PagedTokenToKVPoolAllocator(16, page_size=2)
    alloc.alloc(10)
    alloc.reset()
    assert alloc.available_size() == 16
    assert alloc.free_slots().tolist() == list(range(2, 18))


def test_req_to_token_pool_rows_and_writes():
    pool = ReqToTokenPool(max_requests=2, max_context=8)
    rows = pool.alloc(2)
    assert sorted(rows) == [0, 1] and pool.alloc(1) is None
    pool.write(rows[0], 2, np.array([7, 8, 9]))
    assert pool.read(rows[0], 5, start=2).tolist() == [7, 8, 9]
    with pytest.raises(InvalidArgumentError, match="max_context"):
        pool.write(rows[0], 6, [1, 2, 3])
    pool.free(rows[0])
    with pytest.raises(SlotAllocationError, match="double free"):
        pool.free(rows[0])
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        pool.write(rows[0], 0, [1])
    with pytest.raises(SlotAllocationError):
        pool.free(5)
    assert pool.alloc(1) == [rows[0]]
