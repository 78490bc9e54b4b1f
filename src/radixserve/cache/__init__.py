"""The prefix cache: radix tree, eviction policies, KV slot allocators. Pure Python and numpy."""

from radixserve.cache.allocator import (
    SLOT_DTYPE,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from radixserve.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from radixserve.cache.evict import (
    EvictionPolicy,
    available_eviction_policies,
    make_eviction_policy,
    register_eviction_policy,
)
from radixserve.cache.hashing import hash_pages
from radixserve.cache.radix import MatchResult, RadixCache, TreeNode, encode_key, pool_check

__all__ = [
    "SLOT_DTYPE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EvictionPolicy",
    "KVCacheEvent",
    "MatchResult",
    "PagedTokenToKVPoolAllocator",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "available_eviction_policies",
    "encode_key",
    "hash_pages",
    "make_eviction_policy",
    "pool_check",
    "register_eviction_policy",
]
