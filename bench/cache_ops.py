"""How fast is the cache hot path? RadixCache against a naive per-token radix tree, same run.

Workloads (token ids drawn from a 32,000-token vocabulary, fixed seed):
  (a) 10,000 requests of 1,024 tokens over 50 shared 768-token prefixes, unlimited pool;
  (b) the same with a 400,000-slot pool, so that eviction runs;
  (c) 1,000 requests of 16,384 shared tokens (one of 4 prefixes) plus 1,024 of their own.

Each request goes through the engine's cache path: match_prefix, lock, evict if the pool is
short, alloc, insert, free the duplicates, unlock. The reference is a radix tree like SGLang's
first version: children keyed by token, a per-token comparison loop, and an evict that scans
the whole tree for leaves on every call. It gets its keys as Python lists, its best format;
RadixCache gets int32 numpy arrays, and a logical clock that ticks once per call, so that
policies that read ages (`learned-lru`, `adaptive`) decide alike, and hit alike, in every run.
Reported per call: match and insert mean and p99 in µs, evict in ms; per workload: total time
and token hit rate; then the reference/radixserve ratios.

    python bench/cache_ops.py            # the full workloads
    python bench/cache_ops.py --quick    # a tenth of the requests
    python bench/cache_ops.py --policies lru,wgd,slru   # (b) under each eviction policy

With `--policies`, workload (b) is also run under each named eviction policy, each beside LRU
in the same run: the per-call costs and their ratio to LRU's, and the total's ratio in each of
`--rounds` rounds (default 3) that alternate LRU and the policy, with their median: on a
shared machine one pair of runs can be 20% off either way. The same ratios by the thread's
CPU time follow, which time spent descheduled does not inflate.
"""

from __future__ import annotations

import argparse
import functools
import gc
import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from radixserve.cache import MatchResult, RadixCache, TokenToKVPoolAllocator

VOCAB = 32_000
TARGETS = {"a": ("match", 10.0), "c": ("match", 30.0), "b": ("evict", 0.05)}


# -- the naive reference ------------------------------------------------------------------------


class NaiveNode:
    def __init__(self) -> None:
        self.children: dict[int, NaiveNode] = {}
        self.parent: NaiveNode | None = None
        self.key: list[int] = []
        self.value: np.ndarray | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()

    def __lt__(self, other: NaiveNode) -> bool:
        return self.last_access_time < other.last_access_time


def _key_match(key0: list[int], key1: list[int]) -> int:
    i = 0
    for a, b in zip(key0, key1, strict=False):
        if a != b:
            break
        i += 1
    return i


