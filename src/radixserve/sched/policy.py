"""Queue orderings: which waiting request the scheduler tries to admit first.

An ordering is a strategy object with `name` and `order(waiting, cache) -> list[Req]`, where
`waiting` is in first-come-first-served order. Priority scheduling and anti-starvation are
applied on top of any ordering by `order_queue`.

- `fcfs`: arrival order.
- `lpm`: longest cached prefix first, measured with `peek_prefix` (which changes nothing);
  falls back to fcfs above `lpm_fallback_queue_len` waiting requests, where peeking them all
  would cost more than it gains.
- `dfs-weight`: depth-first over the radix tree, heavier subtrees (more waiting requests)
  first, so requests that share a prefix run back to back; within a subtree, requests that
  match deeper go first, and requests that match nothing go last.
- `lof`: longest output (`max_new_tokens`) first.
- `random`: a seeded shuffle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from radixserve.cache.radix import RadixCache, TreeNode
from radixserve.errors import InvalidArgumentError
from radixserve.sched.request import Req

CACHE_AWARE = frozenset({"lpm", "dfs-weight"})


class SchedulePolicy(Protocol):
    name: str

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        """A new list of the same requests, the first to try first."""
        ...


class FCFS:
    name = "fcfs"

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        return list(waiting)


class LongestOutputFirst:
    name = "lof"

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        return sorted(waiting, key=lambda r: -r.sampling.max_new_tokens)


class RandomOrder:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        return [waiting[i] for i in self._rng.permutation(len(waiting))]


class LongestPrefixMatch:
    name = "lpm"

    def __init__(self, fallback_queue_len: int = 128) -> None:
        self.fallback_queue_len = fallback_queue_len

    def order(self, waiting: list[Req], cache: RadixCache) -> list[Req]:
        if len(waiting) > self.fallback_queue_len:
            return list(waiting)
        cached = {id(r): cache.peek_prefix(r.token_ids(), r.extra_key) for r in waiting}
        return sorted(waiting, key=lambda r: -cached[id(r)])


class DFSWeight:
    name = "dfs-weight"

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
    """The ordering called `name`; raises `InvalidArgumentError` naming the choices."""
    factories: dict[str, Callable[[], SchedulePolicy]] = {
        "fcfs": FCFS,
        "lpm": lambda: LongestPrefixMatch(lpm_fallback_queue_len),
        "dfs-weight": DFSWeight,
        "lof": LongestOutputFirst,
        "random": lambda: RandomOrder(seed),
    }
    if name not in factories:
        raise InvalidArgumentError(
            f"schedule_policy must be one of {sorted(factories)}, got {name!r}"
        )
    return factories[name]()


def order_queue(
    waiting: list[Req],
    policy: SchedulePolicy,
    cache: RadixCache,
    now: float,
    *,
    enable_priority: bool = False,
    max_queue_wait: float | None = None,
) -> list[Req]:
    """The admission order: the policy's, then higher priority first (stable) when enabled.

    Anti-starvation: a request queued for `max_queue_wait` seconds or more goes before every
    request that has not, oldest first, whatever the policy or priority says.
    """
    ordered = policy.order(waiting, cache)
    if enable_priority:
        ordered.sort(key=lambda r: -r.priority)
    if max_queue_wait is not None:
        starving = [r for r in ordered if now - r.queued_time >= max_queue_wait]
        if starving:
            starving.sort(key=lambda r: r.queued_time)
            late = {id(r) for r in starving}
            ordered = starving + [r for r in ordered if id(r) not in late]
    return ordered
