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

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from radixserve.cache.hashing import TOKEN_DTYPE, hash_pages, leading_pages, remember_pages
from radixserve.cache.radix import RadixCache
from radixserve.cache.storage import StorageBackend
from radixserve.errors import InvalidArgumentError

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class LatencyHistogram:
    """Cumulative counts of observed seconds per upper bound, their sum and count (what a
    Prometheus histogram exposes); thread-safe."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.sum += seconds
            self.count += 1
            for k, bound in enumerate(self.buckets):
                if seconds <= bound:
                    self.counts[k] += 1

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """([(upper bound, cumulative count), ... ("+Inf", count)], sum)."""
        with self._lock:
            rows = [(repr(float(b)), c) for b, c in zip(self.buckets, self.counts, strict=True)]
            return [*rows, ("+Inf", self.count)], self.sum


class KVCopier(Protocol):
    def export(self, slots: np.ndarray) -> bytes:
        """The KV of `slots` (one storage page) as bytes."""

    def load(self, slots: np.ndarray, payload: bytes) -> None:
        """Write a page's bytes, as `export` made them, into `slots`."""


@dataclass(frozen=True)
class LoadPlan:
    """Storage pages a prompt could load: hashes[first:] extend the tree's prefix, which
    reached into page `first` when the plan was made."""

    key: np.ndarray
    extra_key: Hashable | None
    hashes: list[bytes]
    first: int


@dataclass(frozen=True)
class StorePlan:
    """Pages of a prefix to write: chain[start:], the bytes copied out of their slots, behind
    chain[:start] (the prefix's page hashes from its first page)."""

    chain: list[bytes]
    start: int
    payloads: list[bytes]

    @property
    def hashes(self) -> list[bytes]:
        """The hashes of the pages to write."""
        return self.chain[self.start :]


_NOTHING = StorePlan([], 0, [])


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
        self.load_latency = LatencyHistogram()  # reading pages (fetch)
        self.on_read: Callable[[int, float], None] | None = None  # (bytes, seconds) per fetch
        self.backup_latency = LatencyHistogram()  # writing pages (store)
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # page -> times offered to store
        self._known: OrderedDict[bytes, None] = OrderedDict()  # pages this tier saw stored
        self._known_lock = threading.Lock()

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
        return LoadPlan(key, extra_key, hashes, first)

    def held_after(
        self, key: Sequence[int], extra_key: Hashable | None, start: int, probe: bool = True
    ) -> int:
        """Tokens of `key` from token `start` on that this tier holds, in whole pages from the
        page `start` falls in (so the count ends on a page boundary). Changes nothing. With
        `probe` false, storage is not asked: the pages this tier stored or read count."""
        key = np.asarray(key, dtype=TOKEN_DTYPE)
        hashes = self._pages(key, extra_key)
        first = start // self.page_size
        if first >= len(hashes):
            return 0
        if probe:
            held = self.storage.chain_exists(hashes, first)
        else:
            with self._known_lock:
                held = leading_pages(hashes[first:], self._known)
        return max(0, (first + held) * self.page_size - start)

    def fetch(self, plan: LoadPlan) -> list[bytes]:
        """The leading pages of the plan that storage holds (thread-safe as the backend is)."""
        started = time.perf_counter()
        if self.storage.chain_exists(plan.hashes, plan.first) < self.min_pages:
            return []
        payloads = self.storage.chain_get(plan.hashes, plan.first)
        self._remember(plan.hashes[plan.first : plan.first + len(payloads)])
        if payloads:
            seconds = time.perf_counter() - started
            self.load_latency.observe(seconds)
            if self.on_read is not None:
                self.on_read(sum(len(p) for p in payloads), seconds)
        return payloads

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

    def plan_store(
        self,
        key: Sequence[int],
        extra_key: Hashable | None = None,
        min_hits: int = 1,
        probe: bool = True,
    ) -> StorePlan:
        """Copy out the whole storage pages of `key` the tree holds and storage lacks; with
        `min_hits` > 1, only the leading pages offered that many times so far. With `probe`
        false, storage is not asked: pages this tier has stored or read count as present (no
        I/O on the caller's thread; `store` skips any another process stored)."""
        key = np.asarray(key, dtype=TOKEN_DTYPE)
        held = self.cache.peek_prefix(key, extra_key)
        pages = held // self.page_size
        if self.cache.disable or pages == 0:
            return _NOTHING
        hashes = self._pages(key[: pages * self.page_size], extra_key)
        if min_hits > 1:
            pages = self._popular(hashes, min_hits)
            hashes = hashes[:pages]
        present = self.storage.chain_exists(hashes) if probe else self._known_prefix(hashes)
        if present == pages:
            return _NOTHING
        match = self.cache.match_prefix(key[: pages * self.page_size], extra_key, count_hit=False)
        p = self.page_size
        payloads = [
            self.copier.export(match.indices[k * p : (k + 1) * p]) for k in range(present, pages)
        ]
        return StorePlan(hashes, present, payloads)

    def clear(self) -> int:
        """Empty the store (this identity's pages) and forget what this tier knew of it;
        return how many pages were removed."""
        with self._known_lock:
            self._known.clear()
            self._seen.clear()
            return self.storage.clear()

    def _remember(self, hashes: Sequence[bytes]) -> None:
        with self._known_lock:
            remember_pages(self._known, hashes, 1 << 20)

    def _known_prefix(self, hashes: Sequence[bytes]) -> int:
        with self._known_lock:
            return leading_pages(hashes, self._known)

    def _popular(self, hashes: list[bytes], min_hits: int) -> int:
        """Count one more offer of each page; return how many leading pages reached
        `min_hits` offers."""
        seen, popular, leading = self._seen, 0, True
        for h in hashes:
            count = seen.pop(h, 0) + 1
            seen[h] = count
            leading = leading and count >= min_hits
            popular += leading
        while len(seen) > 1 << 20:
            seen.popitem(last=False)
        return popular

    def plan_evicted(self, node) -> StorePlan:
        """Copy out the storage pages that end inside `node`'s edge (a node `evict` is about
        to remove; its path is still in the tree), from the first one the store lacks."""
        keys, values, edge = [], [], len(node.value)
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            extra_key = node.extra_key
            node = node.parent
        p = self.page_size
        end = sum(len(v) for v in values)
        first, last = (end - edge) // p, end // p
        if last <= first:
            return _NOTHING
        key = np.frombuffer(b"".join(reversed(keys)), dtype=TOKEN_DTYPE)
        chain = hash_pages(key[: last * p], p, extra_key)
        present = first + self.storage.chain_exists(chain, first)
        if present >= last:
            return _NOTHING
        slots = np.concatenate(values[::-1])
        payloads = [self.copier.export(slots[k * p : (k + 1) * p]) for k in range(present, last)]
        return StorePlan(chain, present, payloads)

    def store(self, plan: StorePlan) -> int:
        """Write the plan's pages (thread-safe as the backend is); return how many stored."""
        if not plan.hashes:
            return 0
        started = time.perf_counter()
        stored = self.storage.chain_set(plan.chain, plan.start, plan.payloads)
        self._remember(plan.hashes[:stored])
        self.backup_latency.observe(time.perf_counter() - started)
        self.stored_tokens += stored * self.page_size
        return stored