class NaiveRadixTree:
    """Per-token matching and a whole-tree leaf scan per evict, as in SGLang's first RadixCache."""

    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        self.root = NaiveNode()
        self.root.key, self.root.value, self.root.lock_ref = [], np.empty(0, np.int64), 1
        self.evictable = 0

    def match_prefix(self, key: list[int]) -> MatchResult:
        values: list[np.ndarray] = []
        node = self.root
        now = time.monotonic()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access_time = now
            n = _key_match(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
                values.append(child.value)
                node = child
                break
            values.append(child.value)
            node = child
            key = key[n:]
        indices = np.concatenate(values) if values else np.empty(0, np.int64)
        return MatchResult(indices, node, len(indices))

    def _split(self, child: NaiveNode, n: int) -> NaiveNode:
        new = NaiveNode()
        new.children = {child.key[n]: child}
        new.parent = child.parent
        new.lock_ref = child.lock_ref
        new.key, new.value = child.key[:n], child.value[:n]
        child.parent = new
        child.key, child.value = child.key[n:], child.value[n:]
        new.parent.children[new.key[0]] = new
        return new

    def insert(self, key: list[int], value: np.ndarray) -> int:
        node, matched = self.root, 0
        now = time.monotonic()
        while key:
            child = node.children.get(key[0])
            if child is None:
                leaf = NaiveNode()
                leaf.parent, leaf.key, leaf.value = node, key, value.copy()
                node.children[key[0]] = leaf
                self.evictable += len(key)
                break
            child.last_access_time = now
            n = _key_match(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            matched += n
            node, key, value = child, key[n:], value[n:]
        return matched

    def evict(self, num_tokens: int) -> int:
        leaves = self._collect_leaves()
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            if leaf.lock_ref > 0:
                continue
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self.evictable -= len(leaf.value)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if not parent.children and parent is not self.root:
                heapq.heappush(leaves, parent)
        return freed

    def _collect_leaves(self) -> list[NaiveNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def inc_lock_ref(self, node: NaiveNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable -= len(node.value)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: NaiveNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable += len(node.value)
            node.lock_ref -= 1
            node = node.parent


# -- workloads and the driver -----------------------------------------------------------------


@dataclass
class Workload:
    name: str
    keys: list[np.ndarray]
    pool: int


def make_workloads(scale: float, seed: int = 0) -> list[Workload]:
    rng = np.random.default_rng(seed)

    def draw(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n, dtype=np.int32)

    n_ab = max(1, int(10_000 * scale))
    prefixes = [draw(768) for _ in range(50)]
    keys_ab = [np.concatenate([prefixes[rng.integers(50)], draw(256)]) for _ in range(n_ab)]
    unlimited_ab = 50 * 768 + n_ab * 1024 + 1024
    n_c = max(1, int(1_000 * scale))
    long_prefixes = [draw(16_384) for _ in range(4)]
    keys_c = [np.concatenate([long_prefixes[rng.integers(4)], draw(1_024)]) for _ in range(n_c)]
    unlimited_c = 4 * 16_384 + n_c * (16_384 + 1_024)
    return [
        Workload("a", keys_ab, unlimited_ab),
        Workload("b", keys_ab, max(1024, int(400_000 * scale))),
        Workload("c", keys_c, unlimited_c),
    ]


@dataclass
class Timings:
    match: list[float] = field(default_factory=list)
    insert: list[float] = field(default_factory=list)
    evict: list[float] = field(default_factory=list)
    total: float = 0.0
    cpu: float = 0.0  # the thread's CPU time over the same span: what other tenants do not move
    hit_tokens: int = 0
    tokens: int = 0


def run(work: Workload, naive: bool = False, as_list: bool = False, policy: str = "lru") -> Timings:
    """Serve the workload's keys through the engine's cache path on one of the two trees."""
    gc.collect()  # start clean: garbage from the previous run would be collected on our clock
    allocator = TokenToKVPoolAllocator(work.pool)
    if naive:
        tree = NaiveRadixTree(allocator)
    else:
        # A logical clock, one tick per call: policies that read ages (learned-lru, adaptive)
        # then decide alike in every run, whatever the machine's speed.
        tick = functools.partial(next, itertools.count(0.0))
        tree = RadixCache(allocator, eviction_policy=policy, clock=tick)
    keys = [k.tolist() for k in work.keys] if naive or as_list else work.keys
    out = Timings()
    clock = time.perf_counter
    start, cpu_start = clock(), time.thread_time()
    for key in keys:
        t0 = clock()
        hit = tree.match_prefix(key)
        out.match.append(clock() - t0)
        tree.inc_lock_ref(hit.last_node)
        need = len(key) - hit.prefix_len
        short = need - allocator.available_size()
        if short > 0:
            t0 = clock()
            tree.evict(short)
            out.evict.append(clock() - t0)
        slots = allocator.alloc(need)
        full = np.concatenate([hit.indices, slots])
        t0 = clock()
        cached = tree.insert(key, full)
        out.insert.append(clock() - t0)
        allocator.free(full[hit.prefix_len : cached])
        tree.dec_lock_ref(hit.last_node)
        out.hit_tokens += hit.prefix_len
        out.tokens += len(key)
    out.total = clock() - start
    out.cpu = time.thread_time() - cpu_start
    if not naive:
        tree.check_invariants()
    return out


def _stats(samples: list[float], unit: float) -> tuple[float, float]:
    if not samples:
        return float("nan"), float("nan")
    arr = np.asarray(samples) * unit
    return float(arr.mean()), float(np.percentile(arr, 99))


def row(label: str, t: Timings) -> str:
    match, insert = _stats(t.match, 1e6), _stats(t.insert, 1e6)
    evict = _stats(t.evict, 1e3)
    return (
        f"  {label:<24}{match[0]:>9.2f}{match[1]:>9.2f}{insert[0]:>9.2f}{insert[1]:>9.2f}"
        f"{evict[0]:>10.4f}{len(t.evict):>7}{t.total:>9.2f}{t.hit_tokens / t.tokens:>8.1%}"
    )


def policy_rows(work: Workload, lru: Timings, policies: list[str], rounds: int) -> None:
    """Workload (b) under each policy, with its per-call costs over LRU's from this run, and
    its total over LRU's in each of `rounds` rounds that alternate the two."""
    for policy in policies:
        t = lru if policy == "lru" else run(work, policy=policy)
        print(row(f"radixserve, {policy}", t))
        totals, cpus = [t.total / lru.total], [t.cpu / lru.cpu]
        if policy != "lru":
            for _ in range(rounds - 1):
                base = run(work)
                other = run(work, policy=policy)
                totals.append(other.total / base.total)
                cpus.append(other.cpu / base.cpu)
        each = ", ".join(f"{r:.2f}" for r in totals)
        print(
            f"    / lru: match {np.mean(t.match) / np.mean(lru.match):.2f}x, insert "
            f"{np.mean(t.insert) / np.mean(lru.insert):.2f}x, evict "
            f"{np.mean(t.evict) / np.mean(lru.evict):.2f}x per call, total "
            f"{float(np.median(totals)):.2f}x (median of {len(totals)} rounds: {each}); "
            f"CPU time {float(np.median(cpus)):.2f}x "
            f"({', '.join(f'{r:.2f}' for r in cpus)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="run a tenth of the requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="", help="eviction policies to time on (b)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds alternating each policy with LRU"
    )
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    header = (
        f"  {'':<24}{'match µs':>18}{'insert µs':>18}{'evict ms':>10}{'calls':>7}"
        f"{'total s':>9}{'hit':>8}\n  {'':<24}{'mean':>9}{'p99':>9}{'mean':>9}{'p99':>9}"
    )
    for work in make_workloads(scale, args.seed):
        print(f"\nworkload ({work.name}): {len(work.keys)} requests, pool {work.pool} slots")
        print(header)
        ours = run(work)
        print(row("radixserve", ours))
        if work.name == "a":
            print(row("radixserve, list keys", run(work, as_list=True)))
        ref = run(work, naive=True)
        print(row("naive per-token tree", ref))
        if not ours.evict:  # with eviction, LRU tie-breaks may differ between the two trees
            assert ref.hit_tokens == ours.hit_tokens, "the two trees disagree on hits"
        ratios = [
            f"match {np.mean(ref.match) / np.mean(ours.match):.1f}x",
            f"insert {np.mean(ref.insert) / np.mean(ours.insert):.1f}x",
        ]
        if ours.evict:
            ratios.append(f"evict {np.mean(ref.evict) / np.mean(ours.evict):.1f}x")
        ratios.append(f"total {ref.total / ours.total:.1f}x")
        print("  speed-up over naive: " + ", ".join(ratios))
        if work.name == "b" and args.policies:
            policy_rows(work, ours, [p for p in args.policies.split(",") if p], args.rounds)
        what, limit = TARGETS[work.name]
        value = _stats(getattr(ours, what), 1e6 if what == "match" else 1e3)[0]
        unit = "µs" if what == "match" else "ms"
        verdict = "met" if value <= limit else "MISSED"
        print(f"  target: {what} mean {value:.3g} {unit} <= {limit} {unit}: {verdict}")


if __name__ == "__main__":
    main()
