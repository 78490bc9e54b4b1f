"""A storage tier behind a `RadixCache`: whole storage pages of cached prefixes are written to
a `StorageBackend`, and a prompt whose prefix the tree lacks but storage holds is loaded back
into device slots and inserted, so the scheduler finds it as an ordinary cached prefix.

The cache layer holds no tensors: the tier hands slot numbers to a `KVCopier` that the engine
supplies (`export` reads one page of slots into bytes, `load` writes bytes into slots).

The work is split so that the slow part runs off the engine thread:
- `plan_load` (engine thread, cheap) names the storage pages a prompt could load;
- `fetch` (any thread) reads them from the backend;
- `admit` (engine thread) allocates slots, copies the pages in and inserts them: all of the
  fetched prefix or none of it (none when the pool cannot make room);
- `plan_store` (engine thread) copies out the pages of a finished request's prefix that storage
  lacks, and `store` (any thread) writes them.

Storage pages are `page_size` tokens (a multiple of the tree's page size), hashed as a chain
from the request's namespace (`cache.hashing`), so a tenant's pages are only found under its
own `extra_key`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from radixserve.cache.hashing import TOKEN_DTYPE, hash_pages
from radixserve.cache.radix import RadixCache
from radixserve.cache.storage import StorageBackend
from radixserve.errors import InvalidArgumentError


class KVCopier(Protocol):
    def export(self, slots: np.ndarray) -> bytes:
        """The KV of `slots` (one storage page) as bytes."""

    def load(self, slots: np.ndarray, payload: bytes) -> None:
        """Write a page's bytes, as `export` made them, into `slots`."""


@dataclass(frozen=True)
class LoadPlan:
    """Storage pages a prompt could load: hashes[first:first + count] extend the tree's
    prefix of `device_tokens` tokens."""

    key: np.ndarray
    extra_key: Hashable | None
    hashes: list[bytes]
    first: int
    device_tokens: int


@dataclass(frozen=True)
class StorePlan:
    """Pages of a prefix to write: their hashes and the bytes copied out of their slots."""

    hashes: list[bytes]
    payloads: list[bytes]


class StorageTier:
    """See the module doc. `min_pages`: a load shorter than this is not worth a read."""

    def __init__(
        self,
        cache: RadixCache,
        storage: StorageBackend,
        copier: KVCopier,
        page_size: int,
        min_pages: int = 1,
    ) -> None:
        if page_size < 1 or page_size % cache.page_size:
            raise InvalidArgumentError(
                f"the storage page size ({page_size}) must be a positive multiple of the "
                f"cache's page size ({cache.page_size})",
                field="hicache_page_size",
            )
        self.cache, self.storage, self.copier = cache, storage, copier
        self.page_size = page_size
        self.min_pages = max(1, min_pages)
        self.loaded_tokens = 0
        self.stored_tokens = 0

    def _pages(self, key: np.ndarray, extra_key: Hashable | None) -> list[bytes]:
        whole = len(key) - len(key) % self.page_size
        return hash_pages(key[:whole], self.page_size, extra_key)

    def plan_load(self, key: Sequence[int], extra_key: Hashable | None = None) -> LoadPlan | None:
        """The storage pages past the tree's prefix of `key` worth asking for, or None."""
        if self.cache.disable:
            return None
        key = np.asarray(key, dtype=TOKEN_DTYPE)
        device = self.cache.peek_prefix(key, extra_key)
        hashes = self._pages(key, extra_key)
        first = device // self.page_size
        if len(hashes) - first < self.min_pages:
            return None
        return LoadPlan(key, extra_key, hashes, first, device)

    def fetch(self, plan: LoadPlan) -> list[bytes]:
        """The leading pages of the plan that storage holds (thread-safe as the backend is)."""
        wanted = plan.hashes[plan.first :]
        if self.storage.exists(wanted) < self.min_pages:
            return []
        return self.storage.get(wanted)

    def admit(self, plan: LoadPlan, payloads: Sequence[bytes]) -> int:
        """Put the fetched pages into the tree; return the tokens the tree gained (0 when the
        pool has no room for all of them, or the tree already holds them by now)."""
        if len(payloads) < self.min_pages:
            return 0
        p = self.page_size
        start, end = plan.first * p, (plan.first + len(payloads)) * p
        match = self.cache.match_prefix(plan.key[:start], plan.extra_key, count_hit=False)
        if match.prefix_len < start:
            return 0  # the prefix it extends was evicted meanwhile
        allocator = self.cache.allocator
        need = end - start
        self.cache.inc_lock_ref(match.last_node)  # making room must not evict what we extend
        try:
            short = need - allocator.available_size()
            if short > 0:
                self.cache.evict(short)
            slots = allocator.alloc(need)
            if slots is None:
                return 0
            for k, payload in enumerate(payloads):
                self.copier.load(slots[k * p : (k + 1) * p], payload)
            value = np.concatenate([match.indices, slots])
            before = self.cache.insert(plan.key[:end], value, extra_key=plan.extra_key)
        finally:
            self.cache.dec_lock_ref(match.last_node)
        if before > start:  # the tree got part of it meanwhile: those slots are duplicates
            allocator.free(slots[: before - start])
        gained = end - max(before, start)
        self.loaded_tokens += gained
        return gained

    def plan_store(self, key: Sequence[int], extra_key: Hashable | None = None) -> StorePlan:
        """Copy out the whole storage pages of `key` the tree holds and storage lacks."""
        key = np.asarray(key, dtype=TOKEN_DTYPE)
        held = self.cache.peek_prefix(key, extra_key)
        pages = held // self.page_size
        if self.cache.disable or pages == 0:
            return StorePlan([], [])
        hashes = self._pages(key[: pages * self.page_size], extra_key)
        present = self.storage.exists(hashes)
        if present == pages:
            return StorePlan([], [])
        match = self.cache.match_prefix(key[: pages * self.page_size], extra_key, count_hit=False)
        p = self.page_size
        payloads = [
            self.copier.export(match.indices[k * p : (k + 1) * p]) for k in range(present, pages)
        ]
        return StorePlan(hashes[present:], payloads)

    def store(self, plan: StorePlan) -> int:
        """Write the plan's pages (thread-safe as the backend is); return how many stored."""
        if not plan.hashes:
            return 0
        stored = self.storage.set(plan.hashes, plan.payloads)
        self.stored_tokens += stored * self.page_size
        return stored
