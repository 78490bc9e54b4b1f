"""KV tiers behind a lab cache, run by the engine's own tier code with no KV moved.

- A host tier of `host_tokens` is written back as the device pool evicts (the engine's
  `write_back`), and orders its pages by `host_eviction` (any eviction policy name).
- A storage tier of `storage_tokens` is written through as each request ends, as the engine's
  storage tier is. It stands for a capped store with LRU cleanup (the file backend's).

Before a request's first admission, what the host holds past the device's prefix is loaded,
then what storage holds past that: the engine's order of tiers, both done at once here (the
engine reads storage while the request waits in the queue; the scheduled replay charges the
time as `CostModel.host_load_per_token` and `storage_load_per_token`). A storage read is
skipped when `storage_worth(tokens, prefix)` says recomputing is faster, as the engine's
prefetch cost model decides. A page's payload is one byte per token, so tier sizes are in
tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixserve.cache.radix import RadixCache
from radixserve.cache.storage import StorageIdentity
from radixserve.cache.storage.host import HostStorage
from radixserve.cache.tiers import StorageTier
from radixserve.errors import InvalidArgumentError


class _NoKV:
    """A copier that moves nothing: a page's payload is one byte per token."""

    def export(self, slots) -> bytes:
        return bytes(len(slots))

    def load(self, slots, payload: bytes) -> None:
        pass


class LabTiers:
    """See the module doc. `page`: tier page in tokens (default the cache's page, or 16 at
    page size 1). Counts the tokens each tier loaded into the device tree."""

    def __init__(
        self,
        cache: RadixCache,
        host_tokens: int = 0,
        storage_tokens: int = 0,
        page: int | None = None,
        host_eviction: str = "lru",
        storage_worth: Callable[[int, int], bool] | None = None,
    ) -> None:
        self.storage_worth = storage_worth
        self.page = page or (16 if cache.page_size == 1 else cache.page_size)
        self.host = self._tier(cache, host_tokens, "host_cache", host_eviction)
        self.storage = self._tier(cache, storage_tokens, "storage_cache", "lru")
        if self.host is not None:
            host = self.host
            cache.evict_listener = lambda node: host.store(host.plan_evicted(node))
        self.host_hit_tokens = 0
        self.storage_hit_tokens = 0

    def _tier(self, cache: RadixCache, tokens: int, field: str, eviction: str):
        if not tokens:
            return None
        if not isinstance(tokens, int) or tokens < self.page:
            raise InvalidArgumentError(
                f"a tier needs at least one page ({self.page} tokens), got {tokens!r}",
                field=field,
            )
        identity = StorageIdentity("lab", "none", "none", self.page)
        store = HostStorage(identity, max_bytes=tokens, eviction_policy=eviction)
        return StorageTier(cache, store, _NoKV(), self.page)

    def load(self, key: Sequence[int]) -> int:
        """Before `key`'s first admission: load what the tiers hold past the device's prefix;
        return the tokens loaded."""
        host = self._load(self.host, key)
        self.host_hit_tokens += host
        storage = self._load(self.storage, key, self.storage_worth)
        self.storage_hit_tokens += storage
        return host + storage

    @staticmethod
    def _load(tier: StorageTier | None, key, worth=None) -> int:
        plan = None if tier is None else tier.plan_load(key)
        if plan is None:
            return 0
        if worth is not None:
            tokens = (len(plan.hashes) - plan.first) * tier.page_size
            if not worth(tokens, plan.first * tier.page_size):
                return 0
        return tier.admit(plan, tier.fetch(plan))

    def finished(self, key: Sequence[int]) -> None:
        """A request ended with `key` in the device tree: storage gets its new pages."""
        if self.storage is not None:
            self.storage.store(self.storage.plan_store(key))

    def check_invariants(self) -> None:
        for tier in (self.host, self.storage):
            if tier is not None:
                tier.storage.check_invariants()


def lab_tiers(
    cache: RadixCache, host_tokens: int = 0, storage_tokens: int = 0, *args, **options
) -> LabTiers | None:
    """`LabTiers(cache, host_tokens, storage_tokens, ...)`, or None when neither tier is
    asked for."""
    if not host_tokens and not storage_tokens:
        return None
    return LabTiers(cache, host_tokens, storage_tokens, *args, **options)
