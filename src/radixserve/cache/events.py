"""KV cache events: what entered and what left the radix tree, for KV-aware routers.

With `RadixCache(enable_kv_events=True)` the cache queues one event per tree node it stores or
removes, in the order they happen; `RadixCache.take_events()` drains the queue. Block hashes are
the chained page digests of `radixserve.cache.hashing`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages that entered the cache, in sequence order."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    """Digest of the page before the first one here; None when they start a sequence."""
    token_ids: tuple[int, ...]
    block_size: int
    extra_key: Hashable | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages that left the cache."""

    block_hashes: tuple[bytes, ...]
    extra_key: Hashable | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was emptied."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