class TierMatch(NamedTuple):
    """How much of a prompt each tier holds: `device` tokens from the start, then `host`
    tokens past those, then `storage` tokens past both."""

    device: int
    host: int
    storage: int

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


class TieredCache:
    """A `RadixCache` with the tiers behind it, matched as one cache.

    `match_prefix` reports the length each tier holds, and changes nothing (no access time,
    no split, no I/O unless `probe_storage`). The tree's own `match_prefix` stays the
    device-only call the scheduler makes every step; loading is the tiers' `plan_load`,
    `fetch` and `admit`.
    """

    def __init__(
        self,
        cache: RadixCache,
        host: StorageTier | None = None,
        storage: StorageTier | None = None,
    ) -> None:
        self.cache, self.host, self.storage = cache, host, storage

    def match_prefix(
        self, key: Sequence[int], extra_key: Hashable | None = None, *, probe_storage: bool = False
    ) -> TierMatch:
        """The device, host and storage lengths of `key`'s cached prefix; storage is counted
        from the pages this process stored or read unless `probe_storage` asks the backend."""
        device = self.cache.peek_prefix(key, extra_key)
        host = self.host.held_after(key, extra_key, device) if self.host is not None else 0
        storage = 0
        if self.storage is not None:
            storage = self.storage.held_after(key, extra_key, device + host, probe_storage)
        return TierMatch(device, host, storage)


PREFETCH_MODES = ("best_effort", "wait_complete", "timeout")


