"""Pure cache simulation: the radix cache alone, serving a trace in arrival order.

This is the classical comparison of eviction policies, the one the literature reports: no
scheduler, no queue and no cost model, so what is resident when a request arrives depends only
on the policy. Each request, in trace order:

1. `match_prefix` on its prompt; the matched tokens are its hits (whole pages, the whole prompt
   may match: a cached page's KV is reusable entirely);
2. the path is locked, and the policy's victims are evicted until the new pages fit;
3. its prompt, then its answer where the trace knows it (`output_ids`), is inserted and the path
   unlocked.

The cache is the server's `RadixCache` with the policy by name, so a policy is measured by the
code that serves. `belady` is the offline oracle of `radixserve.sim.oracle`, reading the
trace's future.

With `host_tokens` and `storage_tokens`, a host and a storage tier of that many tokens sit
behind the device pool (`sim.tiers`: the engine's own tier code with no KV moved; the host
written back as the device evicts, storage written through as each request ends, both
loaded back before a request's match). Their hits are counted apart: `host_hit_rate` and
`storage_hit_rate` of the prompt tokens came back from each, and `hit_rate` counts all tiers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

from radixserve.cache.allocator import PagedTokenToKVPoolAllocator
from radixserve.cache.radix import RadixCache
from radixserve.errors import InvalidArgumentError
from radixserve.sim.oracle import BeladyPolicy, served_sequence, unique_tokens
from radixserve.sim.replay import check_capacity, make_policy, policy_summary, pool_size
from radixserve.sim.tiers import lab_tiers
from radixserve.sim.traces import TraceRequest


@dataclass
class CacheOnlyResult:
    """What one pure cache simulation measured (`hit_rate` is over prompt tokens)."""

    eviction_policy: str
    kv_tokens_requested: int
    kv_tokens: int
    cache_fraction: float
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    evicted_tokens: int
    wall_seconds: float
    us_per_request: float
    host_tokens: int = 0
    host_hit_tokens: int = 0
    host_hit_rate: float = 0.0
    storage_tokens: int = 0
    storage_hit_tokens: int = 0
    storage_hit_rate: float = 0.0
    policy_summary: dict | None = None
    """The eviction policy's own account at the end (`sim.replay.policy_summary`)."""

    def as_dict(self) -> dict:
        return asdict(self)


def simulate_cache(
    trace: Sequence[TraceRequest],
    eviction_policy: str = "lru",
    *,
    kv_tokens: int | None = None,
    cache_fraction: float | None = None,
    page_size: int = 1,
    unique: int | None = None,
    check_invariants: bool = False,
    progress: bool = False,
    host_tokens: int = 0,
    host_page_size: int | None = None,
    host_eviction_policy: str = "lru",
    storage_tokens: int = 0,
) -> CacheOnlyResult:
    """Serve `trace` through a `RadixCache` alone, in arrival order, and count prompt hits.

    Give the capacity as `kv_tokens` or `cache_fraction` (percent of the trace's unique tokens;
    `unique` may pass a precomputed `unique_tokens(trace)`). With `check_invariants` the cache's
    invariant check runs after every request. `host_tokens` and `storage_tokens` add tiers (see
    the module doc) with pages of `host_page_size` (default: `page_size`, or 16 tokens at page
    size 1); the host tier evicts by `host_eviction_policy`.
    """
    if not trace:
        raise InvalidArgumentError("the trace is empty")
    check_capacity(kv_tokens, cache_fraction, "kv_tokens")
    if unique is None and cache_fraction is not None:
        unique = unique_tokens(trace)
    largest = max(len(served_sequence(r)) for r in trace)
    asked, used = pool_size(kv_tokens, cache_fraction, unique or 0, largest, page_size)
    allocator = PagedTokenToKVPoolAllocator(used, page_size)
    policy = make_policy(eviction_policy, trace, page_size, whole_prompt=True)
    now = [0.0]  # a logical clock: one tick per request, so runs are deterministic
    cache = RadixCache(allocator, page_size=page_size, eviction_policy=policy, clock=lambda: now[0])
    on_admit = policy.on_admit if isinstance(policy, BeladyPolicy) else None
    tiers = lab_tiers(cache, host_tokens, storage_tokens, host_page_size, host_eviction_policy)
    hits = prompt_tokens = evicted = 0
    started = time.perf_counter()
    for r in tqdm(trace, desc="cache-only", unit="req", disable=not progress, leave=False):
        now[0] += 1.0
        if tiers is not None:
            tiers.load(r.input_ids)
        match = cache.match_prefix(r.input_ids)
        hits += match.prefix_len
        prompt_tokens += len(r.input_ids)
        if on_admit is not None:
            on_admit(SimpleNamespace(rid=r.rid, last_node=match.last_node))
        seq = served_sequence(r)
        aligned = len(seq) - len(seq) % page_size
        new = aligned - match.prefix_len
        if new > 0:
            cache.inc_lock_ref(match.last_node)
            short = new - allocator.available_size()
            if short > 0:
                evicted += cache.evict(short)
            slots = allocator.alloc(new)
            if slots is None:  # cannot happen: the pool holds the largest request
                raise RuntimeError("the pool could not hold a request after eviction")
            cached = cache.insert(seq[:aligned], np.concatenate([match.indices, slots]))
            if cached > match.prefix_len:
                allocator.free(slots[: cached - match.prefix_len])
            cache.dec_lock_ref(match.last_node)
        if tiers is not None:
            tiers.finished(seq[:aligned])
        if check_invariants:
            cache.check_invariants()
            if tiers is not None:
                tiers.check_invariants()
    wall = time.perf_counter() - started
    host_hits = tiers.host_hit_tokens if tiers is not None else 0
    storage_hits = tiers.storage_hit_tokens if tiers is not None else 0
    return CacheOnlyResult(
        eviction_policy=eviction_policy,
        kv_tokens_requested=asked,
        kv_tokens=used,
        cache_fraction=used / unique if unique else math.nan,
        requests=len(trace),
        prompt_tokens=prompt_tokens,
        hit_tokens=hits,
        hit_rate=hits / prompt_tokens if prompt_tokens else 0.0,
        evicted_tokens=evicted,
        wall_seconds=wall,
        us_per_request=wall / len(trace) * 1e6,
        host_tokens=host_tokens,
        host_hit_tokens=host_hits,
        host_hit_rate=host_hits / max(1, prompt_tokens),
        storage_tokens=storage_tokens,
        storage_hit_tokens=storage_hits,
        storage_hit_rate=storage_hits / max(1, prompt_tokens),
        policy_summary=policy_summary(policy),
    )
