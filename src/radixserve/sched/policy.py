"""Queue orderings: which waiting request the scheduler tries to admit first.

An ordering is a strategy object with `name` and `order(waiting, cache) -> list[Req]`, where
`waiting` is in first-come-first-served order. `admission_order` applies it to a
`WaitingQueue`, bucket by priority bucket, after the starving requests. What one step costs
does not grow with the queue: every ordering sees at most `window` requests of a bucket
(`lpm_fallback_queue_len`, 128 by default), and the admission loop stops at the first request
that cannot be admitted.

- `fcfs`: arrival order. It reads the queue from its head, and never copies or sorts it.
- `lpm`: longest cached prefix first, measured with `peek_prefix` (which changes nothing). A
  bucket with more than `window` requests is served in arrival order, as SGLang does, since
  peeking them all would cost more than it gains.
- `dfs-weight`: depth-first over the radix tree, heavier subtrees (more waiting requests)
  first, so requests that share a prefix run back to back; within a subtree, requests that
  match deeper go first, and requests that match nothing go last. Above `window`, arrival
  order, as for `lpm`.
- `lof`: longest output (`max_new_tokens`) first, among the oldest `window` requests of a
  bucket; the rest follow in arrival order.
- `random`: a seeded shuffle of the oldest `window` requests; the rest follow in arrival order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np

from radixserve.cache.radix import RadixCache, TreeNode
from radixserve.errors import InvalidArgumentError
from radixserve.sched.queue import WaitingQueue
from radixserve.sched.request import Req

CACHE_AWARE = frozenset({"lpm", "dfs-weight"})


class SchedulePolicy(Protocol):
    name: str
    long_queue: str  # past `window` requests: "arrival" order, or reorder the oldest "window"
    window: int

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        """A new list of the same requests, the first to try first."""
        ...


class FCFS:
    name = "fcfs"
    long_queue = "arrival"

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        return list(waiting)


class LongestOutputFirst:
    name = "lof"
    long_queue = "window"

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        return sorted(waiting, key=lambda r: -r.sampling.max_new_tokens)


class RandomOrder:
    name = "random"
    long_queue = "window"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        return [waiting[i] for i in self._rng.permutation(len(waiting))]


class LongestPrefixMatch:
    name = "lpm"
    long_queue = "arrival"

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        cached = {id(r): cache.peek_prefix(r.token_ids(), r.extra_key) for r in waiting}
        return sorted(waiting, key=lambda r: -cached[id(r)])


class DFSWeight:
    name = "dfs-weight"
    long_queue = "arrival"

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        at_node: dict[TreeNode, list[Req]] = {}
        for r in waiting:
            node, _ = cache.peek_node(r.token_ids(), r.extra_key)
            at_node.setdefault(node, []).append(r)
        weight: dict[TreeNode, int] = {}
        roots: dict[TreeNode, None] = {}
        for node, reqs in at_node.items():
            walker: TreeNode | None = node
            while walker is not None:
                weight[walker] = weight.get(walker, 0) + len(reqs)
                if walker.parent is None:
                    roots[walker] = None
                walker = walker.parent
        # Post-order: a subtree's deeper (better cached) requests go before its shallower ones,
        # and the requests that match nothing go last.
        ordered: list[Req] = []
        stack: list[tuple[TreeNode, bool]] = [(n, False) for n in sorted(roots, key=weight.get)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                ordered.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            heavy = [c for c in node.children.values() if c in weight]
            heavy.sort(key=weight.get)
            stack.extend((c, False) for c in heavy)
        return ordered


def make_schedule_policy(
    name: str, *, lpm_fallback_queue_len: int = 128, seed: int = 0
) -> SchedulePolicy:
    """The ordering called `name`, seeing at most `lpm_fallback_queue_len` requests of a bucket;
    raises `InvalidArgumentError` naming the choices."""
    factories: dict[str, Callable[[], SchedulePolicy]] = {
        "fcfs": FCFS,
        "lpm": LongestPrefixMatch,
        "dfs-weight": DFSWeight,
        "lof": LongestOutputFirst,
        "random": lambda: RandomOrder(seed),
    }
    if name not in factories:
        raise InvalidArgumentError(
            f"schedule_policy must be one of {sorted(factories)}, got {name!r}"
        )
    if not isinstance(lpm_fallback_queue_len, int) or lpm_fallback_queue_len < 1:
        raise InvalidArgumentError(
            f"lpm_fallback_queue_len must be an integer >= 1, got {lpm_fallback_queue_len!r}"
        )
    policy = factories[name]()
    policy.window = lpm_fallback_queue_len
    return policy


def _arranged(policy: SchedulePolicy, bucket: Iterator[Req], cache: RadixCache) -> Iterable[Req]:
    """One bucket (in arrival order) as `policy` orders it, within its window."""
    if policy.name == "fcfs":
        return bucket
    head = list(itertools.islice(bucket, policy.window + 1))
    if len(head) <= policy.window:
        return policy.order(head, cache)
    if policy.long_queue == "arrival":
        return itertools.chain(head, bucket)
    return itertools.chain(policy.order(head[:-1], cache), head[-1:], bucket)


def admission_order(
    waiting: WaitingQueue,
    policy: SchedulePolicy,
    cache: RadixCache,
    now: float,
    *,
    max_queue_wait: float | None = None,
) -> Iterator[Req]:
    """The order in which to try the waiting requests, produced lazily.

    Anti-starvation first: a request queued for `max_queue_wait` seconds or more goes before
    every request that has not, oldest first, whatever the policy or priority says. Then each
    priority bucket, highest first (one bucket without priority scheduling), as the policy
    orders it. Requests admitted while this runs are skipped.
    """
    starving = waiting.starving(now, max_queue_wait) if max_queue_wait is not None else []
    yield from starving
    late = {id(r) for r in starving}
    for bucket in waiting.levels():
        for req in _arranged(policy, bucket, cache):
            if id(req) not in late and req in waiting:
                yield req


def order_queue(
    waiting: list[Req],
    policy: SchedulePolicy,
    cache: RadixCache,
    now: float,
    *,
    enable_priority: bool = False,
    max_queue_wait: float | None = None,
) -> list[Req]:
    """`admission_order` of a list of requests given in arrival order, as a list."""
    queue = WaitingQueue(by_priority=enable_priority)
    for req in waiting:
        queue.add(req)
    return list(admission_order(queue, policy, cache, now, max_queue_wait=max_queue_wait))