class PrefetchCostModel:
    """Whether reading a prefix from storage beats recomputing it, from measured rates.

    Loading n tokens costs `latency + n * bytes_per_token / read_bytes_per_s`; recomputing
    them costs `n / prefill_tokens_per_s`. Both rates are running averages of what the engine
    observes (or fixed when configured); until both are known, loading is tried. A refused
    load is still tried once in `probe_every`, so a storage that got faster is noticed.
    """

    def __init__(
        self,
        bytes_per_token: int,
        read_bytes_per_s: float | None = None,
        prefill_tokens_per_s: float | None = None,
        latency: float = 0.002,
        probe_every: int = 32,
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.read_bytes_per_s = read_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self._fixed_read = read_bytes_per_s is not None
        self._fixed_prefill = prefill_tokens_per_s is not None
        self.latency = latency
        self.probe_every = probe_every
        self._refused = 0

    def worth(self, tokens: int) -> bool:
        if self.read_bytes_per_s is None or self.prefill_tokens_per_s is None:
            return True
        load = self.latency + tokens * self.bytes_per_token / self.read_bytes_per_s
        if load < tokens / self.prefill_tokens_per_s:
            return True
        self._refused += 1
        return self._refused % self.probe_every == 0

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if not self._fixed_read and nbytes > 0 and seconds > 0:
            self.read_bytes_per_s = _ema(self.read_bytes_per_s, nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if not self._fixed_prefill and tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = _ema(self.prefill_tokens_per_s, tokens / seconds)


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class _Pending:
    plan: LoadPlan
    future: object  # concurrent.futures.Future of the fetched payloads
    deadline: float | None  # when the request stops waiting (None: it waits for the read)
    waiting: bool = True


class StorageIO:
    """Runs a `StorageTier`'s reads and writes on threads of their own, for one engine.

    `begin(rid, key)` starts reading what storage holds past the tree's prefix and says
    whether the request should wait for it (`prefetch` mode `wait_complete`: until the read
    ends; `timeout`: at most `timeout` seconds; `best_effort`: not at all, the pages help
    whoever comes later). `ready()`, on the engine thread, puts finished reads into the tree
    and returns the requests that may now be scheduled. `write(key)` copies a prefix's new
    pages out now and stores them in the background. Every method but `wait` is for the
    engine thread.
    """

    def __init__(
        self,
        tier: StorageTier,
        cost: PrefetchCostModel,
        prefetch: str = "timeout",
        timeout: float = 2.0,
        threads: int = 2,
        clock=None,
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if prefetch not in PREFETCH_MODES:
            raise InvalidArgumentError(
                f"hicache_prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}",
                field="hicache_prefetch",
            )
        self.tier, self.cost, self.prefetch, self.timeout = tier, cost, prefetch, timeout
        tier.on_read = cost.observe_read
        self.clock = clock or time.monotonic
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="radixserve-kv-storage")
        self._pending: dict[str, _Pending] = {}
        self._orphans: list[_Pending] = []  # reads whose request stopped waiting
        self._writes: set = set()
        self.loaded: dict[str, int] = {}  # rid -> tokens its read put into the tree

    def begin(self, rid: str, key: Sequence[int], extra_key: Hashable | None = None) -> bool:
        plan = self.tier.plan_load(key, extra_key)
        if plan is None:
            return False
        tokens = (len(plan.hashes) - plan.first) * self.tier.page_size
        if not self.cost.worth(tokens):
            return False
        future = self._pool.submit(self.tier.fetch, plan)
        waits = self.prefetch != "best_effort"
        deadline = self.clock() + self.timeout if self.prefetch == "timeout" else None
        self._pending[rid] = _Pending(plan, future, deadline, waits)
        return waits

    def ready(self) -> list[str]:
        """Admit finished reads; return the waiting requests that may now be scheduled."""
        now = self.clock()
        released = []
        for p in [p for p in self._orphans if p.future.done()]:
            self._orphans.remove(p)
            self._admit(p)
        for rid, p in list(self._pending.items()):
            if p.future.done():
                del self._pending[rid]
                self.loaded[rid] = self._admit(p)
                if p.waiting:
                    released.append(rid)
            elif p.deadline is not None and now >= p.deadline:
                del self._pending[rid]
                self._orphans.append(p)
                released.append(rid)
            elif not p.waiting:  # best effort: the request is already scheduled
                del self._pending[rid]
                self._orphans.append(p)
        return released

    def _admit(self, p: _Pending) -> int:
        try:
            payloads = p.future.result()
        except Exception as exc:  # a backend bug must not take the engine down
            self.tier.storage.stats.warn_once("fetch", "KV storage read failed: %r", exc)
            return 0
        return self.tier.admit(p.plan, payloads)

    def cancel(self, rid: str) -> bool:
        """Stop waiting for `rid`'s read (its pages still go into the tree when they come)."""
        p = self._pending.pop(rid, None)
        if p is None:
            return False
        self._orphans.append(p)
        return p.waiting

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for any read to finish (any thread)."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        futures = [p.future for p in self._pending.values()]
        if futures:
            wait_futures(futures, timeout, FIRST_COMPLETED)

    def write(self, key: Sequence[int], extra_key: Hashable | None = None) -> None:
        plan = self.tier.plan_store(key, extra_key, probe=False)
        if plan.hashes:
            future = self._pool.submit(self.tier.store, plan)
            self._writes.add(future)
            future.add_done_callback(self._writes.discard)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the writes started so far have ended (any thread)."""
        from concurrent.futures import wait as wait_futures

        wait_futures(list(self._writes), timeout)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.tier.storage.close()
